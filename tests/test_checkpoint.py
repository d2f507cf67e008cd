"""Checkpoints (safetensors + JSON, atomic, keep the newest 2), run storage and the metrics files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import check_resume, config_from_dict
from fedrod_ray.federation_state.checkpoint import (
    CheckpointFormatError,
    CheckpointWriter,
    latest_checkpoint_name,
    load_checkpoint,
    save_checkpoint,
)
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.outputs.results import MetricsLog
from fedrod_ray.outputs.storage import RunStorage


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_checkpoint(round_idx: int = 3) -> Snapshot:
    cfg = config_from_dict({"name": "ckpt_test", "seed": 5}, [
        "train.generic_rule=feddyn", "train.lr=0.03", "runtime.client_resources={num_cpus: 2, num_gpus: 0.5}",
        "data.num_clients=3",
    ])
    global_shared = {
        "body.0.weight": _rand(4, 1, 3, 3, seed=1) + round_idx,
        "body.0.bias": _rand(4, seed=2),
        "generic_head.weight": _rand(10, 4, seed=3, dtype=torch.float64),
    }
    server = {"body.0.weight": _rand(4, 1, 3, 3, seed=4), "generic_head.weight": _rand(10, 4, seed=5)}
    clients = {
        0: ClientState(
            personal={"personal_head.weight": _rand(10, 4, seed=6)},
            local_model={k: v + 1 for k, v in global_shared.items()},
            rule_state={"body.0.weight": _rand(4, 1, 3, 3, seed=7)},
            rounds_trained=2,
        ),
        2: ClientState(local_model={"body.0.bias": _rand(4, seed=8)}, rounds_trained=1),
        1: ClientState(),  # never trained
    }
    return Snapshot(round_idx, cfg, global_shared, server, clients)


def _assert_dicts_equal(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_round_trip_is_bitwise(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    name = save_checkpoint(storage, ckpt)
    assert name == "round_000003"
    loaded = load_checkpoint(storage)
    assert loaded.rounds_done == 3
    assert loaded.config == ckpt.config
    assert loaded.config.runtime.client_resources == {"num_cpus": 2.0, "num_gpus": 0.5}
    _assert_dicts_equal(loaded.global_shared, ckpt.global_shared)
    _assert_dicts_equal(loaded.server_state, ckpt.server_state)
    assert set(loaded.clients) == {0, 1, 2}
    for cid, st in ckpt.clients.items():
        got = loaded.clients[cid]
        assert got.rounds_trained == st.rounds_trained
        _assert_dicts_equal(got.personal, st.personal)
        _assert_dicts_equal(got.local_model, st.local_model)
        _assert_dicts_equal(got.rule_state, st.rule_state)
    # loading by explicit name gives the same
    assert load_checkpoint(storage, name).rounds_done == 3


def test_kept_momentum_buffers_round_trip_bitwise(tmp_path):
    """train.momentum_buffers=keep's part of a client's state, a channels_last buffer among them (as a conv
    weight's), comes back with the same values; a state without buffers stays without."""
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    conv = _rand(4, 3, 3, 3, seed=9).contiguous(memory_format=torch.channels_last)
    ckpt.clients[0].momentum = {"body.0.weight": conv, "generic_head.weight": _rand(10, 4, seed=10)}
    save_checkpoint(storage, ckpt)
    loaded = load_checkpoint(storage)
    _assert_dicts_equal(loaded.clients[0].momentum, ckpt.clients[0].momentum)
    assert loaded.clients[2].momentum == {} and loaded.clients[1].momentum == {}
    _assert_dicts_equal(loaded.clients[0].rule_state, ckpt.clients[0].rule_state)


def test_no_server_state_and_no_clients(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    ckpt.server_state = {}
    ckpt.clients = {}
    save_checkpoint(storage, ckpt)
    loaded = load_checkpoint(storage)
    assert loaded.server_state == {}
    assert loaded.clients == {}
    _assert_dicts_equal(loaded.global_shared, ckpt.global_shared)


def test_latest_and_retention(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    assert latest_checkpoint_name(storage) is None
    with pytest.raises(FileNotFoundError):
        load_checkpoint(storage)
    for r in (0, 1, 2, 9, 10):
        save_checkpoint(storage, make_checkpoint(r))
        assert latest_checkpoint_name(storage) == f"round_{r:06d}"
        assert load_checkpoint(storage).rounds_done == r
    assert storage.list_dirs("checkpoints") == ["clients", "round_000009", "round_000010"]
    # Each full save wrote its own client file; only the kept folders' files are left.
    assert [f.split("-")[0] for f in storage.list_files("checkpoints/clients")] == [
        "round_000009", "round_000010"]
    loaded = load_checkpoint(storage)
    _assert_dicts_equal(loaded.global_shared, make_checkpoint(10).global_shared)
    assert load_checkpoint(storage, "round_000009").rounds_done == 9


def test_leftover_temporary_folder_is_ignored(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    save_checkpoint(storage, make_checkpoint(7))
    save_checkpoint(storage, make_checkpoint(8))
    # an interrupted save of round 9: its temporary folder holds junk and `latest` still names round 8
    junk = tmp_path / "run" / "checkpoints" / ".round_000009.tmp-deadbeef"
    junk.mkdir()
    (junk / "global.safetensors").write_bytes(b"\x00junk")
    (junk / "manifest.json").write_text("{not json")
    loaded = load_checkpoint(storage)
    assert loaded.rounds_done == 8
    _assert_dicts_equal(loaded.global_shared, make_checkpoint(8).global_shared)
    # a later save still works, removes the junk, which never counted towards the kept folders
    save_checkpoint(storage, make_checkpoint(9))
    assert load_checkpoint(storage).rounds_done == 9
    assert not junk.exists()
    assert storage.list_dirs("checkpoints") == ["clients", "round_000008", "round_000009"]


class _CrashAt(RunStorage):
    """Run storage that dies at one step of a checkpoint save, as a killed process would."""

    def __init__(self, uri: str, step: str):
        super().__init__(uri)
        self.step = step

    def move_dir(self, src_rel: str, dst_rel: str) -> None:
        if self.step == "move":
            raise OSError("killed after the temporary folder was written")
        super().move_dir(src_rel, dst_rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.step == "latest" and rel == "checkpoints/latest":
            raise OSError("killed after the folder was moved, before `latest` was")
        super().write_bytes(rel, data)


@pytest.mark.parametrize("step", ["move", "latest"])
def test_a_save_interrupted_between_its_steps_keeps_the_previous_checkpoint(tmp_path, step):
    """Killed with the new folder written under its temporary name, or moved into place but not yet
    named by ``latest``: the previous checkpoint is what loads, and the next save removes the leftovers."""
    root = tmp_path / "run"
    save_checkpoint(RunStorage(str(root)), make_checkpoint(8))
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(_CrashAt(str(root), step), make_checkpoint(9))
    leftovers = [d.name for d in (root / "checkpoints").iterdir() if ".tmp-" in d.name]
    assert len(leftovers) == (1 if step == "move" else 0)
    storage = RunStorage(str(root))
    assert latest_checkpoint_name(storage) == "round_000008"
    loaded = load_checkpoint(storage)
    assert loaded.rounds_done == 8
    _assert_dicts_equal(loaded.global_shared, make_checkpoint(8).global_shared)

    save_checkpoint(storage, make_checkpoint(10))
    assert load_checkpoint(storage).rounds_done == 10
    names = sorted(d.name for d in (root / "checkpoints").iterdir())
    assert not [n for n in names if ".tmp-" in n], names
    # Killed after the move, round 9's folder was complete: it is kept as the older of the two.
    assert names == ["clients", "latest", "round_000008" if step == "move" else "round_000009", "round_000010"]
    # Round 9's client file went with its folder (or stays with it, when that folder is kept).
    files = sorted(f.split("-")[0] for f in os.listdir(root / "checkpoints" / "clients"))
    assert files == names[2:]


def test_files_are_safetensors_and_json_not_pickle(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    name = save_checkpoint(storage, ckpt)
    folder = tmp_path / "run" / "checkpoints" / name
    assert sorted(os.listdir(folder)) == ["global.safetensors", "manifest.json"]
    [clients_file] = (tmp_path / "run" / "checkpoints" / "clients").iterdir()
    with safe_open(str(folder / "global.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("global/generic_head.weight"), ckpt.global_shared["generic_head.weight"])
    assert keys == {f"global/{k}" for k in ckpt.global_shared} | {f"server/feddyn/{k}" for k in ckpt.server_state}
    with safe_open(str(clients_file), framework="pt") as f:
        assert "0/personal/personal_head.weight" in set(f.keys())
        clients_keys = f.keys()
        assert not [k for k in clients_keys if k.startswith("1/")]  # a client with no state takes no room
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["round"] == 3
    assert manifest["config"]["train"]["generic_rule"] == "feddyn" and manifest["rule"] == "feddyn"
    assert manifest["format_version"] == 3
    assert manifest["clients"]["1"] == {"rounds_trained": 0, "file": None}
    assert manifest["clients"]["0"] == {"rounds_trained": 2, "file": clients_file.name}
    for path in [*folder.iterdir(), clients_file]:
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80", path  # pickle protocol 2+ opcode
        assert not head.startswith(b"PK"), path  # torch.save zip archive
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == name


def test_a_format_1_checkpoint_is_refused_naming_its_version(tmp_path):
    """fedrod-ray 0.1 wrote format 1 (FedDyn's state in fixed fields): refused with a clear error."""
    storage = RunStorage(str(tmp_path / "run"))
    name = save_checkpoint(storage, make_checkpoint())
    manifest = tmp_path / "run" / "checkpoints" / name / "manifest.json"
    old = json.loads(manifest.read_text())
    old["format_version"] = 1
    manifest.write_text(json.dumps(old))
    with pytest.raises(CheckpointFormatError, match=r"format version 1; this version of fedrod-ray reads formats \(2, 3\)"):
        load_checkpoint(storage)


def test_a_checkpoint_of_an_earlier_version_loads_and_resumes(tmp_path):
    """Its config holds every setting as that version had them: up to b37490f, the unused train.meta_bsm at
    meta_lr 1.0 (since 0.001). The section never had an effect on the run (its loss is bsm), so the checkpoint
    loads with today's, and a run resumed from it is the same run."""
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    name = save_checkpoint(storage, ckpt)
    manifest = tmp_path / "run" / "checkpoints" / name / "manifest.json"
    old = json.loads(manifest.read_text())
    old["config"]["train"]["meta_bsm"] = {"meta_lr": 1.0, "meta_per_class": 10, "hidden": 100}
    manifest.write_text(json.dumps(old))
    loaded = load_checkpoint(storage).config
    assert loaded == ckpt.config
    check_resume(loaded, ckpt.config, 3)


def _state(seed: int, rounds: int) -> ClientState:
    return ClientState(personal={"personal_head.weight": _rand(10, 4, seed=seed)},
                       local_model={"body.0.bias": _rand(4, seed=seed + 1)}, rounds_trained=rounds)


def _client_files(storage: RunStorage) -> dict[str, set[str]]:
    """Each client-state file and the client ids it holds."""
    out = {}
    for name in storage.list_files("checkpoints/clients"):
        with safe_open(storage.path("checkpoints/clients", name), framework="pt") as f:
            keys = f.keys()
            out[name] = {k.split("/")[0] for k in keys}
    return out


def test_a_save_writes_only_the_clients_that_changed(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    writer = CheckpointWriter(storage)
    snap = make_checkpoint(0)
    snap.clients = {cid: _state(cid, 1) for cid in range(10)}
    writer.save(snap)
    [first] = _client_files(storage).values()
    assert first == {str(c) for c in range(10)}

    # Round 1 trains clients 3 and 7: their states are replaced, the others are the same objects.
    snap = Snapshot(1, snap.config, snap.global_shared, snap.server_state,
                    {**snap.clients, 3: _state(30, 2), 7: _state(70, 2)})
    writer.save(snap)
    files = _client_files(storage)
    assert sorted(files.values(), key=len) == [{"3", "7"}, first]
    manifest = json.loads(storage.read_bytes("checkpoints/round_000001/manifest.json"))
    newest = next(f for f, ids in files.items() if ids == {"3", "7"})
    assert {c for c, m in manifest["clients"].items() if m["file"] == newest} == {"3", "7"}
    loaded = load_checkpoint(storage)
    for cid, st in snap.clients.items():
        assert loaded.clients[cid].rounds_trained == st.rounds_trained
        _assert_dicts_equal(loaded.clients[cid].tensors(), st.tensors())
    # The older checkpoint still loads its own versions of clients 3 and 7 from the shared first file.
    older = load_checkpoint(storage, "round_000000")
    _assert_dicts_equal(older.clients[3].tensors(), _state(3, 1).tensors())


def test_superseded_states_are_compacted_away(tmp_path):
    """Files stay while any client still points at them. Once the files that the live states point at
    hold more than COMPACT_RATIO (3) x as many states, a save writes every state afresh, and the old
    files go when no kept checkpoint names them."""
    storage = RunStorage(str(tmp_path / "run"))
    writer = CheckpointWriter(storage)
    base = make_checkpoint(0)
    clients = {cid: _state(cid, 1) for cid in range(10)}
    on_disk = []
    # Round r trains clients 0 .. 9 - r: the files hold 10, then 10+9, 10+9+8 (27 <= 30), then 34 > 30.
    for r, trained in enumerate([[], range(9), range(8), range(7), range(1)]):
        clients = {**clients, **{c: _state(100 * r + c, 1 + r) for c in trained}}
        writer.save(Snapshot(r, base.config, base.global_shared, base.server_state, clients))
        on_disk.append(sorted(len(ids) for ids in _client_files(storage).values()))
        loaded = load_checkpoint(storage)
        for cid, st in clients.items():
            _assert_dicts_equal(loaded.clients[cid].tensors(), st.tensors())
    assert on_disk[:3] == [[10], [9, 10], [8, 9, 10]]
    assert on_disk[3] == [8, 9, 10, 10]  # all 10 afresh; round 2's checkpoint still needs the rest
    assert on_disk[4] == [1, 10]


def test_a_format_2_checkpoint_still_loads(tmp_path):
    """fedrod-ray 0.2 kept every client's state in the round folder (format 2)."""
    storage = RunStorage(str(tmp_path / "run"))
    ckpt = make_checkpoint()
    name = save_checkpoint(storage, ckpt)
    folder = tmp_path / "run" / "checkpoints" / name
    [clients_file] = (tmp_path / "run" / "checkpoints" / "clients").iterdir()
    clients_file.rename(folder / "clients.safetensors")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format_version"] = 2
    for meta in manifest["clients"].values():
        del meta["file"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_checkpoint(storage)
    for cid, st in ckpt.clients.items():
        assert loaded.clients[cid].rounds_trained == st.rounds_trained
        _assert_dicts_equal(loaded.clients[cid].tensors(), st.tensors())


def _all_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def test_storage_write_bytes_leaves_no_temporary_files(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes("a/b/c.bin", b"first")
    storage.write_bytes("a/b/c.bin", b"second")
    storage.write_bytes("top.txt", b"x")
    assert (tmp_path / "run" / "a" / "b" / "c.bin").read_bytes() == b"second"
    assert storage.read_bytes("a/b/c.bin") == b"second"
    assert storage.exists("a/b/c.bin") and not storage.exists("a/b/d.bin")
    names = [os.path.relpath(p, tmp_path / "run") for p in _all_files(tmp_path / "run")]
    assert sorted(names) == ["a/b/c.bin", "top.txt"]
    assert storage.list_dirs("a") == ["b"]
    assert storage.list_dirs("missing") == []
    # a checkpoint save leaves none behind either
    save_checkpoint(storage, make_checkpoint())
    assert not [p for p in _all_files(tmp_path / "run") if ".tmp-" in p]
    assert not [d for d in os.listdir(tmp_path / "run" / "checkpoints") if ".tmp-" in d]


class _FailingMoveFS:
    """Delegates to the real filesystem but fails when moving a file into place."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def move(self, src, dst):
        raise OSError("simulated crash before the rename")


def test_storage_write_is_atomic_when_interrupted(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes("metrics.jsonl", b"good\n")
    storage.fs = _FailingMoveFS(storage.fs)
    with pytest.raises(OSError):
        storage.write_bytes("metrics.jsonl", b"partial")
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == b"good\n"


def test_metrics_log_files(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    log = MetricsLog(storage)
    log.append({"round": 0, "loss": 1.5, "gfl_gm": None})
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").is_file()
    assert not (run / "curves.png").exists()  # nothing evaluated yet
    log.append({"round": 1, "loss": 1.2, "gfl_gm": 0.5, "pfl_gm": 0.4, "pfl_pm": 0.7, "name": "t"})
    log.append({"round": 2, "loss": 1.0, "gfl_gm": 0.6, "pfl_gm": 0.45, "pfl_pm": 0.75, "extra": 3})

    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]  # MetricsLog keeps what it is given
    assert json.loads(lines[1])["pfl_pm"] == 0.7
    csv_lines = (run / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == ["round", "loss", "gfl_gm", "pfl_gm", "pfl_pm", "name", "extra"]
    assert len(csv_lines) == 4
    assert csv_lines[1] == "0,1.5,,,,,"
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert not [p for p in _all_files(run) if ".tmp-" in p]


def test_metrics_log_resume_keeps_records_up_to_round(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    log = MetricsLog(storage)
    for r in range(1, 6):
        log.append({"round": r, "gfl_gm": 0.1 * r})
    # Resuming from the checkpoint after round 2 keeps rounds 1 and 2 and drops what came later.
    resumed = MetricsLog.resume(storage, rounds_done=2)
    assert [rec["round"] for rec in resumed.records] == [1, 2]
    resumed.append({"round": 3, "gfl_gm": 0.99})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[-1])["gfl_gm"] == 0.99
    assert MetricsLog.resume(RunStorage(str(tmp_path / "empty")), 5).records == []


def test_metrics_files_are_appended_and_curves_redrawn_on_evaluation_rounds_only(tmp_path):
    """A round appends to metrics.jsonl and metrics.csv (the same file, not a new one moved over it); the CSV
    is rewritten only for a record that brings new columns, the curves only on an evaluation round."""
    run = tmp_path / "run"
    log = MetricsLog(RunStorage(str(run)))
    log.append({"round": 1, "loss": 1.5})
    inode = {name: os.stat(run / name).st_ino for name in ("metrics.jsonl", "metrics.csv")}
    log.append({"round": 2, "loss": 1.4})
    assert {name: os.stat(run / name).st_ino for name in inode} == inode  # appended in place
    log.append({"round": 3, "loss": 1.3, "gfl_gm": 0.5})  # new columns: the CSV gets its wider header
    assert os.stat(run / "metrics.jsonl").st_ino == inode["metrics.jsonl"]
    assert os.stat(run / "metrics.csv").st_ino != inode["metrics.csv"]
    curves = os.stat(run / "curves.png").st_ino
    log.append({"round": 4, "loss": 1.2})
    assert os.stat(run / "curves.png").st_ino == curves  # not an evaluation round: not redrawn
    log.append({"round": 5, "loss": 1.1, "gfl_gm": 0.6})
    assert os.stat(run / "curves.png").st_ino != curves
    assert (run / "metrics.csv").read_text().splitlines() == [
        "round,loss,gfl_gm", "1,1.5,", "2,1.4,", "3,1.3,0.5", "4,1.2,", "5,1.1,0.6"]
    assert [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_metrics_resume_drops_a_line_cut_short_by_a_kill(tmp_path):
    """A process killed while appending leaves a last line without its newline: resuming drops it and the
    rounds after the checkpoint, and rewrites both files with what it keeps."""
    run = tmp_path / "run"
    log = MetricsLog(RunStorage(str(run)))
    for r in (1, 2, 3):
        log.append({"round": r, "gfl_gm": 0.1 * r})
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "gfl')
    resumed = MetricsLog.resume(RunStorage(str(run)), rounds_done=3)
    assert [rec["round"] for rec in resumed.records] == [1, 2, 3]
    resumed = MetricsLog.resume(RunStorage(str(run)), rounds_done=2)
    resumed.append({"round": 3, "gfl_gm": 0.9})
    assert [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] == [
        {"round": 1, "gfl_gm": 0.1}, {"round": 2, "gfl_gm": 0.2}, {"round": 3, "gfl_gm": 0.9}]
    assert (run / "metrics.csv").read_text().splitlines() == ["round,gfl_gm", "1,0.1", "2,0.2", "3,0.9"]
