"""Separate hosts on one machine, for tests and benchmarks (docs/sites.md, "Deployment"): each party
(the server; each site) runs in a network namespace of its own, linked to the server's by a veth pair (or, with a
latency, a pair of TUN devices joined by a delaying relay), with its own address, and in a mount namespace of its
own in which the data the harness hides is absent except that party's own directories.

Addresses are 10.77.0.1 (the server, on its loopback) and 10.77.<k>.1 (the k-th site, k >= 1), its link's server
end 10.77.<k>.254; nothing is routed out of these namespaces. Per link: a ``tc tbf`` rate, down and up, and its
bytes (the site end's counters). Everything is torn down by ``close`` (idempotent; also at exit and on SIGTERM;
KeyboardInterrupt leaves through ``__exit__``), and ``leftovers`` says what of a harness remains. Needs root.

    with Hosts(tmp, {"server": [server_dir], "a": [site_a_dir]}, hide=[data_root]) as hosts:
        hosts.popen("a", ["ray", "start", ...])

``python tests/hosts.py relay NS_A IF_A NS_B IF_B DELAY_MS TAG`` is the relay of a delayed link (run by the
harness, in the root namespace: it opens one TUN device in each namespace and forwards each packet after
DELAY_MS, both ways).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import fcntl
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "fh"  # every namespace and directory of a harness is named fh<pid>x<n>...: sweep() finds a dead pid's
CLONE_NEWNET = 0x40000000
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
TUN_MTU = 65000  # large packets: few of them for the relay to forward
SERVER_ADDR = "10.77.0.1"
_open: list[Hosts] = []  # the harnesses not closed yet, for the exit and signal handlers


def is_root() -> bool:
    return os.geteuid() == 0


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command of the root namespace (ip, tc, mount...): its result, an error with its output if it fails."""
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def site_addr(k: int) -> str:
    return f"10.77.{k}.1"


