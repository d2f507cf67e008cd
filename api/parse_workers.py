"""A small pool of worker processes that parse the large request bodies, so that the serving process never
spends more than a few milliseconds of its interpreter lock on one request.

Parsing the largest legal body (12 MiB of ~400,000 numbers) held the serving process's GIL for 0.2-0.7 s, so
every other request, /healthz included, waited that long (issue 49). Here such a body goes, as raw bytes down
a pipe, to one of ``workers`` processes (started with the server, or on first need), which parses and validates
it and sends back the request made small to receive (the predict route's images as one float32 array, not
400,000 Python floats: ``json_body``'s ``convert``). At most ``workers`` bodies are parsed at once and
``queue`` more wait; past that a request is answered 503 with Retry-After. A worker runs each body under a
CPU limit of ``cpu_s`` seconds (the kernel's RLIMIT_CPU: SIGXCPU ends it whatever it is doing); a worker
that dies is replaced, and its request answered 413 (its CPU limit) or 503 (anything else).

The worker side is this module run as ``python -m fedrod_ray_api.parse_workers``: it imports nothing but
what a job's pickled function needs (no torch), and exits when the serving process closes its stdin.
"""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import queue
import resource
import signal
import struct
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .errors import ApiError, TooLarge, Unavailable

# A job: the lengths of its pickled (function, args) and of its body, then both. A reply: ok (1) or an
# exception (0), the length of its pickle, then the pickle.
JOB = struct.Struct("<QQ")
REPLY = struct.Struct("<BQ")
RETRY_AFTER_S = 1
READ_CHUNK = 1 << 20
NICE = 10


class WorkerDied(Exception):
    """The worker process ended before replying (its CPU limit, or killed); ``returncode`` says how."""

    def __init__(self, returncode: int | None):
        super().__init__(returncode)
        self.returncode = returncode


def _read_exactly(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at end of file before they all came."""
    parts, left = [], n
    while left:
        part = os.read(fd, min(left, READ_CHUNK))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _write_all(fd: int, *parts: bytes) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]


class _Worker:
    """One worker process and its pipes, used by one thread at a time."""

    def __init__(self, cpu_s: int):
        # Its own session: a Ctrl-C at the terminal stops the server, which closes the workers' stdin.
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(cpu_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)

    def call(self, fn, body: Sequence[bytes], args: tuple):
        """``fn(b"".join(body), *args)`` in the worker: its result, or the exception it raised, raised here."""
        job = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(self.proc.stdin.fileno(), JOB.pack(len(job), sum(map(len, body))), job, *body)
            head = _read_exactly(self.proc.stdout.fileno(), REPLY.size)
            ok, size = REPLY.unpack(head) if head else (0, 0)
            payload = _read_exactly(self.proc.stdout.fileno(), size) if head else None
        except BrokenPipeError:
            payload = None
        if payload is None:
            self.proc.wait()
            raise WorkerDied(self.proc.returncode)
        result = pickle.loads(payload)
        if not ok:
            raise result
        return result

    def close(self) -> None:
        self.proc.stdin.close()  # the worker exits at end of file
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class ParseWorkers:
    """The pool: ``await run(fn, body, *args)`` runs ``fn(b"".join(body), *args)`` in a worker process (see the
    module): ``body`` is its reads as they came (body_limit.body_chunks), written down the pipe one by one,
    never joined in the serving process."""

    def __init__(self, workers: int, queue_size: int, cpu_s: int):
        self.workers, self.queue_size, self.cpu_s = workers, queue_size, cpu_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        # One thread per worker talks to it, blocked in the pipes' reads and writes (which release the GIL).
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedrod-parse")
        self._admitted = 0  # requests parsing or waiting (one event loop: no lock)

    def start(self) -> None:
        """Start the workers now, not on the first large bodies (a worker takes a second or two to start)."""
        while len(self._all) < self.workers:
            worker = _Worker(self.cpu_s)
            self._all.add(worker)
            self._idle.put(worker)

    def pids(self) -> list[int]:
        """The worker processes' ids (for a test or a benchmark to find them)."""
        return [w.proc.pid for w in list(self._all)]

    async def run(self, fn, body: Sequence[bytes], *args):
        if self._admitted >= self.workers + self.queue_size:
            raise Unavailable("body", f"{self.workers} bodies are being parsed and {self.queue_size} wait, "
                                      f"this server's limit (parse_workers, parse_queue); retry in "
                                      f"{RETRY_AFTER_S} s", RETRY_AFTER_S)
        self._admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, fn, body, args)
        finally:
            self._admitted -= 1

    def _call(self, fn, body: Sequence[bytes], args: tuple):
        # At most ``workers`` threads run this, each holding one worker: an idle one or a new one.
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            worker = _Worker(self.cpu_s)
            self._all.add(worker)
        try:
            result = worker.call(fn, body, args)
        except WorkerDied as e:
            self._all.discard(worker)
            worker.close()
            raise self._died(e.returncode) from None
        except BaseException:
            self._idle.put(worker)  # the job's own exception: the worker is fine
            raise
        self._idle.put(worker)
        return result

    def _died(self, returncode: int | None) -> ApiError:
        if returncode == -signal.SIGXCPU:
            return TooLarge("body", f"parsing it took more than {self.cpu_s} s of CPU, this server's limit "
                                    f"for one body (parse_cpu_s)")
        return Unavailable("body", f"the process parsing it ended (exit status {returncode}); retry in "
                                   f"{RETRY_AFTER_S} s", RETRY_AFTER_S)

    def close(self) -> None:
        """Stop the workers (the app's shutdown); a worker busy with a body is killed, and its request
        answered 503. A later large body starts a new one."""
        for worker in list(self._all):
            self._all.discard(worker)
            worker.proc.kill()
            worker.close()
        while not self._idle.empty():
            self._idle.get_nowait()


def _pickled_error(e: Exception) -> bytes:
    try:
        return pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an error holding something unpicklable: its text still goes back
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"), protocol=pickle.HIGHEST_PROTOCOL)


def _serve(cpu_s: int) -> None:
    """The worker's loop: read a job, run it under the CPU limit, reply; exit at end of file."""
    # Below the serving process: on busy cores, its small requests get the CPU before the large bodies' parse.
    os.nice(NICE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU's default action would dump a core
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    # The replies go down a copy of stdout, and stdout itself to stderr: nothing printed corrupts a reply.
    stdin, stdout = 0, os.dup(1)
    os.dup2(2, 1)
    while True:
        head = _read_exactly(stdin, JOB.size)
        if head is None:
            return
        job_size, body_size = JOB.unpack(head)
        job, body = _read_exactly(stdin, job_size), _read_exactly(stdin, body_size)
        if job is None or body is None:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            fn, args = pickle.loads(job)
            ok, reply = 1, pickle.dumps(fn(body, *args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the job's own error, for the serving process to raise
            ok, reply = 0, _pickled_error(e)
        del body
        _write_all(stdout, REPLY.pack(ok, len(reply)), reply)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(int(sys.argv[1]))
