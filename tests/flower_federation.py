"""A Flower federation on loopback for tests/test_flower.py: a SuperLink and SuperNodes as separate processes
(Flower's own executables, insecure or with TLS), each SuperNode serving one share of a fedrod-ray config's
clients (``fedrod_ray_flower.split``), and ``flwr run`` of the repository's Flower app (flower/app); or a
SuperLink of Flower's simulation engine, whose simulated SuperNodes serve those shares."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import free_port

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "flower" / "app"
BIN = Path(sys.executable).parent
NOT_INSTALLED = 'fedrod-ray[flower] is not installed (pip install -e ".[dev]" installs it)'


def require_flower() -> None:
    """Skip the calling test or module where Flower (``fedrod-ray[flower]``) is missing, saying how to install
    it; fail instead in CI (``CI`` set), whose ``.[dev]`` installs it: a CI run never passes without running
    Flower. Flower's executables must be beside this Python, where ``pip install`` puts them."""
    missing = None
    if importlib.util.find_spec("flwr") is None:
        missing = NOT_INSTALLED
    elif not all((BIN / name).is_file() for name in ("flower-superlink", "flower-supernode", "flwr")):
        missing = f"flwr is importable but Flower's executables are not in {BIN}: {NOT_INSTALLED}"
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing, allow_module_level=True)


