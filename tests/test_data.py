"""Dataset loaders, downloader, data-dir look-up, synthetic data and batch transforms."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import os
import pickle
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import warnings
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrod_ray.config import DataConfig
from fedrod_ray.data import (
    DatasetFormatError,
    DatasetNotFoundError,
    augment_batch,
    cifar,
    files,
    load_dataset,
    normalize,
    resolve_data_dir,
)
from fedrod_ray.data.idx import read_idx
from fedrod_ray.data.transforms import normalized_black, shift_flip

IDX_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


# ---------------------------------------------------------------- writers for the genuine formats


def idx_bytes(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | a.ndim) + b"".join(struct.pack(">I", d) for d in a.shape)
    return gzip.compress(header + a.tobytes())


def write_idx_set(folder: Path, names, rng, n_train=30, n_test=12, size=28, classes=10):
    """Write four IDX gzip files; return (train_x, train_y, test_x, test_y) as stored on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = (
        rng.integers(0, 256, (n_train, size, size), dtype=np.uint8),
        rng.integers(0, classes, n_train).astype(np.uint8),
        rng.integers(0, 256, (n_test, size, size), dtype=np.uint8),
        rng.integers(0, classes, n_test).astype(np.uint8),
    )
    for name, a in zip(names, arrays):
        (folder / name).write_bytes(idx_bytes(a))
    return arrays


def _py2_str(b: bytes) -> bytes:
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b


def _py2_int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    return b"M" + struct.pack("<H", v) if 0 <= v < 65536 else b"J" + struct.pack("<i", v)


def _py2_obj(o) -> bytes:
    if isinstance(o, str):
        return _py2_str(o.encode("latin1"))
    if isinstance(o, int):
        return _py2_int(o)
    if isinstance(o, list):
        return b"](" + b"".join(_py2_obj(v) for v in o) + b"e"
    if isinstance(o, dict):
        return b"}(" + b"".join(_py2_obj(k) + _py2_obj(v) for k, v in o.items()) + b"u"
    assert isinstance(o, np.ndarray) and o.dtype == np.uint8 and o.ndim == 2
    dtype = (b"cnumpy\ndtype\n" + _py2_str(b"u1") + _py2_int(0) + _py2_int(1) + b"\x87R("
             + _py2_int(3) + _py2_str(b"|") + b"NNN" + _py2_int(-1) + _py2_int(-1) + _py2_int(0) + b"tb")
    return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _py2_int(0) + b"\x85"
            + _py2_str(b"b") + b"\x87R(" + _py2_int(1) + _py2_int(o.shape[0]) + _py2_int(o.shape[1])
            + b"\x86" + dtype + b"\x89" + _py2_str(o.tobytes()) + b"tb")


def py2_pickle(o) -> bytes:
    """The opcodes Python 2's cPickle (protocol 2) wrote for the real CIFAR batches: str keys, numpy.core."""
    return b"\x80\x02" + _py2_obj(o) + b"."