class Hosts:
    """The parties' namespaces and links. ``parties``: name -> the directories that party keeps (its data, its
    store, its runs); the first is the server. ``hide``: directories no party sees but for what it keeps (a
    tmpfs over each); keep every hidden directory out of ``/tmp/fh*``, where the harness lives. ``delay_ms``:
    each link's one-way delay (a TUN pair and a relay instead of a veth pair)."""

    def __init__(self, parties: dict[str, list[Path]], hide: list[Path], delay_ms: float = 0.0):
        self.tag = f"{PREFIX}{os.getpid()}x{len(_open)}"
        self.dir = Path("/tmp") / self.tag  # short: Ray's socket paths live under it
        self.parties, self.hide, self.delay_ms = dict(parties), [Path(p) for p in hide], delay_ms
        self.names = list(parties)
        self.addr = {name: SERVER_ADDR if k == 0 else site_addr(k) for k, name in enumerate(self.names)}
        self.procs: list[subprocess.Popen] = []
        self.closed = False

    # --- names ---
    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def mnt(self, name: str) -> Path:
        return self.dir / "mnt" / name

    def link_of(self, name: str) -> tuple[str, str]:
        """(the server end's interface, in the server's namespace; the site end's, in the site's)."""
        return f"l{self.names.index(name)}", "eth0"

    # --- setup ---
    def __enter__(self) -> Hosts:  # noqa: PYI034 (3.10: no typing.Self)
        if not is_root():
            raise PermissionError("the hosts harness needs root (network and mount namespaces)")
        sweep()
        _open.append(self)
        _install_handlers()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        for d in self.hide:
            if str(d.resolve()).startswith("/tmp/" + PREFIX):
                raise ValueError(f"hide: {d} is under the harness's own directory")
        (self.dir / "mnt").mkdir(parents=True)
        sh("mount", "--bind", str(self.dir / "mnt"), str(self.dir / "mnt"))
        sh("mount", "--make-private", str(self.dir / "mnt"))
        for k, name in enumerate(self.names):
            sh("ip", "netns", "add", self.ns(name))
            self.ip(name, "link", "set", "lo", "up")
            self._mount_ns(name)
        server = self.names[0]
        self.ip(server, "addr", "add", f"{SERVER_ADDR}/32", "dev", "lo")
        self.exec(server, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # site to site through the server
        for k, name in enumerate(self.names[1:], start=1):
            self._link(k, name)

    def _mount_ns(self, name: str) -> None:
        """A mount namespace, kept by a bind on ``mnt(name)``, where each hidden directory is an empty tmpfs but
        for the party's own directories (and its Ray temp dir) bound back into it."""
        path = self.mnt(name)
        path.touch()
        sh("unshare", f"--mount={path}", "--propagation", "private", "true")
        keep = [Path(p).resolve() for p in self.parties[name]]
        stage = self.dir / "stage" / name
        lines = ["set -e"]
        for i, p in enumerate(keep):
            (stage / str(i)).mkdir(parents=True)
            lines.append(f"mount --bind {shlex.quote(str(p))} {stage / str(i)}")
        for h in self.hide:
            lines.append(f"mount -t tmpfs -o size=4m,mode=755 {self.tag} {shlex.quote(str(Path(h).resolve()))}")
        for i, p in enumerate(keep):
            lines.append(f"mkdir -p {shlex.quote(str(p))} && mount --move {stage / str(i)} {shlex.quote(str(p))}")
        sh("nsenter", f"--mount={path}", "sh", "-c", "\n".join(lines))

    def _link(self, k: int, name: str) -> None:
        server = self.names[0]
        near, far = self.link_of(name)
        if self.delay_ms > 0:
            for party, dev in ((server, near), (name, far)):
                self.ip(party, "tuntap", "add", "dev", dev, "mode", "tun")
                self.ip(party, "link", "set", dev, "mtu", str(TUN_MTU))
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "relay", self.ns(server), near, self.ns(name), far, str(self.delay_ms),
                 self.tag], start_new_session=True))
            _wait(lambda: self._tun_attached(server, near) and self._tun_attached(name, far), 30, "the relay")
        else:
            sh("ip", "link", "add", near, "netns", self.ns(server), "type", "veth", "peer", "name", far,
               "netns", self.ns(name))
        self.ip(server, "addr", "add", f"10.77.{k}.254/24", "dev", near)
        self.ip(name, "addr", "add", f"{site_addr(k)}/24", "dev", far)
        self.link(name, up=True)

    def _tun_attached(self, party: str, dev: str) -> bool:
        out = sh("ip", "-n", self.ns(party), "-d", "-j", "link", "show", dev, check=False).stdout
        return bool(out) and "NO-CARRIER" not in out

    # --- running things ---
    def ip(self, party: str, *args: str) -> None:
        sh("ip", "-n", self.ns(party), *args)

    def exec(self, party: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.prefix(party), *args, check=check)

    def prefix(self, party: str) -> list[str]:
        """The command line prefix that runs a command as ``party``: in its network and mount namespaces."""
        return ["nsenter", f"--net={NETNS_DIR / self.ns(party)}", f"--mount={self.mnt(party)}", "--"]

    def popen(self, party: str, args: list[str], **kw) -> subprocess.Popen:
        """Start ``args`` as ``party``, in a session of its own (ended by ``close`` if still running)."""
        proc = subprocess.Popen([*self.prefix(party), *args], start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    # --- links ---
    def link(self, name: str, up: bool) -> None:
        """Set site ``name``'s link (both ends) up or down; up restores its route to the other parties."""
        near, far = self.link_of(name)
        k = self.names.index(name)
        state = "up" if up else "down"
        self.ip(self.names[0], "link", "set", near, state)
        self.ip(name, "link", "set", far, state)
        if up:
            self.ip(name, "route", "replace", "10.77.0.0/16", "via", f"10.77.{k}.254", "dev", far)

    def rate(self, name: str, rate: str | None) -> None:
        """A token-bucket rate limit (e.g. "100mbit") on both ends of ``name``'s link; None: unlimited."""
        ends = ((self.names[0], self.link_of(name)[0]), (name, self.link_of(name)[1]))
        for party, dev in ends:
            sh("ip", "netns", "exec", self.ns(party), "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                bits = _bits(rate)
                burst = max(bits // 8 // 100, 2 * TUN_MTU)  # 10 ms of the rate, at least two of the largest packets
                self.exec(party, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                          "latency", "200ms")

    def bytes(self, name: str) -> dict[str, int]:
        """The bytes site ``name`` sent (tx) and received (rx) on its link so far (its interface's counters)."""
        [info] = json.loads(sh("ip", "-n", self.ns(name), "-s", "-j", "link", "show", self.link_of(name)[1]).stdout)
        stats = info["stats64"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}

    # --- teardown ---
    def close(self) -> None:
        """End every process of the harness (its namespaces' and its relays), delete its namespaces (their
        interfaces with them), unmount and remove its directory. Safe to call again."""
        if self.closed:
            return
        self.closed = True
        try:
            for proc in self.procs:
                _end(proc)
        finally:  # whatever failed above, the namespaces (and every process in them) and mounts go
            _teardown(self.tag)
            if self in _open:
                _open.remove(self)


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (it was started with one) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(30)


def _teardown(tag: str) -> None:
    """Delete the namespaces and mounts named by ``tag`` and its directory (whatever is left of them)."""
    for ns in _namespaces(tag):
        for _ in range(100):  # until no process is left in it (a Ray node's may still be starting others)
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        sh("ip", "netns", "del", ns, check=False)
    for relay in _relays(tag):
        try:
            os.kill(relay, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in sorted(_mounts(tag), key=len, reverse=True):
        sh("umount", "-l", point, check=False)
    sh("rm", "-rf", f"/tmp/{tag}", check=False)


def _namespaces(tag: str) -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(f"{tag}-*")) if NETNS_DIR.is_dir() else []


def _mounts(tag: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(f"/tmp/{tag}/")]


def _relays(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"relay" in args and tag.encode() in args:
            found.append(int(entry))
    return found


def leftovers(tag: str) -> list[str]:
    """What remains of the harness ``tag``: namespaces, processes in them, relays, mounts, its directory."""
    left = [f"netns {ns}" for ns in _namespaces(tag)]
    left += [f"relay pid {pid}" for pid in _relays(tag)]
    left += [f"mount {m}" for m in _mounts(tag)]
    left += [f"dir /tmp/{tag}"] if Path(f"/tmp/{tag}").exists() else []
    return left


def sweep() -> None:
    """Tear down what harnesses of processes that no longer exist left (one killed by SIGKILL cannot clean)."""
    tags = {p.name.split("-")[0] for p in NETNS_DIR.glob(f"{PREFIX}*")} if NETNS_DIR.is_dir() else set()
    tags |= {p.name for p in Path("/tmp").glob(f"{PREFIX}*x*")}
    for tag in tags:
        pid = tag[len(PREFIX):].split("x")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _teardown(tag)


def _close_all() -> None:
    for hosts in _open:
        hosts.close()


_handlers_installed = False


def _install_handlers() -> None:
    """At exit, and on SIGTERM (then the signal's previous handling), close every open harness."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        try:
            _close_all()
        finally:
            _reraise(signum, frame)

    def _reraise(signum, frame):
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    if previous in (signal.SIG_DFL, None) or callable(previous):
        signal.signal(signal.SIGTERM, on_term)


def _bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate: {rate!r} is not <number>kbit|mbit|gbit")


def _wait(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout:g} s")
        time.sleep(0.05)


# --- the relay of a delayed link ---------------------------------------------------------------------------


def _open_tun(ns: str, dev: str) -> int:
    """Enter network namespace ``ns`` and open its TUN device ``dev``: the file descriptor (non-blocking)."""
    libc = ctypes.CDLL(None, use_errno=True)
    nsfd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    if libc.setns(nsfd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns {ns}")
    os.close(nsfd)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    return fd


async def _relay(a: int, b: int, delay_s: float) -> None:
    """Forward each packet read from ``a`` to ``b`` and back, ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()

    def forward(src: int, dst: int) -> None:
        while True:
            try:
                packet = os.read(src, 65536)
            except BlockingIOError:
                return
            loop.call_later(delay_s, _write, dst, packet)

    loop.add_reader(a, forward, a, b)
    loop.add_reader(b, forward, b, a)
    await asyncio.Event().wait()


def _write(fd: int, packet: bytes) -> None:
    try:
        os.write(fd, packet)
    except (BlockingIOError, OSError):  # the device is down or full: the packet is lost, as on a wire
        pass


def relay_main(ns_a: str, dev_a: str, ns_b: str, dev_b: str, delay_ms: str) -> None:
    a, b = _open_tun(ns_a, dev_a), _open_tun(ns_b, dev_b)
    asyncio.run(_relay(a, b, float(delay_ms) / 1000))


if __name__ == "__main__" and sys.argv[1:2] == ["relay"]:
    relay_main(*sys.argv[2:7])