def write_certificates(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (what docs/flower.md makes with openssl)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedrod-ray test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(root: int) -> list[int]:
    """The processes below ``root`` (Flower's SuperExec starts a session of its own, so a process group
    does not hold them)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class FlowerFederation:
    """A SuperLink and one SuperNode per folder of ``nodes`` (each its own session, stopped by ``close``).

    With ``simulation`` (the environment of a private Ray: conftest's ``private_ray_env``), a SuperLink of
    Flower's simulation engine instead: ``run`` simulates one SuperNode per folder of ``nodes`` (all in one
    folder, as ``split`` writes them), in the actors of a Ray that Flower's simulation process starts with
    2 CPUs from that environment and stops at the end."""

    def __init__(self, root: Path, nodes: list[Path], tls: dict[str, Path] | None = None,
                 simulation: dict[str, str] | None = None, auth: bool = False, node_config: str = ""):
        """``auth``: Flower's SuperNode authentication (``--enable-supernode-auth``, over ``tls``): each
        SuperNode gets a key pair (``node_key``), registered with the SuperLink before it starts.
        ``node_config``: what every SuperNode's node config holds besides its paths (its policy)."""
        self.root, self.nodes, self.tls, self.simulation = root, nodes, tls, simulation is not None
        self.auth, self.node_config = auth, node_config
        self.port = free_port()
        self.home = root / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        # SuperExec looks for a ServerApp or ClientApp to start every 0.25 s rather than every second.
        self.env = {**(os.environ if simulation is None else simulation), "FLWR_HOME": str(self.home),
                    "PYTHONUNBUFFERED": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25"}
        self.database = root / "superlink.db"
        security = (["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile",
                     str(tls["key"])] if tls else ["--insecure"])
        connection = f'root-certificates = "{tls["ca"]}"' if tls else "insecure = true"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\n{connection}\n')
        self.superlink = self._start("superlink", [str(BIN / "flower-superlink"), *security, "--isolation",
                                                   "subprocess", "--port", str(self.port), "--database",
                                                   str(self.database), "--disable-runtime-dependency-installation",
                                                   *(["--simulation"] if self.simulation else []),
                                                   *(["--enable-supernode-auth"] if auth else [])])
        self._wait_for("superlink", "Uvicorn running")
        self.supernodes: list[subprocess.Popen | None] = [None] * len(nodes)
        for i in range(0 if self.simulation else len(nodes)):
            if auth:
                self.register(self.node_key(f"node{i}"))
            self.start_node(i)

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "ab") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True, cwd=self.root)

    def _wait_for(self, name: str, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in (self.root / f"{name}.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, (self.root / f"{name}.log").read_text()[-3000:]
            time.sleep(0.25)

    def state_path(self, i: int) -> Path:
        return self.root / "states" / f"node{i}"  # in simulation, node<i> of run config sim-state-path

    def run_states(self, i: int, config: Path, run_dir: Path) -> Path:
        """Where SuperNode ``i`` keeps its clients' states in the run of ``config`` writing ``run_dir``: its
        folder of that run (``node.run_key``, of the config as the ServerApp sends it)."""
        from fedrod_ray_flower.node import run_key

        from fedrod_ray.config import load_config
        from fedrod_ray.outputs.storage import RunStorage

        cfg = load_config(config)
        cfg.run_dir = RunStorage(str(run_dir)).uri
        return self.state_path(i) / run_key(cfg)

    def node_key(self, name: str) -> Path:
        """A SuperNode's private key (an EC P-384 key in OpenSSH format, what ``--auth-supernode-private-key``
        reads), made once; its public key beside it, ``.pub``."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        path = self.root / "keys" / f"{name}.key"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            key = ec.generate_private_key(ec.SECP384R1())
            path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
            path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
        return path

    def flwr(self, *args: str) -> dict:
        """``flwr ARGS test --format json`` against this SuperLink (its Control API): the JSON it prints."""
        done = subprocess.run([str(BIN / "flwr"), *args, "test", "--format", "json"], check=False, env=self.env,
                              cwd=self.root, capture_output=True, text=True, timeout=120)
        out = json.loads(done.stdout)
        assert out.get("success"), done.stdout + done.stderr
        return out

    def register(self, key: Path) -> int:
        """Register the SuperNode of private key ``key`` (``flwr supernode register``): its node id."""
        return int(self.flwr("supernode", "register", str(key.with_suffix(".pub")))["node-id"])

    def online(self) -> set[int]:
        """The node ids of the SuperNodes the SuperLink has online (``flwr supernode list``)."""
        return {int(n["node-id"]) for n in self.flwr("supernode", "list")["nodes"] if n["status"] == "online"}

    def start_node(self, i: int) -> None:
        """SuperNode ``i`` (under ``auth``, with its registered key)."""
        self._launch(i, self.node_key(f"node{i}") if self.auth else None)

    def add_node(self, data: Path, key: Path | None) -> int:
        """One more SuperNode, serving ``data``, authenticated with ``key`` (None: not at all): its index."""
        self.nodes.append(data)
        self.supernodes.append(None)
        self._launch(len(self.nodes) - 1, key)
        return len(self.nodes) - 1

    def _launch(self, i: int, key: Path | None) -> None:
        security = ["--root-certificates", str(self.tls["ca"])] if self.tls else ["--insecure"]
        config = f'data-path="{self.nodes[i]}" state-path="{self.state_path(i)}" {self.node_config}'.strip()
        self.supernodes[i] = self._start(f"supernode{i}", [
            str(BIN / "flower-supernode"), *security, "--superlink", f"127.0.0.1:{self.port}", "--port",
            str(free_port()), "--node-config", config,
            *(["--auth-supernode-private-key", str(key)] if key else [])])

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and every process it started."""
        kill_tree(self.supernodes[i])
        self.supernodes[i] = None

    def run(self, config: Path, run_dir: Path, timeout: float = 1800, node_timeout: float = 300,
            wait: bool = True, app: Path = APP, extra: str = "") -> subprocess.Popen:
        """``flwr run`` of ``app`` (the repository's, by default) on ``config``, writing ``run_dir``, with the
        run config keys in ``extra`` too; waits for it unless ``wait`` is False."""
        settings = (f'config="{config}" run-dir="{run_dir}" min-nodes={len(self.nodes)} '
                    f'timeout={float(node_timeout)} {extra}').strip()
        simulation = []
        if self.simulation:
            settings += f' sim-data-path="{self.nodes[0].parent}" sim-state-path="{self.state_path(0).parent}"'
            # The simulation's own Ray: 2 CPUs, one per simulated ClientApp actor.
            resources = f"num-supernodes={len(self.nodes)} init-args-num-cpus=2 client-resources-num-cpus=1"
            simulation = ["--federation-config", resources]
        with open(self.root / f"flwr-run-{run_dir.name}.log", "ab") as out:
            proc = subprocess.Popen([str(BIN / "flwr"), "run", str(app), "test", "--stream", "--run-config",
                                     settings, *simulation], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True, cwd=self.root)
        if wait:
            proc.wait(timeout=timeout)
        return proc

    def serverapps(self) -> list[int]:
        """The pids of the ServerApp processes (``flwr-serverapp``) the SuperLink's SuperExec runs now."""
        return [pid for pid in descendants(self.superlink.pid) if b"flwr-serverapp" in _cmdline(pid)]

    def close(self) -> None:
        for i in range(len(self.supernodes)):
            if self.supernodes[i] is not None:
                self.kill_node(i)
        kill_tree(self.superlink)
