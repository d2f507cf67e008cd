"""The request bodies' JSON Schemas as the served model takes them, for the OpenAPI schema.

Pydantic's schemas of ``schemas.py`` state the rules of one field. Added here: the rules across fields
(exactly one of images and images_png, at most one personalized head, pixels only with images) and those
that follow from the served model (class count, image shape, pixel range, top_k, batch size). So a request
the schema allows is one the server takes, short of what no schema can say: an unknown head_id or client_id
(404), a head this model does not have (409).
"""

from __future__ import annotations

from fedrod_ray.models.export import ModelMeta

from .schemas import DISTRIBUTION_FIELDS, PERSONAL_FIELDS, HeadRequest, PredictRequest, ReloadRequest

REF_TEMPLATE = "#/components/schemas/{model}"
# Weights up to this keep their sum finite for any class count a model has.
MAX_WEIGHT = 1e300
NOT_NULL = {"not": {"type": "null"}}
NULL = {"type": "null"}


def _one_of(names: tuple[str, ...], others: tuple[str, ...] = (), none_allowed: bool = False) -> dict:
    """Exactly one of ``names`` given (not null); with ``none_allowed``, at most one."""
    options = [{"required": [n], "properties": {n: NOT_NULL, **{m: NULL for m in names if m != n}}}
               for n in names]
    if none_allowed:
        options.append({"properties": {n: NULL for n in names}})
    return {"oneOf": options}


def _set(schema: dict, field: str, value: dict) -> None:
    """Replace the non-null alternative of an optional field."""
    prop = schema["properties"][field]
    prop["anyOf"] = [value, NULL]


def _distributions(schema: dict, n: int) -> None:
    _set(schema, "class_distribution", {
        "type": "array", "minItems": n, "maxItems": n,
        "items": {"type": "number", "minimum": 0, "maximum": MAX_WEIGHT},
        "contains": {"type": "number", "exclusiveMinimum": 0}})
    counts = schema["properties"]["class_counts"]["anyOf"][0]["items"]
    _set(schema, "class_counts", {"type": "array", "minItems": n, "maxItems": n, "items": counts,
                                  "contains": {"type": "integer", "minimum": 1}})


def _images(shape: list[int], lo: list[float], hi: list[float], max_batch: int) -> dict:
    c, h, w = shape

    def channel(k: int) -> dict:
        row = {"type": "array", "minItems": w, "maxItems": w,
               "items": {"type": "number", "minimum": lo[k], "maximum": hi[k]}}
        return {"type": "array", "minItems": h, "maxItems": h, "items": row}

    if len(set(zip(lo, hi))) == 1:
        image = {"type": "array", "minItems": c, "maxItems": c, "items": channel(0)}
    else:
        image = {"type": "array", "minItems": c, "maxItems": c, "prefixItems": [channel(k) for k in range(c)]}
    return {"type": "array", "minItems": 1, "maxItems": max_batch, "items": image}


def body_schemas(meta: ModelMeta, max_batch: int) -> dict[str, dict]:
    """name -> JSON Schema of each request body, for the model of ``meta``."""
    heads = HeadRequest.model_json_schema(ref_template=REF_TEMPLATE)
    _distributions(heads, meta.num_classes)
    heads.update(_one_of(DISTRIBUTION_FIELDS))

    predict = PredictRequest.model_json_schema(ref_template=REF_TEMPLATE)
    _distributions(predict, meta.num_classes)
    predict["properties"]["top_k"]["anyOf"][0]["maximum"] = meta.num_classes
    c = meta.image_shape[0]
    raw = _images(meta.image_shape, [0] * c, [255] * c, max_batch)
    # The exact range; the server allows a little rounding around it.
    normalized = _images(meta.image_shape, [(0 - m) / s for m, s in zip(meta.mean, meta.std)],
                         [(1 - m) / s for m, s in zip(meta.mean, meta.std)], max_batch)
    png = {"type": "string", "format": "byte", "contentEncoding": "base64", "contentMediaType": "image/png"}
    _set(predict, "images", raw)
    _set(predict, "images_png", {"type": "array", "minItems": 1, "maxItems": max_batch, "items": png})
    predict["allOf"] = [
        {"oneOf": [
            {"required": ["images"], "properties": {"images": raw, "pixels": {"const": "raw"},
                                                    "images_png": NULL}},
            {"required": ["images", "pixels"], "properties": {"images": normalized,
                                                              "pixels": {"const": "normalized"},
                                                              "images_png": NULL}},
            {"required": ["images_png"], "properties": {"images_png": NOT_NULL, "pixels": {"const": "raw"},
                                                        "images": NULL}},
        ]},
        _one_of(PERSONAL_FIELDS, none_allowed=True),
    ]
    return {"HeadRequest": heads, "PredictRequest": predict,
            "ReloadRequest": ReloadRequest.model_json_schema(ref_template=REF_TEMPLATE)}
