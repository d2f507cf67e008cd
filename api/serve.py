"""The API on Ray Serve, for traffic one process cannot take: replicas of the same FastAPI app.

``serve run fedrod_ray_api.serve:app model_dir=RUN_DIR``, ``serve run deploy/serve_config.yaml`` (autoscaling; both
with ``HIGH_THROUGHPUT_ENV`` in the environment) or ``fedrod-ray serve RUN_DIR --ray``. The only module of ``api``
that imports Ray.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from starlette.middleware import Middleware

from fedrod_ray.config import ConfigError

from .app import create_app
from .service import batched_probabilities
from .settings import Connections, Settings

APP_NAME = "fedrod"


# Ray's high-throughput mode for Serve: HAProxy (shipped with ray[serve] on Linux) takes the HTTP requests
# straight to the replicas' own HTTP servers, instead of Serve's Python proxy actor relaying each one over
# Ray. Ray's processes read these when they start, so they are set for a Ray that `run` starts and must be
# in the environment of `ray start` / `serve run` otherwise (bench/serve_latency.py compares both modes).
HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# A local Ray has no load balancer but its HAProxy, which retries a refused connection on another replica:
# a stopping replica need not stay up Ray's default 30 s for an external one to drop it (every Ctrl-C and
# redeploy would wait 35 s).
LOCAL_RAY_ENV = {**HIGH_THROUGHPUT_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def haproxy_env(connections: Connections) -> dict[str, str]:
    """HAProxy's settings for what uvicorn's protocol bounds (api/protocol.py), read by Ray's processes when
    they start. HAProxy reads a request's headers before any replica sees them: its http-request timeout
    bounds the time for all of them (408), its client timeout each wait, its buffer (tune.bufsize 16 KiB)
    their size. Its maxconn holds further connections in the kernel's queue instead of answering 503.

    Ray 2.60 has no setting for HAProxy's ``timeout http-request``, without which a client trickling a
    header byte every few seconds holds its connection for hours (1,100 of them made /healthz time out:
    issue 49). Its config template writes RAY_SERVE_HAPROXY_RETRY_ON's value, as is, on a line of the
    ``defaults`` section, so the timeout goes on a line after Ray's default retry-on (conn-failure)."""
    seconds = math.ceil(connections.header_timeout_s)
    return {"RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(seconds),
            "RAY_SERVE_HAPROXY_RETRY_ON": f"conn-failure\n    timeout http-request {seconds}s",
            "RAY_SERVE_HAPROXY_MAXCONN": str(connections.max_connections)}


def http_options(host: str, port: int, connections: Connections) -> dict:
    """``serve.start``'s HTTP options: HAProxy closes a connection idle between requests after the header
    timeout too (HTTPOptions.keep_alive_timeout_s, Ray's default 90 s, is its http-keep-alive timeout)."""
    return {"host": host, "port": port, "keep_alive_timeout_s": math.ceil(connections.header_timeout_s)}


