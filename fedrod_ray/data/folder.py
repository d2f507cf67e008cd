"""``data.dataset: folder``: the user's images as files, decoded once with Pillow into uint8 N x C x H x W.

    <data.path>/train/<class>/*.png|jpg     training images, one folder per class
    <data.path>/test/<class>/*.png|jpg      the global test set
    <data.path>/clients/<client>/<class>/*  instead of train/: natural clients (data.partition: natural),
                                            each client's training images
    <data.path>/clients/<client>/test/<class>/*
                                            optionally, instead of test/: each client's own test images
                                            (every client has them); the global test set is their union

Class names are the class folders' names (sorted; label c is the c-th); client names, the client
folders'. Under clients/<client>/, ``test`` is the client's test set, never a class. Every image must
have the size and mode (L: grey, RGB) of the first one read: a set of mixed images would otherwise be
resized or converted silently. Names starting with a dot are skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .files import DatasetFormatError, DatasetNotFoundError
from .layout import RawImages

EXTENSIONS = (".png", ".jpg", ".jpeg")
MODES = ("L", "RGB")


def read_folder(path: str) -> RawImages:
    groups, test_groups = _layout(path)
    classes = tuple(sorted({c for g in (*groups.values(), *test_groups.values()) for c in g}))
    label = {c: i for i, c in enumerate(classes)}
    reader = _Reader()
    xs, ys, owners = _read(groups, label, reader)
    vx, vy, test_owners = _read(test_groups, label, reader)
    raw = RawImages(_stack(xs), np.asarray(ys, np.int64), _stack(vx), np.asarray(vy, np.int64), classes)
    if "" not in groups:
        raw.train_clients, raw.client_names = np.asarray(owners, np.int64), tuple(groups)
        if "" not in test_groups:  # the clients' own test sets, in the clients' order
            raw.test_clients = np.asarray(test_owners, np.int64)
    return raw


def image_shape(path: str) -> tuple[int, int, int] | None:
    """C x H x W of the first training image (which every other must match), from its header alone: the
    folders are listed but no image is decoded. None for a mode fedrod-ray does not read (loading says so)."""
    groups, _ = _layout(path)
    first = next(iter(next(iter(groups.values())).values()))[0]
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(first) as img:  # lazy: reads the header
            mode, (width, height) = img.mode, img.size
    except (OSError, UnidentifiedImageError) as e:
        raise DatasetFormatError(f"{first}: cannot be decoded: {e}") from e
    return ({"L": 1, "RGB": 3}[mode], height, width) if mode in MODES else None


def _layout(path: str) -> tuple[dict[str, dict[str, list[Path]]], dict[str, dict[str, list[Path]]]]:
    """The files of the folder at ``path`` (``_groups``), every rule of the layout checked."""
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
    return _groups(root, train, clients, test)


def _groups(root: Path, train: Path, clients: Path, test: Path
            ) -> tuple[dict[str, dict[str, list[Path]]], dict[str, dict[str, list[Path]]]]:
    """The training and the test images' files, by owner (a client's name, or "" for none) then class; the
    test images' owners are the clients, in the same order, where they have their own test sets."""
    if not clients.is_dir():
        if not test.is_dir():
            raise DatasetFormatError(f"data.path: {root} has no test/<class>/ folder")
        return {"": _class_files(train)}, {"": _class_files(test)}
    folders = _subfolders(clients)
    if not folders:
        raise DatasetFormatError(f"{clients}: no client folders")
    own = {name: folder / "test" for name, folder in folders.items() if (folder / "test").is_dir()}
    if own and test.is_dir():
        raise DatasetFormatError(f"{test}: the clients have test sets of their own (clients/<client>/test/), "
                                 "whose union is the global test set; remove test/ or move its images into them")
    if own and len(own) < len(folders):
        first = next(name for name in folders if name not in own)
        # Its P-FL would be read another way (the global test set weighed by its classes) than the others'.
        raise DatasetFormatError(f"{folders[first]}: has no test/ folder while other clients do; either every "
                                 "client has its own test set (clients/<client>/test/<class>/) or none does")
    if not own and not test.is_dir():
        raise DatasetFormatError(f"data.path: {root} has no test/<class>/ folder (nor clients/<client>/test/)")
    groups = {}
    for name, folder in folders.items():
        if own and not [p for p in _subfolders(folder) if p != "test"]:
            raise DatasetFormatError(f"{folder}: has test images but no training images (no class folders beside "
                                     "test/); a client's test set belongs to a client that trains")
        groups[name] = _class_files(folder, skip="test" if own else None)
    tests = {name: _class_files(path) for name, path in own.items()} if own else {"": _class_files(test)}
    return groups, tests


def _read(groups: dict[str, dict[str, list[Path]]], label: dict[str, int], reader: _Reader
          ) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Every image of ``groups`` (owner -> class -> files), its label and its owner's index."""
    xs, ys, owners = [], [], []
    for k, per_class in enumerate(groups.values()):
        for c, paths in per_class.items():
            xs += [reader.read(f) for f in paths]
            ys += [label[c]] * len(paths)
            owners += [k] * len(paths)
    return xs, ys, owners


def _subfolders(folder: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        if not p.is_dir():
            raise DatasetFormatError(f"{p}: expected only folders in {folder}")
        out[p.name] = p
    return out


def _class_files(folder: Path, skip: str | None = None) -> dict[str, list[Path]]:
    """class name -> its image files, sorted; an empty class folder is an error naming it. ``skip``: a
    subfolder that is not a class."""
    out = {}
    for name, sub in _subfolders(folder).items():
        if name == skip:
            continue
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
