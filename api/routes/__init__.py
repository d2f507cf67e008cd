"""The HTTP API's routes, one ``APIRouter`` per concern, which ``fedrod_ray_api.app.create_app`` includes in
the order the OpenAPI document lists them: health, model, heads, predict, admin.

Each route reads what it serves from ``request.app.state`` (the model service, the settings, the inference
thread, a batching forward, the admin token): one app's routes never see another's.
"""
