"""A request's nested-list images as one float32 array, their count and shape checked: numpy only, so that a
parse worker (parse_workers.py) can run it without torch and send back one array, not a Python float per
pixel."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


class Deferred:
    """Images that a parse worker could not make into an array: ``images.decode`` raises their error, after
    the request's checks that come before the images'."""

    def __init__(self, error: ApiError):
        self.error = error

    def __len__(self) -> int:  # nothing to decode
        return 0


def convert(request, shape: Sequence[int], max_batch: int):
    """``request`` (a parsed PredictRequest) with its ``images`` as one array, or Deferred with their error."""
    if request.images is None:
        return request
    try:
        error = count_error("images", len(request.images), max_batch)
        if error:
            raise error
        images = as_array(request.images, shape)
    except ApiError as e:
        images = Deferred(e)
    return request.model_copy(update={"images": images})