# A replica's own variables (its runtime_env; deploy/serve_config.yaml sets the same). The high-throughput
# mode buffers 1,000 access-log records and formats them all at once: a ~10 ms stall every 1,000 requests,
# the p99 of /v1/heads at concurrency 8 (8-10 ms; 6.3-6.5 ms with 100, the same requests/s). The replica's
# HTTP server calls ``replica_middlewares`` for the middlewares around Serve's own handler (DirectReceive).
REPLICA_ENV = {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "100",
               "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "fedrod_ray_api.serve.replica_middlewares"}

# The request header with which a Ray Serve replica hands the app its HTTP server's own ``receive``.
DISCONNECT_DISABLED = b"x-request-disconnect-disabled"


class DirectReceive:
    """ASGI middleware of a replica's HTTP server (uvicorn, behind HAProxy): marks each request so that Serve
    hands the app uvicorn's ``receive`` itself. Otherwise Serve reads each request's messages into a queue of
    its own, eagerly and without limit (to notice a disconnect), so every body arrives in full, whatever the
    app reads: 12 bodies of 16 MiB held one byte short grew the replica by 197 MiB against a 64 MiB budget,
    60 complete ones by 1.2 GB against 256 MiB (issue 49). With uvicorn's ``receive``, uvicorn stops reading
    a connection while 64 KiB of it wait unread, so the bytes a replica holds are those BodyLimit counts.
    What Serve loses is cancelling a request whose client left; the app, like ``fedrod-ray serve``, answers
    it anyway (BodyLimit stops reading a body whose client left)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != DISCONNECT_DISABLED]
            scope["headers"].append((DISCONNECT_DISABLED, b"?1"))
        await self.app(scope, receive, send)


def replica_middlewares() -> list[Middleware]:
    """The middlewares of a replica's HTTP server (Serve calls this, named by REPLICA_ENV, when it starts)."""
    return [Middleware(DirectReceive)]


class BatchConfig(BaseModel):
    """The deployment's ``user_config`` (Serve applies a change without restarting the replicas)."""

    model_config = ConfigDict(extra="forbid")

    # Batches form while the previous one runs (Serve's batch queue does not wait for the forward), so only
    # a wait lets concurrent single images share one forward. A request alone in the replica does not wait.
    batch_wait_s: float = Field(0.002, ge=0, le=1, description="seconds a predict request waits for others "
                                                               "to share its forward, when others are in "
                                                               "the replica")


def _images(requests: list) -> int:
    return sum(len(x) for _, x, _ in requests)


@serve.deployment(ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": REPLICA_ENV}})
@serve.ingress()
class FedRodAPI:
    """One replica. Concurrent predict requests are batched (``@serve.batch``) into one forward of at most
    ``max_batch`` images, as many as one request may send, so a batch never needs more memory than the largest
    request. Its admin reload stays disabled: it would reach only the replica that got the request, leaving
    the others on the old model. Deploying a new model_dir instead rolls out to every replica."""

    def __init__(self, settings: dict):
        settings = Settings.model_validate(settings)
        self.forward.set_max_batch_size(settings.max_batch)
        self._in_flight = 0  # predict requests between decoding and their answer
        self.reconfigure({})
        self._app = create_app(settings, forward=self._predict, proxied=True)
        self._app.state.parse_workers.start()
        gc.freeze()  # as `fedrod-ray serve` does: start-up objects stay out of full collections

    def reconfigure(self, user_config: dict) -> None:
        self._batch_wait_s = BatchConfig.model_validate(user_config).batch_wait_s

    async def _predict(self, request: tuple) -> tuple:
        # The batch queue reads the wait when a batch's first request comes: none when it is alone, so a
        # lone request never waits for company that is not there (at concurrency 1, 2 ms of wait cost
        # 3-4 ms of latency).
        self._in_flight += 1
        try:
            self.forward.set_batch_wait_timeout_s(self._batch_wait_s if self._in_flight > 1 else 0.0)
            return await self.forward(request)
        finally:
            self._in_flight -= 1

    @serve.batch(max_batch_size=Settings.model_fields["max_batch"].default, batch_size_fn=_images)
    async def forward(self, requests: list) -> list:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._app.state.inference, batched_probabilities, requests)

    def __serve_build_asgi_app__(self):
        return self._app


def app(args: dict) -> Application:
    """The application builder: Serve calls it with the ``args`` of ``serve run`` or of the config file."""
    return FedRodAPI.bind(Settings.model_validate(args).model_dump())


def run(settings: Settings, host: str, port: int, connections: Connections, explicit: list[str]) -> None:
    """Deploy on the Ray cluster running on this machine (or a new local one) until Ctrl-C, then delete
    the application. ``explicit`` names the flags of ``connections`` given on the command line: they are
    refused on a running cluster, whose HAProxy keeps the settings it was started with."""
    # For a Ray that ray.init starts here (no `ray start` cluster runs): its processes read these when they
    # start. A running cluster keeps the mode it was started in.
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    for name, value in haproxy_env(connections).items():
        if explicit:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)
    ray.init()
    try:
        if explicit and not ray._private.worker._global_node.is_head():
            names = ", ".join(explicit)
            raise ConfigError(f"{names}: no effect on the running Ray cluster: its HAProxy reads "
                              f"{', '.join(haproxy_env(connections))} when `ray start` starts it; set them there")
        serve.start(http_options=http_options(host, port, connections))
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
