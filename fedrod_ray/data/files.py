"""Where dataset files live, and fetching them from their official sources with md5 verification."""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 20

# Several base URLs per dataset: the first that serves a file with the right md5 wins.
MIRRORS: dict[str, list[str]] = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"],
    "fmnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
    "cifar10": ["https://www.cs.toronto.edu/~kriz/"],
    "cifar100": ["https://www.cs.toronto.edu/~kriz/"],
    "emnist": ["https://biometrics.nist.gov/cs_links/EMNIST/"],
}
MD5: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fmnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
    "cifar100": {"cifar-100-python.tar.gz": "eb9058c3a382ffc7106e4002c42a8d85"},
    "emnist": {"gzip.zip": "58c8d27c78d21e728a6bc7b3cc06412e"},
}
EMNIST_FILES = (
    "emnist-digits-train-images-idx3-ubyte.gz",
    "emnist-digits-train-labels-idx1-ubyte.gz",
    "emnist-digits-test-images-idx3-ubyte.gz",
    "emnist-digits-test-labels-idx1-ubyte.gz",
)


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are neither on disk nor downloadable; the message says how to fix it."""


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt, truncated or not in the expected format."""


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    if data_dir:
        return Path(data_dir).expanduser()
    env = os.environ.get("FEDROD_DATA_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "fedrod-ray" / "data"


def not_found(
    dataset: str, folder: Path, missing: Sequence[str], note: str = "", reasons: Sequence[str] = ()
) -> DatasetNotFoundError:
    source = ", ".join(MIRRORS.get(dataset, [])) or "the official source"
    # Once a download was tried (and failed), suggesting to turn downloads on would be wrong.
    fetch = f"fetch them yourself from {source}" if reasons else f"set data.download=true to fetch them from {source}"
    lines = [
        f"dataset {dataset!r} not found: {folder} is missing {', '.join(missing)}.",
        (
            f"Put the files in {folder} (the data directory is --data-dir / data.data_dir, else "
            f"$FEDROD_DATA_DIR, else ~/.cache/fedrod-ray/data; each dataset in its own sub-folder), or {fetch}."
        ),
    ]
    if note:
        lines.append(note)
    if reasons:
        lines.append("Download failed: " + "; ".join(reasons))
    lines.append("To run offline without any dataset files, use --set data.dataset=synthetic.")
    return DatasetNotFoundError("\n".join(lines))


def md5sum(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def download(urls: list[str], dest: Path, md5: str, timeout: float = DOWNLOAD_TIMEOUT_S) -> list[str]:
    """Try each URL in turn until one yields ``md5``; return the failure reasons (empty on success).

    The body goes to a temporary file beside ``dest`` and is renamed only once verified, so an
    interrupted or corrupt download never leaves something a later run would take for the dataset.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    reasons = []
    for url in urls:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            h = hashlib.md5()
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                while chunk := resp.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != md5:
                reasons.append(f"{url}: md5 mismatch (got {h.hexdigest()}, expected {md5})")
                continue
            os.replace(tmp, dest)
            return []
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            reasons.append(f"{url}: {getattr(e, 'reason', None) or e}")
        finally:
            tmp.unlink(missing_ok=True)
    return reasons


def ensure_files(dataset: str, data_dir: Path, download_ok: bool) -> Path:
    """Return ``<data_dir>/<dataset>`` once every file in ``MD5[dataset]`` is there, fetching if allowed."""
    folder = data_dir / dataset
    missing = [name for name in MD5[dataset] if not (folder / name).is_file()]
    if missing and download_ok:
        reasons = []
        for name in missing:
            reasons += download([base + name for base in MIRRORS[dataset]], folder / name, MD5[dataset][name])
        if reasons:
            raise not_found(dataset, folder, missing, reasons=reasons)
    elif missing:
        raise not_found(dataset, folder, missing)
    return folder


def ensure_emnist(data_dir: Path, download_ok: bool) -> Path:
    """Return ``<data_dir>/emnist`` holding the four EMNIST-digits IDX files.

    NIST ships them only inside a 535 MB ``gzip.zip`` of every EMNIST split; we extract the digits
    files and then drop the zip, since nothing else here reads the other splits.
    """
    folder = data_dir / "emnist"
    missing = [name for name in EMNIST_FILES if not (folder / name).is_file()]
    if not missing:
        return folder
    archive = folder / "gzip.zip"
    note = (
        "The EMNIST-digits files come from NIST's EMNIST 'gzip.zip' "
        f"({MIRRORS['emnist'][0]}gzip.zip, md5 {MD5['emnist']['gzip.zip']}); extract the files above "
        "from its gzip/ folder, or put gzip.zip itself in the folder."
    )
    if not archive.is_file():
        if not download_ok:
            raise not_found("emnist", folder, missing, note)
        reasons = download([b + "gzip.zip" for b in MIRRORS["emnist"]], archive, MD5["emnist"]["gzip.zip"])
        if reasons:
            raise not_found("emnist", folder, missing, note, reasons)
    _extract_members(archive, folder, EMNIST_FILES)
    archive.unlink()
    return folder


def _extract_members(archive: Path, folder: Path, names: tuple[str, ...]) -> None:
    # Members are matched by base name and written under our own names, so a hostile archive path
    # (../../x) can never place a file outside ``folder``.
    try:
        with zipfile.ZipFile(archive) as zf:
            by_name = {Path(info.filename).name: info for info in zf.infolist() if not info.is_dir()}
            absent = [n for n in names if n not in by_name]
            if absent:
                raise DatasetFormatError(f"{archive} does not contain {', '.join(absent)}")
            for name in names:
                fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)
                try:
                    with os.fdopen(fd, "wb") as out, zf.open(by_name[name]) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                    os.replace(tmp_name, folder / name)
                finally:
                    Path(tmp_name).unlink(missing_ok=True)
    except (zipfile.BadZipFile, EOFError) as e:
        raise DatasetFormatError(f"{archive} is not a valid zip archive: {e}") from None