def write_cifar(folder: Path, dataset: str, rng, per_batch=6, py2=True):
    """A tar.gz in the official layout with tiny batches; return the expected arrays."""
    archive, inner, train_names, test_name, label_key, classes = cifar.LAYOUT[dataset]
    folder.mkdir(parents=True, exist_ok=True)
    blobs, xs, ys = {}, {}, {}
    for name in (*train_names, test_name):
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, classes, per_batch)]
        batch = {"batch_label": f"{name} of 1", label_key: y, "data": x, "filenames": ["a.png"] * per_batch}
        if dataset == "cifar100":
            batch["coarse_labels"] = [(v + 1) % 20 for v in y]  # must not be mistaken for the labels
        blobs[name] = py2_pickle(batch) if py2 else pickle.dumps(
            {k.encode(): v for k, v in batch.items()}, protocol=2
        )
        xs[name], ys[name] = x, y
    with tarfile.open(folder / archive, "w:gz") as tar:
        for name, data in blobs.items():
            info = tarfile.TarInfo(f"{inner}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    train_x = np.concatenate([xs[n] for n in train_names]).reshape(-1, 3, 32, 32)
    train_y = np.concatenate([ys[n] for n in train_names])
    return train_x, train_y, xs[test_name].reshape(-1, 3, 32, 32), np.array(ys[test_name])


def cfg(dataset: str, data_dir: Path, download: bool = False, **kw) -> DataConfig:
    return DataConfig(dataset=dataset, data_dir=str(data_dir), download=download, **kw)


# ---------------------------------------------------------------- real MNIST


def test_real_mnist(shared_data_dir):
    ds = load_dataset(cfg("mnist", shared_data_dir))
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    assert ds.train_x.is_contiguous() and ds.image_shape == (1, 28, 28)
    assert ds.train_y.bincount().tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert ds.test_y.bincount().tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.num_classes == 10 and not ds.augment
    assert ds.mean == (0.1307,) and ds.std == (0.3081,)
    # The published pixel statistics and the well-known first labels confirm the bytes were decoded right.
    hist = torch.bincount(ds.train_x.flatten(), minlength=256).double()
    levels = torch.arange(256, dtype=torch.float64) / 255
    mean = (hist * levels).sum() / hist.sum()
    std = ((hist * (levels - mean) ** 2).sum() / hist.sum()).sqrt()
    assert mean.item() == pytest.approx(0.1307, abs=1e-4) and std.item() == pytest.approx(0.3081, abs=1e-4)
    assert ds.train_y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_real_fmnist(shared_data_dir):
    ds = load_dataset(cfg("fmnist", shared_data_dir))
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64 and ds.train_x.is_contiguous()
    assert ds.train_y.bincount().tolist() == [6000] * 10 and ds.test_y.bincount().tolist() == [1000] * 10
    assert ds.num_classes == 10 and not ds.augment
    assert ds.mean == (0.2860,) and ds.std == (0.3530,)
    # The first labels (9: ankle boot) and pixels of the official files, and the published statistics.
    assert ds.train_y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert ds.test_y[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    first = ds.train_x[0, 0]
    assert first[:3].sum() == 0 and [int(first[3, c]) for c in (12, 15, 16)] == [1, 13, 73]
    assert int(first.sum(dtype=torch.int64)) == 76247 and int(ds.test_x[0, 0].sum(dtype=torch.int64)) == 33456
    hist = torch.bincount(ds.train_x.flatten(), minlength=256).double()
    levels = torch.arange(256, dtype=torch.float64) / 255
    mean = (hist * levels).sum() / hist.sum()
    std = ((hist * (levels - mean) ** 2).sum() / hist.sum()).sqrt()
    assert mean.item() == pytest.approx(0.2860, abs=1e-4) and std.item() == pytest.approx(0.3530, abs=1e-4)


def test_normalize_false_is_plain_scaling(shared_data_dir):
    """data.normalize: false makes every consumer of the dataset's statistics use x / 255."""
    ds = load_dataset(cfg("fmnist", shared_data_dir, normalize=False))
    assert ds.mean == (0.0,) and ds.std == (1.0,)
    assert torch.equal(normalize(ds.test_x[:2], ds.mean, ds.std), ds.test_x[:2].float() / 255)


# ---------------------------------------------------------------- IDX: Fashion-MNIST, EMNIST, corruption


def test_fmnist_loader_reads_idx_files(tmp_path):
    tx, ty, vx, vy = write_idx_set(tmp_path / "fmnist", IDX_NAMES, np.random.default_rng(0))
    with warnings.catch_warnings():
        # torch warns when it wraps read-only memory (frombuffer's view of the file bytes): an error here.
        warnings.simplefilter("error")
        ds = load_dataset(cfg("fmnist", tmp_path))
    assert np.array_equal(ds.train_x.numpy(), tx[:, None]) and np.array_equal(ds.test_x.numpy(), vx[:, None])
    assert ds.train_y.tolist() == ty.tolist() and ds.test_y.tolist() == vy.tolist()
    assert ds.mean == (0.2860,) and ds.std == (0.3530,) and not ds.augment
    ds.train_x[0, 0, 0, 0] = 7  # tensors own writable memory, not a view of the read-only file bytes
    assert ds.train_x[0, 0, 0, 0] == 7


def test_emnist_images_are_transposed(tmp_path):
    tx, ty, vx, _ = write_idx_set(tmp_path / "emnist", files.EMNIST_FILES, np.random.default_rng(1))
    ds = load_dataset(cfg("emnist", tmp_path))
    assert np.array_equal(ds.train_x.numpy()[:, 0], tx.transpose(0, 2, 1))
    assert np.array_equal(ds.test_x.numpy()[:, 0], vx.transpose(0, 2, 1))
    assert ds.train_x.is_contiguous() and ds.train_y.tolist() == ty.tolist()
    flat = tx.astype(np.float64) / 255
    assert ds.mean[0] == pytest.approx(flat.mean(), rel=1e-5) and ds.std[0] == pytest.approx(flat.std(), rel=1e-5)


def test_emnist_missing_explains_gzip_zip(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        load_dataset(cfg("emnist", tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "emnist") in msg and "emnist-digits-train-images-idx3-ubyte.gz" in msg
    assert "gzip.zip" in msg and "58c8d27c78d21e728a6bc7b3cc06412e" in msg and "data.dataset=synthetic" in msg


def _emnist_zip(tmp_path: Path, rng) -> tuple[bytes, tuple]:
    src = tmp_path / "src"
    arrays = write_idx_set(src, files.EMNIST_FILES, rng)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("gzip/emnist-letters-train-images-idx3-ubyte.gz", b"other split")
        for name in files.EMNIST_FILES:
            zf.write(src / name, f"gzip/{name}")
    return buf.getvalue(), arrays


def test_emnist_extracted_from_local_gzip_zip(tmp_path):
    data, (tx, *_) = _emnist_zip(tmp_path, np.random.default_rng(2))
    (tmp_path / "data" / "emnist").mkdir(parents=True)
    (tmp_path / "data" / "emnist" / "gzip.zip").write_bytes(data)
    ds = load_dataset(cfg("emnist", tmp_path / "data"))
    assert np.array_equal(ds.train_x.numpy()[:, 0], tx.transpose(0, 2, 1))
    assert sorted(p.name for p in (tmp_path / "data" / "emnist").iterdir()) == sorted(files.EMNIST_FILES)


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (lambda raw: gzip.compress(struct.pack(">I", 2049) + gzip.decompress(raw)[4:]), "magic"),
        (lambda raw: gzip.compress(gzip.decompress(raw)[:-5]), "header says"),
        (lambda raw: gzip.compress(gzip.decompress(raw)[:10]), "truncated"),
        (lambda raw: raw[: len(raw) // 2], "gzip"),
        (lambda raw: b"not gzip at all", "gzip"),
    ],
)
def test_corrupt_idx_names_the_file(tmp_path, corrupt, expected):
    write_idx_set(tmp_path / "fmnist", IDX_NAMES, np.random.default_rng(3))
    path = tmp_path / "fmnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(DatasetFormatError, match=expected) as e:
        load_dataset(cfg("fmnist", tmp_path))
    assert str(path) in str(e.value)


def test_idx_count_mismatch_and_bad_labels(tmp_path):
    rng = np.random.default_rng(4)
    write_idx_set(tmp_path / "fmnist", IDX_NAMES, rng)
    labels = tmp_path / "fmnist" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(DatasetFormatError, match="12 images but"):
        load_dataset(cfg("fmnist", tmp_path))
    labels.write_bytes(idx_bytes(np.full(12, 10, np.uint8)))
    with pytest.raises(DatasetFormatError, match="label 10 outside"):
        load_dataset(cfg("fmnist", tmp_path))
    assert read_idx(labels, 1).shape == (12,)


# ---------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
@pytest.mark.parametrize("py2", [True, False])
def test_cifar_from_tar_and_extracted_folder(tmp_path, dataset, py2):
    folder = tmp_path / dataset
    tx, ty, vx, vy = write_cifar(folder, dataset, np.random.default_rng(5), py2=py2)
    ds = load_dataset(cfg(dataset, tmp_path))
    assert np.array_equal(ds.train_x.numpy(), tx) and ds.train_y.tolist() == ty.tolist()
    assert np.array_equal(ds.test_x.numpy(), vx) and ds.test_y.tolist() == vy.tolist()
    assert ds.image_shape == (3, 32, 32) and ds.augment and ds.train_x.is_contiguous()
    assert ds.num_classes == (10 if dataset == "cifar10" else 100) and len(ds.mean) == 3

    archive = folder / cifar.LAYOUT[dataset][0]
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    archive.unlink()  # the extracted folder alone must be enough
    ds2 = load_dataset(cfg(dataset, tmp_path))
    assert torch.equal(ds2.train_x, ds.train_x) and torch.equal(ds2.test_y, ds.test_y)


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_cifar_unpickler_refuses_other_globals():
    data = pickle.dumps({"data": np.zeros((1, 3072), np.uint8), "labels": [_Evil()]}, protocol=2)
    with pytest.raises(DatasetFormatError, match="posix.getcwd is not allowed|os.getcwd is not allowed"):
        cifar.load_batch(data, "evil_batch", "labels", 10)


def test_cifar_bad_batch_contents(tmp_path):
    bad_shape = py2_pickle({"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]})
    with pytest.raises(DatasetFormatError, match="batch_x: data is uint8"):
        cifar.load_batch(bad_shape, "batch_x", "labels", 10)
    no_labels = py2_pickle({"data": np.zeros((2, 3072), np.uint8)})
    with pytest.raises(DatasetFormatError, match="missing"):
        cifar.load_batch(no_labels, "batch_x", "fine_labels", 100)
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "cifar-10-python.tar.gz").write_bytes(b"truncated")
    with pytest.raises(DatasetFormatError, match="cifar-10-python.tar.gz"):
        load_dataset(cfg("cifar10", tmp_path))


# ---------------------------------------------------------------- look-up order and downloads


def test_resolve_data_dir_order(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDROD_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"
    assert resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("FEDROD_DATA_DIR")
    assert resolve_data_dir(None) == tmp_path / "xdg" / "fedrod-ray" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_data_dir(None) == tmp_path / "home" / ".cache" / "fedrod-ray" / "data"


def test_the_suite_and_its_subprocesses_have_a_home_of_their_own():
    """tests/conftest.py points HOME and the XDG dirs at a temporary home before anything runs: a download
    into the default cache, Ray's ~/.ray and matplotlib's caches land there, in the subprocesses too."""
    from conftest import TEST_HOME

    code = "from fedrod_ray.data import resolve_data_dir; import pathlib; print(pathlib.Path.home(), resolve_data_dir(None))"
    env = {k: v for k, v in os.environ.items() if k != "FEDROD_DATA_DIR"}
    home, cache = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True, timeout=120).stdout.split()
    assert Path(home) == TEST_HOME == Path.home() and Path(cache) == TEST_HOME / ".cache" / "fedrod-ray" / "data"
    assert os.environ["MPLCONFIGDIR"].startswith(str(TEST_HOME))


def test_load_uses_env_data_dir(tmp_path, monkeypatch):
    tx, *_ = write_idx_set(tmp_path / "fmnist", IDX_NAMES, np.random.default_rng(6))
    monkeypatch.setenv("FEDROD_DATA_DIR", str(tmp_path))
    ds = load_dataset(DataConfig(dataset="fmnist", download=False))
    assert np.array_equal(ds.train_x.numpy()[:, 0], tx)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(tmp_path):
    """(folder, base URL) of a loopback HTTP server serving that folder for this test only."""
    root = tmp_path / "served"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def fast_timeout(monkeypatch):
    monkeypatch.setattr(files, "DOWNLOAD_TIMEOUT_S", 5.0)


def _serve_mnist(served, monkeypatch, mirrors_before=()):
    root, url = served
    arrays = write_idx_set(root, IDX_NAMES, np.random.default_rng(7))
    monkeypatch.setitem(files.MIRRORS, "mnist", [*mirrors_before, url])
    monkeypatch.setitem(
        files.MD5, "mnist", {n: hashlib.md5((root / n).read_bytes()).hexdigest() for n in IDX_NAMES}
    )
    return arrays


def test_download_verifies_md5_and_loads(tmp_path, served, monkeypatch, fast_timeout):
    # The first mirror lacks the files (404): the downloader must fall through to the next one.
    tx, ty, *_ = _serve_mnist(served, monkeypatch, mirrors_before=[served[1] + "missing/"])
    ds = load_dataset(cfg("mnist", tmp_path / "data", download=True))
    assert np.array_equal(ds.train_x.numpy()[:, 0], tx) and ds.train_y.tolist() == ty.tolist()
    folder = tmp_path / "data" / "mnist"
    assert sorted(p.name for p in folder.iterdir()) == sorted(IDX_NAMES)  # no temporary files left
    for name in IDX_NAMES:
        assert (folder / name).read_bytes() == (served[0] / name).read_bytes()


def test_download_md5_mismatch_leaves_nothing(tmp_path, served, monkeypatch, fast_timeout):
    _serve_mnist(served, monkeypatch)
    monkeypatch.setitem(files.MD5["mnist"], "train-labels-idx1-ubyte.gz", "0" * 32)
    with pytest.raises(DatasetNotFoundError, match="md5 mismatch") as e:
        load_dataset(cfg("mnist", tmp_path / "data", download=True))
    assert "train-labels-idx1-ubyte.gz" in str(e.value)
    folder = tmp_path / "data" / "mnist"
    assert not (folder / "train-labels-idx1-ubyte.gz").exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".part")]


def test_download_only_fetches_missing_files(tmp_path, served, monkeypatch, fast_timeout):
    _serve_mnist(served, monkeypatch)
    folder = tmp_path / "data" / "mnist"
    folder.mkdir(parents=True)
    for name in IDX_NAMES[1:]:
        (folder / name).write_bytes((served[0] / name).read_bytes())
    for name in IDX_NAMES[1:]:
        (served[0] / name).unlink()  # a re-download of these would now fail
    load_dataset(cfg("mnist", tmp_path / "data", download=True))
    assert (folder / IDX_NAMES[0]).is_file()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_source_raises_not_found(tmp_path, monkeypatch, fast_timeout):
    monkeypatch.setitem(files.MIRRORS, "fmnist", [f"http://127.0.0.1:{_closed_port()}/"])
    with pytest.raises(DatasetNotFoundError) as e:
        load_dataset(cfg("fmnist", tmp_path, download=True))
    msg = str(e.value)
    assert str(tmp_path / "fmnist") in msg and all(n in msg for n in IDX_NAMES)
    assert "Download failed" in msg and "data.dataset=synthetic" in msg and "FEDROD_DATA_DIR" in msg
    # Downloads were on and failed: no advice to turn them on.
    assert "data.download=true" not in msg and "fetch them yourself from http://127.0.0.1:" in msg
    assert not [p for p in (tmp_path / "fmnist").iterdir()]


def test_missing_without_download_says_how(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        load_dataset(cfg("cifar100", tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "cifar100") in msg and "cifar-100-python.tar.gz" in msg
    assert "data.download=true" in msg and "data.dataset=synthetic" in msg
    assert isinstance(e.value, FileNotFoundError)


def test_emnist_download_extracts_digits(tmp_path, served, monkeypatch, fast_timeout):
    data, (tx, *_) = _emnist_zip(tmp_path, np.random.default_rng(8))
    (served[0] / "gzip.zip").write_bytes(data)
    monkeypatch.setitem(files.MIRRORS, "emnist", [served[1]])
    monkeypatch.setitem(files.MD5, "emnist", {"gzip.zip": hashlib.md5(data).hexdigest()})
    ds = load_dataset(cfg("emnist", tmp_path / "data", download=True))
    assert np.array_equal(ds.train_x.numpy()[:, 0], tx.transpose(0, 2, 1))
    assert sorted(p.name for p in (tmp_path / "data" / "emnist").iterdir()) == sorted(files.EMNIST_FILES)


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset(DataConfig(dataset="imagenet"))


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_seeded_balanced_and_learnable_but_not_trivial():
    c = DataConfig(dataset="synthetic", synthetic_train_per_class=200, synthetic_test_per_class=50)
    a, b, other = load_dataset(c, seed=3), load_dataset(c, seed=3), load_dataset(c, seed=4)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, other.train_x)
    assert a.train_x.shape == (2000, 1, 28, 28) and a.test_x.shape == (500, 1, 28, 28)
    assert a.train_x.dtype == torch.uint8 and a.train_y.dtype == torch.int64 and a.num_classes == 10
    assert a.test_y.bincount().tolist() == [50] * 10 and a.train_y.bincount().tolist() == [200] * 10
    assert 0.3 < a.mean[0] < 0.7 and a.std[0] > 0.1
    # Nearest class mean on raw pixels: far above chance, yet the classes overlap.
    x, v = a.train_x.flatten(1).float(), a.test_x.flatten(1).float()
    centroids = torch.stack([x[a.train_y == k].mean(0) for k in range(10)])
    acc = (torch.cdist(v, centroids).argmin(1) == a.test_y).float().mean().item()
    assert 0.5 < acc < 0.95


# ---------------------------------------------------------------- transforms


def test_normalize_per_channel():
    x = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    out = normalize(x, (0.5, 0.0, 0.2), (0.5, 2.0, 0.1))
    assert out.dtype == torch.float32 and out.shape == (2, 3, 2, 2)
    assert torch.allclose(out[:, 0], torch.tensor(-1.0)) and torch.allclose(out[:, 1], torch.tensor(0.5))
    assert torch.allclose(out[:, 2], torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(normalize(x[0], (0.5, 0.0, 0.2), (0.5, 2.0, 0.1)), out[0])


def _reference(x, dy, dx, flip, pad=2):
    padded = torch.nn.functional.pad(x, (pad,) * 4)
    h, w = x.shape[2:]
    out = []
    for i in range(len(x)):
        crop = padded[i, :, pad + dy[i] : pad + dy[i] + h, pad + dx[i] : pad + dx[i] + w]
        out.append(crop.flip(-1) if flip[i] else crop)
    return torch.stack(out)


def test_shift_flip_matches_pad_crop_reference():
    x = torch.randint(0, 256, (6, 3, 5, 7), dtype=torch.uint8)
    zeros = torch.zeros(6, dtype=torch.long)
    assert torch.equal(shift_flip(x, zeros, zeros, torch.zeros(6, dtype=torch.bool)), x)
    dy, dx = torch.tensor([-2, -1, 0, 1, 2, 2]), torch.tensor([2, 0, -2, 1, -1, 0])
    flip = torch.tensor([True, False, True, False, True, False])
    assert torch.equal(shift_flip(x, dy, dx, flip), _reference(x, dy, dx, flip))


def test_augment_batch_deterministic_and_varied():
    x = torch.randint(1, 256, (400, 3, 8, 8), dtype=torch.uint8)  # no zeros, so padding is visible
    out = augment_batch(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert torch.equal(out, augment_batch(x, torch.Generator().manual_seed(0)))
    assert not torch.equal(out, augment_batch(x, torch.Generator().manual_seed(1)))
    # Each output must be one of the 5 x 5 x 2 pad-crop-flip candidates; collect which one.
    seen = set()
    padded = torch.nn.functional.pad(x, (2,) * 4)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            for f in (False, True):
                cand = padded[:, :, 2 + dy : 2 + dy + 8, 2 + dx : 2 + dx + 8]
                cand = cand.flip(-1) if f else cand
                hit = (cand == out).flatten(1).all(1)
                seen |= {(dy, dx, f)} if hit.any() else set()
                out = torch.where(hit.view(-1, 1, 1, 1), torch.zeros_like(out), out)
    assert out.eq(0).all(), "some augmented image is no pad-crop-flip of its input"
    assert len(seen) > 40 and {f for *_, f in seen} == {False, True}


def test_augment_fill_matches_augmenting_before_normalize():
    # Padding normalised images with the normalised value of black equals padding raw images with 0.
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    raw_first = normalize(augment_batch(x, torch.Generator().manual_seed(5)), mean, std)
    fill = normalized_black(mean, std)
    assert torch.allclose(normalize(torch.zeros(1, 3, 1, 1, dtype=torch.uint8), mean, std).flatten(), torch.tensor(fill))
    norm_first = augment_batch(normalize(x, mean, std), torch.Generator().manual_seed(5), fill=fill)
    assert torch.allclose(raw_first, norm_first, atol=1e-5)
    assert not torch.allclose(raw_first, augment_batch(normalize(x, mean, std), torch.Generator().manual_seed(5)))


def test_augment_keeps_channels_last():
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    out = augment_batch(x, torch.Generator().manual_seed(0))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, augment_batch(x.contiguous(), torch.Generator().manual_seed(0)))
