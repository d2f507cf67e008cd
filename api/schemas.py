"""Request and response bodies, with the examples the OpenAPI schema shows.

Numbers are strict (``"3"`` and ``true`` are not numbers, ``2.5`` is not an integer, ``2.0`` is 2) and finite; request models forbid unknown
fields, so a misspelt field is an error that names it rather than a silently ignored one. What depends on
the served model (how many classes, the image shape) is checked by the service, not here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

HEAD_ID_PATTERN = r"^[0-9a-f]{32}$"
# Counts above 2**53 would lose precision as floats.
MAX_COUNT = 2**53
# A bound for the schema only (the service checks top_k against the model's classes): it keeps a
# 5,000-digit top_k out of the error message.
MAX_TOP_K = 2**20



def _integral(value):
    """9.0 as 9: the OpenAPI document's ``"type": "integer"`` is JSON Schema's, which a number with a zero
    fraction satisfies, and a request the schema allows is one the server takes (body_schema.py)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integer(minimum: int, maximum: int):
    """A strict integer ("3" and true are not) in [minimum, maximum]; the bounds are inside the conversion, so
    that the JSON Schema states them."""
    return Annotated[int, Strict(), Field(ge=minimum, le=maximum), BeforeValidator(_integral)]


Weight = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Count = _integer(0, MAX_COUNT)
Pixel = Annotated[float, Strict(), Field(allow_inf_nan=False)]
# Every list stops at its first invalid item: a body of 200,000 invalid items costs one error, not 200,000
# (collecting and reporting them held the server for seconds: issue 49).
FAIL_FAST = Field(fail_fast=True)
Image = Annotated[list[Annotated[list[Annotated[list[Pixel], FAIL_FAST]], FAIL_FAST]], FAIL_FAST]  # [C][H][W]

# MNIST's first test image (a 7) as a base64 PNG: the example for a model served from an MNIST run.
EXAMPLE_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAAAAABXZoBIAAAAwUlEQVR42mNgGDaAEUKFpD77sfTFHeyS9xQYGBg+X4UKPuk6w8DAwMDA"
    "AuGm6l/TMnSweCzLwPDntSTDozPIOhkYGBgYBA3PmDIw/Lh1XShnGi5nBP+9KIRLTuzl/2AokwlDMlv0/U1cGq1//rPD6fHWf7tZcclx"
    "nv1hhVNj3b9tOOW8f3+wxCUnfPffMlxyzKf/3VbGJan2758vLjn5B/+KGXF78Z8JLjnbT+iSSGFrw8Nw9wuKJAsy56LzO+ITGABpETyQ"
    "cCy90wAAAABJRU5ErkJggg=="
)
EXAMPLE_COUNTS = [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]
EXAMPLE_HEAD_ID = "3f2c1e0a9b8d7c6f5e4d3c2b1a098765"
EXAMPLE_VERSION = "5d6e1f0666858dc5"
DISTRIBUTION_FIELDS = ("class_distribution", "class_counts")
PERSONAL_FIELDS = (*DISTRIBUTION_FIELDS, "head_id", "client_id")


FIELDS_ERROR = "request_fields"


def _given(model: BaseModel, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(model, n) is not None]


def fields_error(field: str, message: str) -> PydanticCustomError:
    """A rule across fields, raised with the field(s) it is about (the error's loc is the whole body)."""
    return PydanticCustomError(FIELDS_ERROR, "{message}", {"field": field, "message": message})


class ErrorBody(BaseModel):
    detail: str = Field(description="what is wrong, starting with the field it is about")
    field: str | None = Field(description="the offending field, e.g. class_counts[3] or images[0][0][5]")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"detail": "class_distribution: has 9 entries; this model has 10 classes",
         "field": "class_distribution"},
    ]})


class Health(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"]


class Ready(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ready",
                                                               "model_version": EXAMPLE_VERSION}]})

    status: Literal["ready"]
    model_version: str


