"""The test-only fault hook (fedrod_ray.clients.faults): inert unless armed; armed, the first matching call
hangs until killed, after writing its marker, and the fault fires once. tests/test_ray_runtime.py kills Ray
actors on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fedrod_ray.clients import faults


def test_unset_is_inert(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.from_env() is None and faults.runtime_env() is None


def test_armed_fault_reaches_the_actors_through_their_runtime_env(monkeypatch, tmp_path):
    spec = {"call": "evaluate", "client": 4, "marker": str(tmp_path / "m")}
    monkeypatch.setenv(faults.ENV, json.dumps(spec))
    assert faults.from_env() == faults.Fault("evaluate", 4, str(tmp_path / "m"))
    assert faults.runtime_env() == {"env_vars": {faults.ENV: json.dumps(spec)}}


@pytest.mark.parametrize(("spec", "names"), [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"call": "train", "client": 1, "marker": "m", "step": 3}', "unknown field(s) ['step']"),
    ('{"call": "finetune", "client": 1, "marker": "m"}', "call must be one of ['train', 'evaluate']"),
    ('{"call": "train", "marker": "m"}', "client is required"),
    ('{"call": "train", "client": "1", "marker": "m"}', "client must be an integer"),
    ('{"call": "train", "client": true, "marker": "m"}', "client must be an integer"),
    ('{"call": "train", "client": 1, "round_idx": null, "marker": "m"}', "round_idx must be an integer"),
    ('{"call": "evaluate", "client": 1, "round_idx": 0, "marker": "m"}', "round_idx applies to train only"),
    ('{"call": "train", "client": 1}', "marker must be a file path"),
])
def test_a_bad_spec_is_an_error_naming_the_field(monkeypatch, spec, names):
    monkeypatch.setenv(faults.ENV, spec)
    with pytest.raises((ValueError, TypeError)) as err:
        faults.from_env()
    assert faults.ENV in str(err.value) and names in str(err.value)


HANG = """
from fedrod_ray.clients import faults
fault = faults.from_env()
fault.reached("train", [3], 0)  # another round
fault.reached("evaluate", [3])  # another call
fault.reached("train", [2], 1)  # another client
print("before", flush=True)
fault.reached("train", [3], 1)
print("after", flush=True)
"""


def test_the_first_matching_call_hangs_until_killed_and_the_fault_fires_once(tmp_path):
    marker = tmp_path / "marker"
    spec = json.dumps({"call": "train", "client": 3, "round_idx": 1, "marker": str(marker)})
    proc = subprocess.Popen([sys.executable, "-c", HANG], env={**os.environ, faults.ENV: spec},
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "the process ended without reaching the fault"
            assert time.monotonic() < deadline, "the fault was not reached within 60 s"
            time.sleep(0.02)
        assert json.loads(marker.read_text()) == {"call": "train", "clients": [3], "round_idx": 1, "pid": proc.pid}
    finally:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    # Only the matching call stopped it, and it never returned.
    assert out == "before\n"
    assert sorted(tmp_path.iterdir()) == [marker]  # nothing staged is left behind

    # Fired: the same call (sent again to a restarted actor) goes through.
    faults.Fault("train", 3, str(marker), 1).reached("train", [3], 1)
    assert sorted(tmp_path.iterdir()) == [marker]
