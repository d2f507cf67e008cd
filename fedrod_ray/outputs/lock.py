"""One writer per output directory: a command that writes one (``train``, ``tune``, ``reproduce``) holds an
exclusive lock on the directory's ``.lock`` file while it runs. A second command started on the same
directory (a resume typed twice, two queues given the same job) then stops at once with an error naming the
first, instead of interleaving its rounds, checkpoints and Tune records with the first's.

The lock is the operating system's (``flock``): it goes with the process that held it, however that process
ends, so a killed run never leaves a stale lock behind; a child forked without exec closes its inherited copy,
so the lock does not outlive its holder in it. The file stays, saying who held it last. An
object store (``s3://``, ``gs://``) has no locks: a run directory there is not locked.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs

from .storage import RunStorage

LOCK_FILE = ".lock"
_HELD: set = set()  # the lock files this process holds open


def _close_inherited() -> None:
    """In a child forked without exec: close the lock files it inherited. The lock belongs to the open file,
    so the child's copies would hold it after the parent released it or died; closing a copy leaves the
    parent's lock as it is."""
    for f in _HELD:
        f.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


class DirectoryInUse(RuntimeError):
    """Another process holds the directory's lock."""


@contextlib.contextmanager
def exclusive(directory: str | os.PathLike) -> Iterator[None]:
    """Hold ``directory``'s lock for the ``with`` block. A directory that did not exist is created for it, and
    removed again (with the parents created for it) if the block leaves nothing in it but the lock: a command
    that failed before writing leaves no directory behind.

    Raises:
        DirectoryInUse: another process holds it; the message names that process as it recorded itself.
    """
    directory = Path(directory).absolute()
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    path = directory / LOCK_FILE
    f = _acquire(path)
    _HELD.add(f)
    try:
        f.truncate()
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}: {' '.join(sys.argv)}\n")
        f.flush()
        yield
    finally:
        if created and [p.name for p in directory.iterdir()] == [LOCK_FILE]:
            path.unlink()  # while held: whoever opened it before waits on a file that no longer has a name
            for d in created:
                with contextlib.suppress(OSError):
                    d.rmdir()
        _HELD.discard(f)
        f.close()  # releases the lock


def _acquire(path: Path):
    """Open ``path`` and take its lock; returns the open file. Retries where the file was removed while
    waiting for it (``exclusive``'s clean-up), so that the lock held is always the one of the file named."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")  # noqa: SIM115 - returned open: the lock lasts as long as the file does
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = _recorded(f)
            f.close()
            raise DirectoryInUse(f"{path.parent} is in use by {held_by}; wait for it to end, or stop it, "
                                 "and run this again") from None
        try:
            named = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            named = False
        if named:
            f.seek(0)
            return f
        f.close()


def exclusive_run_dir(storage: RunStorage) -> contextlib.AbstractContextManager[None]:
    """``exclusive`` for a run directory on the local filesystem; nothing for one elsewhere (no locks there)."""
    if isinstance(storage.fs, pafs.LocalFileSystem):
        return exclusive(storage.root)
    return contextlib.nullcontext()


def holder(directory: str | os.PathLike) -> str | None:
    """Who holds ``directory``'s lock now, as it recorded itself; None when no process does."""
    path = Path(directory) / LOCK_FILE
    if not path.exists():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _recorded(f)
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _recorded(f) -> str:
    """What the holder of the open lock file ``f`` wrote about itself."""
    f.seek(0)
    return f.read().strip() or "a process that did not say which"