class _Distribution(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class_distribution: Annotated[list[Weight], Field(min_length=1, fail_fast=True)] | None = Field(
        None, description="a new client's class distribution: one non-negative weight per class, normalised "
                          "to sum 1 (so percentages work too)")
    class_counts: Annotated[list[Count], Field(min_length=1, fail_fast=True)] | None = Field(
        None, description="a new client's example count per class (integers); the same as sending the "
                          "distribution counts / sum(counts)")


class HeadRequest(_Distribution):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"class_counts": EXAMPLE_COUNTS},
        {"class_distribution": [0.25, 0, 0, 0, 0, 0.25, 0, 0.5, 0, 0]},
    ]})

    @model_validator(mode="after")
    def _one_distribution(self):
        if len(_given(self, DISTRIBUTION_FIELDS)) != 1:
            raise fields_error("class_distribution", "give exactly one of class_distribution, class_counts")
        return self


class HeadResponse(BaseModel):
    # Of a 2-class model with 3 features; an MNIST model's head has 10 x 50 weights.
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "head_id": EXAMPLE_HEAD_ID, "model_version": EXAMPLE_VERSION, "class_distribution": [0.75, 0.25],
        "shape": [2, 3], "weights": [[0.12, -0.03, 0.4], [-0.2, 0.05, 0.0]]}]})

    head_id: str = Field(description="the head's id at this server: the same model version and normalised "
                                     "distribution give the same id here; keyed by the server's secret, so "
                                     "no one can compute it offline")
    model_version: str
    class_distribution: list[float] = Field(description="the normalised distribution a, made into the head")
    shape: list[int] = Field(description="[num_classes, feature_dim]")
    weights: list[list[float]] = Field(description="H(a; nu), one row per class: personalized logits are "
                                                   "generic logits + weights @ features")


class PredictRequest(_Distribution):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"images_png": [EXAMPLE_PNG], "top_k": 3},
        {"images_png": [EXAMPLE_PNG], "class_counts": EXAMPLE_COUNTS},
    ]})

    images: Annotated[list[Image], Field(min_length=1, fail_fast=True)] | None = Field(
        None, description="images as nested arrays of the model's input shape [C, H, W]")
    pixels: Literal["raw", "normalized"] = Field(
        "raw", description="what `images` holds: raw pixels in 0..255, or values already normalised as "
                           "(pixel / 255 - mean) / std per channel (mean, std from GET /v1/model)")
    images_png: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = Field(
        None, description="images as base64 PNGs, H x W pixels, 8-bit grayscale (1 channel) or RGB (3)")
    top_k: _integer(1, MAX_TOP_K) | None = Field(None, description="how many top classes to list per image "
                                                                   "(default 3, or the number of classes if fewer)")
    head_id: str | None = Field(None, pattern=HEAD_ID_PATTERN,
                                description="personalize with a head made by POST /v1/heads")
    client_id: _integer(0, MAX_COUNT) | None = Field(
        None, description="personalize with a training client's own head (linear head only): served only to that "
                          "client, with its token (Authorization: Bearer), by a server given client tokens")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.images is None) == (self.images_png is None):
            raise fields_error("images", "give exactly one of images, images_png")
        if self.images_png is not None and self.pixels != "raw":
            raise fields_error("pixels", "applies to images only (PNG pixels are always raw)")
        personal = _given(self, PERSONAL_FIELDS)
        if len(personal) > 1:
            raise fields_error(personal[1], f"give at most one of {', '.join(PERSONAL_FIELDS)}, "
                                            f"not {' and '.join(personal)}")
        return self


class TopClass(BaseModel):
    index: int
    label: str
    probability: float


class Predictions(BaseModel):
    probabilities: list[list[float]] = Field(description="softmax over the classes, one row per image")
    top_k: list[list[TopClass]] = Field(description="the most probable classes of each image, best first")


class PersonalizedPredictions(Predictions):
    by: Literal["class_distribution", "class_counts", "head_id", "client_id"] = Field(
        description="which field chose the personalized head")
    # Defaults, so that an example may leave them out: FastAPI drops nulls from the schema's examples.
    head_id: str | None = Field(None, description="the zero-shot head used (hyper), for reuse by head_id")
    client_id: int | None = None
    personalized: bool = Field(True, description="false when the head is all zero (a client that never "
                                                  "trained), so these are the generic predictions")
    note: str | None = Field(None, description="why the predictions are not personalized, when they are not")


class PredictResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model_version": EXAMPLE_VERSION,
        "generic": {"probabilities": [[0.0, 0.0, 0.001, 0.0003, 0.0, 0.0, 0.0, 0.9987, 0.0, 0.0]],
                    "top_k": [[{"index": 7, "label": "7", "probability": 0.9987}]]},
        "personalized": {"probabilities": [[0.0, 0.0, 0.0001, 0.0, 0.0, 0.0, 0.0, 0.9999, 0.0, 0.0]],
                         "top_k": [[{"index": 7, "label": "7", "probability": 0.9999}]],
                         "by": "class_counts", "head_id": EXAMPLE_HEAD_ID, "personalized": True}}]})

    model_version: str
    generic: Predictions = Field(description="the generic model: h_G(f(x))")
    personalized: PersonalizedPredictions | None = Field(
        description="h_G(f(x)) + h_P(f(x)), when the request named a personalized head")


class InputSpec(BaseModel):
    shape: list[int] = Field(description="[C, H, W]")
    mean: list[float] = Field(description="per channel, for pixels scaled to 0..1")
    std: list[float]
    png_mode: Literal["L", "RGB"] = Field(description="the PIL mode images_png must have")


class Limits(BaseModel):
    max_batch: int
    max_body_bytes: int
    body_timeout_s: float
    head_cache_size: int


# What a private model's PrivacyInfo says (docs/privacy.md, threat model).
COVERED = ("the released model: final/model.safetensors, this service's generic predictions and the "
           "zero-shot heads it makes from a class distribution")
GUARANTEES = {
    "none": "none: trained without noise, so no finite epsilon bounds what the model reveals about a client",
    "secure": f"{COVERED} are (epsilon, delta)-DP for any one client's whole data, against anyone who reads "
              f"them; the noise and the client sampling came from the operating system's CSPRNG",
    "seeded": f"{COVERED} are (epsilon, delta)-DP for any one client's whole data only against whoever does "
              f"not know the run's seed: not private against anyone who knows the seed, which regenerates "
              f"the noise and the client sampling",
}
NOT_COVERED = [
    ("metrics: the accuracies (the personalized ones from un-noised local models) and the training losses "
     "take no noise"),
    ("personal heads: each training client's own head takes no noise (this service serves it only to that "
     "client, and only when started with client tokens)"),
    "checkpoints: they hold every client's un-noised personal state beside the noised global weights",
]


class PrivacyInfo(BaseModel):
    """The served model's client-level differential-privacy guarantee (``final/meta.json``'s ``privacy``)."""

    epsilon: float | None = Field(description="the model is (epsilon, delta)-DP with respect to any one client's "
                                              "whole data, after `round` rounds; null: no finite bound (no noise)")
    delta: float
    noise_multiplier: float = Field(description="sigma: the noise's standard deviation over the clip norm")
    clip_norm: float | None = Field(description="S, each client's update's L2 bound (adaptive clipping: the "
                                                "first); null: not clipped")
    adaptive_clip: bool
    sampling: str = Field(description="poisson (each client independently, at sampling_rate) or fixed")
    sampling_rate: float
    accountant: str = Field(description="rdp or pld, by Google's dp_accounting")
    noise: Literal["secure", "seeded"] = Field(
        description="where the noise and the client sampling came from: secure, the operating system's "
                    "CSPRNG; seeded, the run's seed, which regenerates them")
    guarantee: str = Field(description="what epsilon protects, and against whom")
    not_covered: list[str] = Field(description="what epsilon says nothing about")


