"""Run-directory storage on any filesystem pyarrow supports (local paths, s3://, gs://, hdfs://...).

Every write is atomic: the bytes go to a temporary name first and are then moved into place, so a
crash mid-write never leaves a truncated file where a good one was.
"""

from __future__ import annotations

import os
import posixpath
import uuid

import pyarrow.fs as pafs


class RunStorage:
    def __init__(self, uri: str):
        if "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(uri)
        # An absolute path, so that actors on other processes or nodes resolve the same directory.
        self.uri = uri if "://" in uri else self.root

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def write_bytes(self, rel: str, data: bytes) -> None:
        final = self.path(rel)
        self.fs.create_dir(posixpath.dirname(final), recursive=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, final)

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

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
        self.fs.move(self.path(src_rel), self.path(dst_rel))

    def delete_dir(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_dir(self.path(rel))
