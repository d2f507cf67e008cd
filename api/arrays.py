"""A request's images as one array, their count and shape checked: nested lists as float32, base64 PNGs as
their uint8 pixels. numpy (and Pillow) only, so that a parse worker (parse_workers.py) can run it without
torch and send back one array, not a Python float per pixel or the PNGs' base64."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import png
from .errors import ApiError


def count_error(field: str, count: int, max_batch: int) -> ApiError | None:
    if count > max_batch:
        return ApiError(field, f"has {count} images; this server takes at most {max_batch} per request")
    return None


def _shape_error(images: Sequence, shape: Sequence[int]) -> ApiError:
    """Name the first image, channel or row whose length is off."""
    c, h, w = shape

    def error(field: str, got: int, what: str, want: int) -> ApiError:
        return ApiError(field, f"has {got} {what}, expected {want}: this model takes images of shape "
                               f"[C, H, W] = {list(shape)}")

    for i, img in enumerate(images):
        if len(img) != c:
            return error(f"images[{i}]", len(img), "channels", c)
        for j, channel in enumerate(img):
            if len(channel) != h:
                return error(f"images[{i}][{j}]", len(channel), "rows", h)
            for k, row in enumerate(channel):
                if len(row) != w:
                    return error(f"images[{i}][{j}][{k}]", len(row), "pixels", w)
    raise AssertionError("no image is off the shape")  # only called when numpy found one


def as_array(images, shape: Sequence[int]) -> np.ndarray:
    """The N x C x H x W float32 array of nested lists (an array of that shape is itself)."""
    shape = tuple(shape)
    try:
        x = np.asarray(images, dtype=np.float32)  # twice as fast as torch.tensor here
    except ValueError:  # ragged
        raise _shape_error(images, shape) from None
    if tuple(x.shape[1:]) != shape:
        raise _shape_error(images, shape)
    return x


def from_pngs(pngs: Sequence[str], shape: Sequence[int]) -> np.ndarray:
    """The N x C x H x W uint8 pixels of base64 PNGs (``png.decode``: each must be an image of ``shape``)."""
    return np.stack([png.decode(s, shape, f"images_png[{i}]") for i, s in enumerate(pngs)])


class Deferred:
    """Images that a parse worker could not make into an array: ``images.decode`` raises their error, after
    the request's checks that come before the images'."""

    def __init__(self, error: ApiError):
        self.error = error

    def __len__(self) -> int:  # nothing to decode
        return 0


def convert(request, shape: Sequence[int], max_batch: int):
    """``request`` (a parsed PredictRequest) with its ``images`` or ``images_png`` as one array (the float32
    values, or the PNGs' uint8 pixels), or Deferred with their error."""
    field, given = ("images", request.images) if request.images is not None else ("images_png", request.images_png)
    if given is None:
        return request
    try:
        error = count_error(field, len(given), max_batch)
        if error:
            raise error
        converted = as_array(given, shape) if field == "images" else from_pngs(given, shape)
    except ApiError as e:
        converted = Deferred(e)
    return request.model_copy(update={field: converted})