class ModelInfo(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "version_id": EXAMPLE_VERSION, "dataset": "mnist", "class_names": [str(i) for i in range(10)],
        "num_classes": 10,
        "input": {"shape": [1, 28, 28], "mean": [0.1307], "std": [0.3081], "png_mode": "L"},
        "head": "hyper", "method": "hyper", "generic_model": "global", "new_client": "class_counts",
        "arch": "mnist_cnn", "hyper_hidden": 16,
        "rule": "fedavg", "balanced_loss": "bsm",
        "round": 5, "metrics": {"gfl_gm": 0.9763, "pfl_pm": 0.9769},
        "limits": {"max_batch": 256, "max_body_bytes": 16777216, "body_timeout_s": 30.0,
                   "head_cache_size": 1024}}, {
        # A private linear model, as the admin token sees it.
        "version_id": "92fc603cff48f93e", "dataset": "mnist", "class_names": [str(i) for i in range(10)],
        "num_classes": 10,
        "input": {"shape": [1, 28, 28], "mean": [0.1307], "std": [0.3081], "png_mode": "L"},
        "head": "linear", "method": "linear", "generic_model": "global", "new_client": "none",
        "arch": "mnist_cnn",
        "rule": "fedavg", "balanced_loss": "bsm", "round": 100,
        "metrics": {"gfl_gm": 0.9412, "pfl_pm": 0.9655}, "client_ids": [0, 1, 2, 3], "trained_client_ids": [0, 2, 3],
        "privacy": {"epsilon": 7.93, "delta": 1e-5, "noise_multiplier": 1.1, "clip_norm": 1.0,
                    "adaptive_clip": False, "sampling": "poisson", "sampling_rate": 0.1, "accountant": "rdp",
                    "noise": "secure", "guarantee": GUARANTEES["secure"], "not_covered": NOT_COVERED},
        "limits": {"max_batch": 256, "max_body_bytes": 16777216, "body_timeout_s": 30.0,
                   "head_cache_size": 1024}}]})

    version_id: str
    dataset: str
    class_names: list[str]
    num_classes: int
    input: InputSpec
    head: Literal["none", "linear", "hyper"] = Field(
        description="hyper: zero-shot heads from a class distribution; linear: stored per-client heads; "
                    "none: generic predictions only")
    method: str = Field(description="the personalization method that trained it (train.head): Fed-RoD's none, "
                                    "linear or hyper, or a personalized-FL baseline such as ditto or fedper")
    generic_model: Literal["global", "mean of personalized models"] = Field(
        description="what the generic predictions come from: the method's global model, or (a method without "
                    "one: FedPer, FedRep, LG-FedAvg, FedFOMO, MTL) the mean of the clients' personalized models")
    new_client: Literal["none", "class_counts", "data", "training"] = Field(
        description="what a client that never trained gives for the method's zero-shot model: none "
                            "(the generic model), class_counts (POST /v1/heads), or its data / training steps, "
                            "which this service does not take")
    arch: str
    # A default, so that an example may leave it out: FastAPI drops nulls from the schema's examples.
    hyper_hidden: int | None = Field(None, description="hypernetwork width (hyper head only)")
    rule: str
    balanced_loss: str
    round: int = Field(description="training rounds completed when the model was saved")
    metrics: dict[str, float | None] = Field(description="the last evaluation's accuracies (fractions)")
    # Who took part in training is not public: null without the admin token.
    client_ids: list[int] | None = Field(None, description="clients with a stored head (linear head only); "
                                                           "only with the admin token, null otherwise")
    trained_client_ids: list[int] | None = Field(
        None, description="those of client_ids whose head is not all zero (the others' personalized "
                          "predictions are the generic ones); only with the admin token, null otherwise")
    privacy: PrivacyInfo | None = Field(None, description="client-level differential privacy of the training "
                                                          "(docs/privacy.md); null: trained without it")
    limits: Limits


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"examples": [{}, {"model_dir": "/mnt/runs/mnist_paper"}]})

    model_dir: str | None = Field(None, min_length=1, description="run directory to serve from now on "
                                                                  "(default: the one being served)")


class ReloadResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"version_id": "92fc603cff48f93e", "previous_version_id": EXAMPLE_VERSION, "changed": True}]})

    version_id: str
    previous_version_id: str
    changed: bool
