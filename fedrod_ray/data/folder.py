"""``data.dataset: folder``: the user's images as files, decoded once with Pillow into uint8 N x C x H x W.

    <data.path>/train/<class>/*.png|jpg     training images, one folder per class
    <data.path>/test/<class>/*.png|jpg      the global test set
    <data.path>/clients/<client>/<class>/*  instead of train/: natural clients (data.partition: natural),
                                            each client's training images

Class names are the class folders' names (sorted; label c is the c-th); client names, the client
folders'. Every image must have the size and mode (L: grey, RGB) of the first one read: a set of mixed
images would otherwise be resized or converted silently. Names starting with a dot are skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .files import DatasetFormatError, DatasetNotFoundError
from .layout import RawImages

EXTENSIONS = (".png", ".jpg", ".jpeg")
MODES = ("L", "RGB")


def read_folder(path: str) -> RawImages:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetNotFoundError(f"data.path: {root} is not a directory (data.dataset=folder reads "
                                   "train/<class>/ and test/<class>/ under it)")
    train, clients, test = root / "train", root / "clients", root / "test"
    if train.is_dir() and clients.is_dir():
        raise DatasetFormatError(f"data.path: {root} has both train/ and clients/; keep one (clients/ holds "
                                 "the training images of natural clients)")
    if not train.is_dir() and not clients.is_dir():
        raise DatasetFormatError(f"data.path: {root} has neither train/<class>/ nor clients/<client>/<class>/")
    if not test.is_dir():
        raise DatasetFormatError(f"data.path: {root} has no test/<class>/ folder")
    if clients.is_dir():
        for folder in _subfolders(clients).values():
            if (folder / "test").is_dir():
                # Read as a class named "test", it would silently become training images.
                raise DatasetFormatError(f"{folder / 'test'}: per-client test sets are not supported yet; move "
                                         "these images to test/<class>/ (or rename the class)")
        groups = {name: _class_files(folder) for name, folder in _subfolders(clients).items()}
        if not groups:
            raise DatasetFormatError(f"{clients}: no client folders")
    else:
        groups = {"": _class_files(train)}
    test_files = _class_files(test)
    classes = tuple(sorted({c for g in groups.values() for c in g} | set(test_files)))
    label = {c: i for i, c in enumerate(classes)}
    reader = _Reader()
    xs, ys, owners = [], [], []
    for k, per_class in enumerate(groups.values()):
        for c, paths in per_class.items():
            xs += [reader.read(f) for f in paths]
            ys += [label[c]] * len(paths)
            owners += [k] * len(paths)
    vx = [reader.read(f) for paths in test_files.values() for f in paths]
    vy = [label[c] for c, paths in test_files.items() for _ in paths]
    raw = RawImages(_stack(xs), np.asarray(ys, np.int64), _stack(vx), np.asarray(vy, np.int64), classes)
    if clients.is_dir():
        raw.train_clients, raw.client_names = np.asarray(owners, np.int64), tuple(groups)
    return raw


def _subfolders(folder: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        if not p.is_dir():
            raise DatasetFormatError(f"{p}: expected only folders in {folder}")
        out[p.name] = p
    return out


def _class_files(folder: Path) -> dict[str, list[Path]]:
    """class name -> its image files, sorted; an empty class folder is an error naming it."""
    out = {}
    for name, sub in _subfolders(folder).items():
        files = [p for p in sorted(sub.iterdir()) if not p.name.startswith(".")]
        for p in files:
            if p.suffix.lower() not in EXTENSIONS or not p.is_file():
                raise DatasetFormatError(f"{p}: not an image file ({', '.join(EXTENSIONS)})")
        if not files:
            raise DatasetFormatError(f"{sub}: empty class folder (no {'/'.join(EXTENSIONS)} images)")
        out[name] = files
    if not out:
        raise DatasetFormatError(f"{folder}: no class folders (and so no examples)")
    return out


class _Reader:
    """Decodes images, holding every one to the size and mode of the first."""

    def __init__(self):
        self.first: tuple[Path, str, tuple[int, int]] | None = None

    def read(self, path: Path) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                img.load()
                mode, size, pixels = img.mode, img.size, np.asarray(img)
        except (OSError, UnidentifiedImageError) as e:
            raise DatasetFormatError(f"{path}: cannot be decoded: {e}") from e
        if mode not in MODES:
            raise DatasetFormatError(f"{path}: mode {mode}; fedrod-ray reads {' or '.join(MODES)} images "
                                     "(convert it, e.g. with Pillow's Image.convert)")
        if self.first is None:
            self.first = (path, mode, size)
        ref, ref_mode, ref_size = self.first
        if (mode, size) != (ref_mode, ref_size):
            raise DatasetFormatError(f"{path}: {size[0]}x{size[1]} {mode}, but {ref} (the first image) is "
                                     f"{ref_size[0]}x{ref_size[1]} {ref_mode}; all images must share size and mode")
        return pixels


def _stack(images: list[np.ndarray]) -> np.ndarray:
    arr = np.stack(images)  # N x H x W (L) or N x H x W x 3 (RGB), as Pillow gives them
    return np.ascontiguousarray(arr[:, None] if arr.ndim == 3 else arr.transpose(0, 3, 1, 2))
