"""``fedrod-ray serve RUN_DIR``: the HTTP API on uvicorn, or on Ray Serve with ``--ray``.

Registered with the library's CLI through the ``fedrod_ray.commands`` entry point (pyproject.toml), so
that ``fedrod_ray`` never imports ``api``.
"""

from __future__ import annotations

import argparse

from fedrod_ray.config import ConfigError

from .settings import Connections, Settings

# The flag of each setting whose name is not --setting-name.
FLAGS = {"model_dir": "RUN_DIR", "body_timeout_s": "--body-timeout", "header_timeout_s": "--header-timeout",
         "allow_factories": "--allow-factory", "parse_cpu_s": "--parse-cpu"}


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a run's final/ model over HTTP (uvicorn, or Ray Serve)")
    serve.add_argument("run_dir", metavar="RUN_DIR", help="run directory (path or URI) holding final/")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: "
                                                           "this machine only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000,
                       help="default 8000; 0 picks a free port (not with --ray)")
    serve.add_argument("--max-batch", type=int, default=Settings.model_fields["max_batch"].default,
                       help="images per /v1/predict request (default %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=Settings.model_fields["max_body_bytes"].default,
                       help="request body limit, 413 above (default %(default)s)")
    serve.add_argument("--max-bodies-bytes", type=int,
                       default=Settings.model_fields["max_bodies_bytes"].default,
                       help="bytes of request bodies held at once, all requests together; 503 with "
                            "Retry-After above (default %(default)s)")
    serve.add_argument("--body-timeout", type=float, default=Settings.model_fields["body_timeout_s"].default,
                       help="seconds a request body may take to arrive, 408 after (default %(default)s)")
    serve.add_argument("--parse-process-bytes", type=int,
                       default=Settings.model_fields["parse_process_bytes"].default,
                       help="bodies larger than this are parsed in a parse worker process, not the serving "
                            "one (default %(default)s)")
    serve.add_argument("--parse-workers", type=int, default=Settings.model_fields["parse_workers"].default,
                       help="parse worker processes: large bodies parsed at once (default %(default)s)")
    serve.add_argument("--parse-queue", type=int, default=Settings.model_fields["parse_queue"].default,
                       help="large bodies that may wait for a parse worker; 503 with Retry-After above "
                            "(default %(default)s)")
    serve.add_argument("--parse-cpu", type=int, default=Settings.model_fields["parse_cpu_s"].default,
                       help="CPU seconds a parse worker may spend on one body, 413 after (default %(default)s)")
    serve.add_argument("--header-timeout", type=float, default=None,
                       help=f"seconds a request's line and headers may take to arrive, 408 after "
                            f"(default {Connections.model_fields['header_timeout_s'].default}; with --ray, "
                            f"HAProxy's client timeout)")
    serve.add_argument("--max-connections", type=int, default=None,
                       help=f"open connections; more are answered 503 and closed (default "
                            f"{Connections.model_fields['max_connections'].default}; with --ray, HAProxy's "
                            f"maxconn)")
    serve.add_argument("--allow-factory", action="append", default=[], metavar="MODULE:CALLABLE",
                       help="a package.module:factory arch a final/ may name (repeatable); built-in archs and "
                            "installed fedrod_ray.models plug-ins need none. Only for code you trust: "
                            "loading a final/ calls it")
    serve.add_argument("--client-tokens", metavar="FILE",
                       help="serve each training client its own head (linear; predict's client_id), to that "
                            "client alone: FILE is a JSON object mapping client ids to the sha256 hex digests "
                            "of their tokens, which they send as 'Authorization: Bearer <token>' "
                            "(docs/http-api.md). Without it, no client's own head is served")
    serve.add_argument("--ray", action="store_true",
                       help="run on Ray Serve: joins the Ray cluster running on this machine or starts one")
    serve.set_defaults(handler=serve_command)


def serve_command(args) -> int:
    import os
    import socket

    from pydantic import ValidationError

    from fedrod_ray.models.export import ExportError

    from . import client_tokens
    from .service import load
    from .settings import ADMIN_TOKEN_ENV

    given = {"header_timeout_s": args.header_timeout, "max_connections": args.max_connections}
    try:
        settings = Settings(model_dir=args.run_dir, max_batch=args.max_batch, max_body_bytes=args.max_body_bytes,
                            max_bodies_bytes=args.max_bodies_bytes, body_timeout_s=args.body_timeout,
                            parse_process_bytes=args.parse_process_bytes, parse_workers=args.parse_workers,
                            parse_queue=args.parse_queue, parse_cpu_s=args.parse_cpu,
                            allow_factories=args.allow_factory, client_tokens=args.client_tokens)
        connections = Connections(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        field = err["loc"][0] if err["loc"] else "max_bodies_bytes"
        name = FLAGS.get(field, "--" + str(field).replace("_", "-"))
        raise ConfigError(f"{name}: {err['msg']}") from None
    if args.ray and args.port == 0:
        raise ConfigError("--port 0 does not work with --ray: Ray Serve needs a fixed port")
    try:
        if args.ray:
            # Checked here, so that a bad RUN_DIR or token file stops at once rather than in every replica.
            served = load(args.run_dir, 1, settings.allow_factories).served
            client_tokens.load(settings.client_tokens, served.meta.head)
            version = served.version_id
        else:
            from .app import create_app

            app = create_app(settings, admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None)
            version = app.state.service.current.served.version_id
    except ExportError as e:
        raise ConfigError(f"cannot serve {args.run_dir}: {e}") from None
    except client_tokens.ClientTokensError as e:
        raise ConfigError(f"--client-tokens: {e}") from None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as e:
        raise ConfigError(f"--host/--port: cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    if args.ray:
        from .serve import run

        sock.close()  # only a check: the Serve proxy listens itself
        run(settings, args.host, args.port, connections,
            explicit=[FLAGS[k] for k, v in given.items() if v is not None])
        return 0

    import gc

    import torch
    import uvicorn

    from .protocol import bounded_protocol

    # One core for the predictions (the app runs them one at a time), the others for the event loop and the
    # clients: for these small convolutions more torch threads mostly spin, badly on a loaded machine.
    torch.set_num_threads(1)
    # What is loaded by now (torch, the model) lives as long as the process: frozen, it is left out of the
    # full collections that a JSON batch's many small objects set off (64-image p99 90 -> 25 ms).
    gc.freeze()
    app.state.parse_workers.start()
    host, port = sock.getsockname()[:2]
    print(f"fedrod-ray: serving {args.run_dir} (model version {version}) at http://{host}:{port} "
          f"(API docs at /docs; Ctrl-C stops)", flush=True)
    try:
        protocol = bounded_protocol(connections.header_timeout_s, connections.max_connections)
        uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="info")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn has shut down gracefully, then re-raises Ctrl-C
        pass
    return 0
