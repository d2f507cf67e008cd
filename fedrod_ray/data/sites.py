"""``data.dataset: sites``: what a site reads of its own clients, on the site's nodes, and the server's public
test set (``data.path``), which is all the server reads (docs/sites.md).

A site's data, at its ``path`` as the site's nodes see it, is one of:

    <path>/clients/<client>/<class>/*.png|jpg       each client's training images, one folder per class
    <path>/clients/<client>/test/<class>/*          optionally (every client of the site or none): its own
                                                    test images
    <path>/clients/<client>.npz                     or: x_train, y_train (optionally x_test, y_test), labels
                                                    0..C-1 in the order of the server's classes

The server's test set (``data.path``) is ``<path>/test/<class>/*`` or an .npz of ``x_test``, ``y_test``
(optionally ``class_names``). Its classes are the federation's: a client's class folder names one of them.
Clients are named by their folders (or files), and a site's are read one at a time, when trained
(``read_client``); ``index_site`` says what the site holds without decoding an image of it, and ``read_own_test`` reads a
client's own test set.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .files import DatasetFormatError, DatasetNotFoundError
from .folder import _class_files, _Reader, _stack, _subfolders
from .layout import check_labels, chw, to_nchw

CLIENTS = "clients"
OWN_TEST = "test"  # under clients/<client>/: the client's own test set, never a class


@dataclass
class ClientArrays:
    """One client's training examples: uint8 N x C x H x W images and int64 labels."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class SiteIndex:
    """What a site reports of its data when it starts: its clients' names (sorted), how many training
    examples each has, the images' C x H x W and whether its clients have their own test sets."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    image_shape: tuple[int, int, int]
    own_tests: bool


@dataclass(frozen=True)
class ServerTest:
    """The server's public test set: uint8 images, labels, and the class names (label c is the c-th)."""

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]


def site_clients(path: str, where: str) -> dict[str, Path]:
    """Each client's folder or .npz under ``<path>/clients/``, by name (sorted); ``where`` names the setting."""
    root = Path(path).expanduser() / CLIENTS
    if not root.is_dir():
        raise DatasetNotFoundError(f"{where}: {root} is not a directory (a site holds clients/<client>/<class>/ "
                                   "or clients/<client>.npz)")
    out: dict[str, Path] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            out[p.name] = p
        elif p.suffix == ".npz" and p.is_file():
            out[p.stem] = p
        else:
            raise DatasetFormatError(f"{p}: expected client folders or <client>.npz files in {root}")
    if not out:
        raise DatasetFormatError(f"{where}: {root} holds no clients")
    kinds = {p.is_dir() for p in out.values()}
    if len(kinds) > 1:
        raise DatasetFormatError(f"{where}: {root} mixes client folders and .npz files; keep one layout")
    return out


def index_site(path: str, classes: tuple[str, ...], where: str) -> SiteIndex:
    """The site's clients, their training examples' counts and the image shape: from the folders' listings and
    one image's header, or the .npz files' array headers (no image is decoded)."""
    clients = site_clients(path, where)
    sizes, own, shape = [], [], None
    for source in clients.values():
        if source.is_dir():
            train, test = _client_files(source, classes)
            sizes.append(sum(len(files) for files in train.values()))
            own.append(test is not None)
            if shape is None:
                shape = _image_shape(next(iter(train.values()))[0])
        else:
            shapes = _npz_shapes(source)
            sizes.append(shapes["x_train"][0])
            own.append("x_test" in shapes)
            if shape is None:
                shape = chw(shapes["x_train"], f"{source}: x_train")
    if len(set(own)) > 1:
        first = next(name for name, has in zip(clients, own) if not has)
        raise DatasetFormatError(f"{clients[first]}: has no test set of its own while other clients of the site "
                                 "do; either every client has one or none does")
    return SiteIndex(tuple(clients), tuple(int(n) for n in sizes), shape, own[0])


def read_client(source: Path, classes: tuple[str, ...]) -> ClientArrays:
    """Client ``source``'s training examples (a folder: classes in the order of ``classes``, files sorted), labels
    indices into ``classes``."""
    if source.is_dir():
        train, _ = _client_files(source, classes)
        return ClientArrays(*_decode(train, classes, _Reader()))
    arrays = _client_npz(source, ("x_train", "y_train"))
    return ClientArrays(*_npz_pair(arrays, "train", len(classes), source))


