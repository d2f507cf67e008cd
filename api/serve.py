"""The API on Ray Serve, for traffic one process cannot take: replicas of the same FastAPI app.

``serve run fedrod_ray_api.serve:app model_dir=RUN_DIR``, ``serve run deploy/serve_config.yaml`` (autoscaling) or
``fedrod-ray serve RUN_DIR --ray``. The only module of ``api`` that imports Ray.
"""

from __future__ import annotations

import gc
import time

import ray
from ray import serve
from ray.serve import Application

from .app import create_app
from .settings import Settings

APP_NAME = "fedrod"


@serve.deployment(ray_actor_options={"num_cpus": 1})
@serve.ingress()
class FedRodAPI:
    """One replica. Its admin reload stays disabled: it would reach only the replica that got the request,
    leaving the others on the old model. Deploying a new model_dir instead rolls out to every replica."""

    def __init__(self, settings: dict):
        self._app = create_app(Settings.model_validate(settings))
        gc.freeze()  # as `fedrod-ray serve` does: start-up objects stay out of full collections

    def __serve_build_asgi_app__(self):
        return self._app


def app(args: dict) -> Application:
    """The application builder: Serve calls it with the ``args`` of ``serve run`` or of the config file."""
    return FedRodAPI.bind(Settings.model_validate(args).model_dump())


def run(settings: Settings, host: str, port: int) -> None:
    """Deploy on the Ray cluster running on this machine (or a new local one) until Ctrl-C, then delete
    the application."""
    ray.init()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app(settings.model_dump()), name=APP_NAME, route_prefix="/")
        print(f"fedrod-ray: serving {settings.model_dir} on Ray Serve at http://{host}:{port} "
              f"(Ctrl-C stops)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
