"""What a server serves and its limits; also the argument model of the Ray Serve application builder.

The limits and their defaults' arithmetic are in docs/security.md."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from fedrod_ray.config.values import is_import_path

# Reload is allowed only with this token, and is off when it is unset or empty.
ADMIN_TOKEN_ENV = "FEDROD_ADMIN_TOKEN"


def _import_path(value: str) -> str:
    if not is_import_path(value):
        raise ValueError(f"{value!r} is not a package.module:factory import path")
    return value


Factory = Annotated[str, AfterValidator(_import_path)]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: str = Field(min_length=1, description="run directory (path or URI) whose final/ is served")
    max_batch: int = Field(256, ge=1, le=65536, description="images per /v1/predict request")
    # 16 MiB: 256 CIFAR-sized images as normalised JSON floats fit; a stray upload does not.
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="request body limit in bytes (413 above)")
    # 256 MiB: 16 bodies of the largest size at once; the next is a 503 until one is done.
    max_bodies_bytes: int = Field(256 * 2**20, ge=1024, description="bytes of request bodies held at once, "
                                                                  "all requests together (503 above)")
    body_timeout_s: float = Field(30.0, gt=0, le=3600, description="seconds a request body may take to "
                                                                  "arrive after its headers (408 after)")
    # 64 KiB: parsed in the serving process, such a body holds its GIL ~2 ms; larger ones go to the workers.
    parse_process_bytes: int = Field(64 * 1024, ge=8 * 1024, description="bodies larger than this are parsed "
                                     "in a parse worker process, not the serving one")
    parse_workers: int = Field(2, ge=1, le=64, description="parse worker processes, started on first need: "
                                                         "bodies parsed at once")
    parse_queue: int = Field(8, ge=0, le=4096, description="large bodies that may wait for a parse worker "
                                                          "(503 above)")
    parse_cpu_s: int = Field(5, ge=1, le=3600, description="CPU seconds a parse worker may spend on one "
                                                          "body (413 after)")
    reload_timeout_s: float = Field(60.0, gt=0, le=3600, description="seconds POST /v1/admin/reload waits "
                                                                     "for a model to load (409 after)")
    head_cache_size: int = Field(1024, ge=1, description="zero-shot heads kept for GET /v1/heads/{head_id}")
    client_tokens: str | None = Field(None, min_length=1, description="JSON file mapping training client ids "
                                      "to the sha256 digests of their tokens: serves each client its own "
                                      "head (linear), to it alone; unset, no client's head is served")
    allow_factories: tuple[Factory, ...] = Field((), description="package.module:factory archs a final/ may "
                                                                 "name, besides the built-ins and installed "
                                                                 "plug-ins")

    @model_validator(mode="after")
    def _one_body_fits(self):
        if self.max_bodies_bytes < self.max_body_bytes:
            raise ValueError(f"max_bodies_bytes ({self.max_bodies_bytes}) must be at least max_body_bytes "
                             f"({self.max_body_bytes}): a body of the largest size must fit")
        return self


class Connections(BaseModel):
    """What uvicorn's server (``fedrod-ray serve``) bounds before the app sees a request (api/protocol.py);
    on Ray Serve, HAProxy's settings (api/serve.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # 10 s: a request's line and headers are a few hundred bytes, sent at once by any client.
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="seconds a request's line and headers "
                                                                    "may take to arrive (408 after)")
    # 1,024 connections of at most 16 KiB of headers each: 16 MiB (docs/security.md).
    max_connections: int = Field(1024, ge=1, description="open connections (503 and closed above)")