def read_own_test(source: Path, classes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """Client ``source``'s own test set (images, labels), or None where it has none."""
    if source.is_dir():
        _, own = _client_files(source, classes)
        return None if own is None else _decode(own, classes, _Reader())
    arrays = _client_npz(source, ("x_test", "y_test"))
    return _npz_pair(arrays, "test", len(classes), source) if "x_test" in arrays else None


def client_counts(source: Path, classes: tuple[str, ...]) -> np.ndarray:
    """Client ``source``'s training examples per class (length C), from its folders' listings or its labels."""
    if source.is_dir():
        train, _ = _client_files(source, classes)
        return np.array([len(train.get(c, ())) for c in classes], dtype=np.int64)
    y = _client_npz(source, ("y_train",))["y_train"]
    return np.bincount(check_labels(y, len(y), len(classes), f"{source}: y_train"), minlength=len(classes))


def _client_npz(source: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The arrays ``keys`` (those it has) of a client's .npz, whose members must be x_train, y_train and
    optionally x_test, y_test."""
    try:
        with np.load(source, allow_pickle=False) as npz:
            members = set(npz.files)
            arrays = {k: npz[k] for k in keys if k in members}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetFormatError(f"{source}: not a readable .npz: {e}") from e
    if members - {"x_test", "y_test"} != {"x_train", "y_train"} or ("x_test" in members) != ("y_test" in members):
        raise DatasetFormatError(f"{source}: a client's .npz holds x_train, y_train and optionally x_test, y_test; "
                                 f"it has {', '.join(sorted(members))}")
    return arrays


def read_server_test(path: str) -> ServerTest:
    """The server's public test set at ``data.path``: ``test/<class>/`` under a folder, or an .npz's x_test and
    y_test (with class_names, else classes class_0 .. class_{C-1})."""
    p = Path(path).expanduser()
    if p.is_dir():
        test = p / "test"
        if not test.is_dir():
            raise DatasetNotFoundError(f"data.path: {p} has no test/<class>/ folder (the server's test set)")
        files = _class_files(test)
        classes = tuple(files)
        x, y = _decode(files, classes, _Reader())
        return ServerTest(x, y, classes)
    if not p.is_file():
        raise DatasetNotFoundError(f"data.path: {p} does not exist (the server's test set: a folder with "
                                   "test/<class>/, or an .npz of x_test and y_test)")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetFormatError(f"data.path: {p} is not a readable .npz: {e}") from e
    extra = sorted(set(arrays) - {"x_test", "y_test", "class_names"})
    if extra or "x_test" not in arrays or "y_test" not in arrays:
        raise DatasetFormatError(f"data.path: {p} must hold x_test, y_test (optionally class_names) and only "
                                 f"those: the server holds no training data; it has {', '.join(sorted(arrays))}")
    if "class_names" in arrays:
        names = arrays["class_names"]
        if names.ndim != 1 or names.dtype.kind != "U" or not len(names) or len(set(names.tolist())) != len(names):
            raise DatasetFormatError(f"{p}: class_names must be a non-empty 1-D array of distinct strings")
        classes = tuple(names.tolist())
    else:
        top = int(arrays["y_test"].max()) if arrays["y_test"].size else 0
        classes = tuple(f"class_{c}" for c in range(top + 1))
    x, y = _npz_pair(arrays, "test", len(classes), p)
    return ServerTest(x, y, classes)


def server_image_shape(path: str) -> tuple[int, int, int] | None:
    """C x H x W of the server's test images from one header (``declared_image_shape``); None where it cannot
    be read here (loading says why)."""
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            files = _class_files(p / "test")
            return _image_shape(next(iter(files.values()))[0])
        return chw(_npz_shapes(p)["x_test"], f"{p}: x_test")
    except (DatasetFormatError, DatasetNotFoundError, OSError, KeyError):
        return None


def _client_files(folder: Path, classes: tuple[str, ...]
                  ) -> tuple[dict[str, list[Path]], dict[str, list[Path]] | None]:
    """A client folder's training files by class, and its own test set's (None: it has none), every class one
    of the server's."""
    train = _class_files(folder, skip=OWN_TEST)
    test = _class_files(folder / OWN_TEST) if OWN_TEST in _subfolders(folder) else None
    for files in (train, test or {}):
        unknown = next((c for c in files if c not in classes), None)
        if unknown is not None:
            raise DatasetFormatError(f"{folder}: class {unknown!r} is not one of the server's test set's classes "
                                     f"({', '.join(classes)})")
    return train, test


def _decode(files: dict[str, list[Path]], classes: tuple[str, ...], reader: _Reader) -> tuple[np.ndarray, np.ndarray]:
    label = {c: i for i, c in enumerate(classes)}
    order = [c for c in classes if c in files]
    images = [reader.read(f) for c in order for f in files[c]]
    labels = [label[c] for c in order for _ in files[c]]
    return _stack(images), np.asarray(labels, np.int64)


def _image_shape(first: Path) -> tuple[int, int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(first) as img:  # lazy: reads the header
            mode, (width, height) = img.mode, img.size
    except (OSError, UnidentifiedImageError) as e:
        raise DatasetFormatError(f"{first}: cannot be decoded: {e}") from e
    if mode not in ("L", "RGB"):
        raise DatasetFormatError(f"{first}: mode {mode}; fedrod-ray reads L or RGB images")
    return ({"L": 1, "RGB": 3}[mode], height, width)


def _npz_shapes(p: Path) -> dict[str, tuple[int, ...]]:
    """Each array's shape in an .npz, from its header alone."""
    out = {}
    try:
        with zipfile.ZipFile(p) as z:
            for name in z.namelist():
                with z.open(name) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    out[name.removesuffix(".npy")] = read(f)[0]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetFormatError(f"{p}: not a readable .npz: {e}") from e
    if "x_train" not in out and "x_test" not in out:
        raise DatasetFormatError(f"{p}: holds no images (x_train or x_test)")
    return out


def _npz_pair(arrays: dict[str, np.ndarray], part: str, num_classes: int, p: Path) -> tuple[np.ndarray, np.ndarray]:
    x = to_nchw(arrays[f"x_{part}"], f"{p}: x_{part}")
    return x, check_labels(arrays[f"y_{part}"], len(x), num_classes, f"{p}: y_{part}")
