"""The HTTP service: a run's ``final/`` model behind FastAPI, on uvicorn (``fedrod-ray serve``) or Ray Serve.

``fedrod_ray_api.app.create_app`` builds the app. Nothing here imports training code or Ray, except ``fedrod_ray_api.serve``
(the Ray Serve deployment), so that the service starts quickly and a training refactor cannot break it.
This module imports nothing itself: the CLI reads ``fedrod_ray_api.settings`` without loading FastAPI or torch.
"""
