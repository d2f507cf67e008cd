"""Run-directory storage on any filesystem pyarrow supports (local paths, s3://, gs://, hdfs://...).

Every write is atomic. On a filesystem with renames (local, HDFS) the bytes go to a temporary name
first and are then moved into place, so a crash mid-write never leaves a truncated file where a good
one was. An object store (S3, GCS) has no rename (pyarrow copies, and cannot move a directory at all),
but an object appears whole or not at all when its upload completes, so there a write goes straight to
its name. What spans several files (a checkpoint) needs a commit point of its own: see ``checkpoint``.

Credentials never pass through here: pyarrow takes them (and an endpoint such as ``AWS_ENDPOINT_URL``)
from the standard environment variables and configuration files, so nothing a run saves holds them.
"""

from __future__ import annotations

import os
import posixpath
import stat
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

# pyarrow's names (``FileSystem.type_name``) of the stores whose objects appear whole on completion.
OBJECT_STORES = ("s3", "gcs")


class RunStorage:
    def __init__(self, uri: str):
        if "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(uri)
        # An absolute path, so that actors on other processes or nodes resolve the same directory.
        self.uri = uri if "://" in uri else self.root

    @property
    def object_store(self) -> bool:
        """No renames, no appends; an object appears whole when its upload completes."""
        return self.fs.type_name in OBJECT_STORES

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def write_bytes(self, rel: str, data: bytes) -> None:
        final = self.path(rel)
        if self.object_store:  # a key needs no parent "directory"
            with self.fs.open_output_stream(final) as f:
                f.write(data)
            return
        self.fs.create_dir(posixpath.dirname(final), recursive=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, final)

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Add ``data`` at the end of a file. An object store cannot append: there the object is read
        and written again whole (one atomic upload); elsewhere a crash can leave a partial last piece,
        which readers of an appended file must tolerate."""
        if self.object_store:
            self.write_bytes(rel, (self.read_bytes(rel) if self.exists(rel) else b"") + data)
            return
        final = self.path(rel)
        self.fs.create_dir(posixpath.dirname(final), recursive=True)
        with self.fs.open_append_stream(final) as f:
            f.write(data)

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def read_file(self, rel: str, max_bytes: int) -> bytes:
        """``read_bytes`` of a regular file of at most ``max_bytes``; OSError for anything else: a FIFO would
        block the reader forever and a device (a symlink to /dev/zero) flood it. Locally the checks are made
        on the opened file (opened without blocking), so nothing swapped in after them is read instead."""
        if self.fs.type_name != "local":
            info = self.fs.get_file_info(self.path(rel))
            _check_file(rel, info.type == pafs.FileType.File, info.size, max_bytes)
            with self.fs.open_input_stream(self.path(rel)) as f:
                data = f.read(max_bytes + 1)
        else:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_NONBLOCK)
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                _check_file(rel, stat.S_ISREG(st.st_mode), st.st_size, max_bytes)
                data = f.read(max_bytes + 1)
        _check_file(rel, True, len(data), max_bytes)  # it grew while read
        return data

    def open_random(self, rel: str) -> pa.NativeFile:
        """The file for reads at any offset (``read_at``): on an object store, each one a ranged GET."""
        return self.fs.open_input_file(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def list_dirs(self, rel: str) -> list[str]:
        if not self.exists(rel):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel)))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)

    def list_files(self, rel: str) -> list[str]:
        if not self.exists(rel):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel)))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)

    def delete_file(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_file(self.path(rel))

    def move_dir(self, src_rel: str, dst_rel: str) -> None:
        """Atomic where the filesystem renames (never called on an object store)."""
        self.fs.move(self.path(src_rel), self.path(dst_rel))

    def delete_dir(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_dir(self.path(rel))


def _check_file(rel: str, regular: bool, size: int | None, max_bytes: int) -> None:
    if not regular:
        raise OSError(f"{rel} is not a regular file (a FIFO, a device or a directory?)")
    if size is not None and size > max_bytes:
        raise OSError(f"{rel} has {size} bytes, more than the {max_bytes} allowed")
