"""Secure aggregation of the shared part with Flower's SecAgg+ (``fedrod_ray_flower.secure``).

Without Flower's processes: the nodes' sums, summed, are the round loop's sums (by hand and against
``OrderedAverager``), and the settings and methods secure aggregation refuses. With them (the SuperLink and
three SuperNodes of tests/test_flower.py): a secure run is the unsecured one within SecAgg+'s quantization
error, a SuperNode killed mid-round is recovered by the protocol, and no client's shared update reaches
anything the server side writes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flower_federation import require_flower

require_flower()

import test_flower
from fedrod_ray_flower import wire
from fedrod_ray_flower.node import NodeData
from fedrod_ray_flower.secure import (
    Layout,
    Scales,
    check_secure,
    node_vector,
    round_sums,
    settings_from,
    too_few_nodes,
)
from safetensors.torch import load_file
from test_flower import TIMING, _bytes_of, distinctive, records, write_config

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import LocalResult, RoundInput
from fedrod_ray.config import ConfigError, config_from_dict, load_config
from fedrod_ray.federation_state.setup import prepare
from fedrod_ray.server_math.aggregate import OrderedAverager
from fedrod_ray.server_math.server import sample_clients

F64 = torch.float64


def result(shared: dict, n: int, loss: float, upload: dict | None = None, personal_loss: float | None = None,
           clipped: bool = False) -> LocalResult:
    return LocalResult(shared={k: torch.tensor(v) for k, v in shared.items()}, num_samples=n, loss=loss,
                       personal_loss=personal_loss, steps=1, seconds=0.0,
                       upload={k: torch.tensor(v) for k, v in (upload or {}).items()}, clipped=clipped)


def test_two_clients_sums_by_hand():
    # theta w from 0 to 1 and to 3 at sample counts 1 and 3, on two nodes; nu from 0 to 2 and to 6.
    anchor = {"w": torch.tensor([0.0]), "nu": torch.tensor([0.0])}
    rule = build_rule("fedavg")
    layout = Layout.of(anchor, {"w"}, {}, dp=False)
    scales = Scales.of([4, 7], {4: 1, 7: 3}, rule)
    assert (scales.generic, scales.samples, scales.count) == (4.0, 4.0, 2.0)
    a = node_vector([result({"w": [1.0], "nu": [2.0]}, 1, 0.5)], anchor, layout, scales, rule.aggregation_weight, 8.0)
    b = node_vector([result({"w": [3.0], "nu": [6.0]}, 3, 1.5)], anchor, layout, scales, rule.aggregation_weight, 8.0)
    # Node a: w's update 1 * 1 / 4, weight 1 / 4, count 1 / 2, samples 1 / 4, loss 1 * 0.5 / 4.
    parts = layout.unpack(a)
    assert parts["generic/w"].tolist() == [0.25] and float(parts["generic_weight"]) == 0.25
    assert float(parts["count"]) == 0.5 and float(parts["loss"]) == 0.125
    sums, count, losses = round_sums(a + b, layout, scales, anchor, has_personal_loss=False)
    # (1 * 1 + 3 * 3) / 4 = 2.5; nu: (1 * 2 + 3 * 6) / 4 = 5; loss (0.5 + 4.5) / 4 = 1.25.
    assert count == 2 and sums.generic.mean()["w"].tolist() == [2.5] and sums.rest.mean()["nu"].tolist() == [5.0]
    assert (losses.done, losses.train_loss, losses.personal_loss) == (2, 1.25, None)


@pytest.mark.parametrize("dp", [False, True])
def test_the_nodes_sums_summed_are_the_round_loops_sums(dp):
    gen = torch.Generator().manual_seed(0)
    anchor = {"w": torch.randn(3, 2, generator=gen), "nu": torch.randn(4, generator=gen)}
    rule = build_rule("scaffold")
    results = [result({k: (v + 0.1 * torch.randn(v.shape, generator=gen)).tolist() for k, v in anchor.items()}, n,
                      0.3 * n, {"w": torch.randn(3, 2, generator=gen).tolist()}, personal_loss=0.1 * n,
                      clipped=n % 2 == 0)
               for n in (5, 2, 9)]
    upload = {"w": torch.zeros(3, 2)}
    layout = Layout.of(anchor, {"w"}, upload, dp)
    scales = Scales.of([0, 1, 2], [5, 2, 9], rule)
    by_node = [results[:2], results[2:]]
    vector = sum(node_vector(rs, anchor, layout, scales, rule.aggregation_weight, 8.0) for rs in by_node)
    sums, count, losses = round_sums(vector, layout, scales, anchor, has_personal_loss=True)
    assert count == 3
    weights = np.array([5, 2, 9], dtype=np.float64)
    assert losses.train_loss == pytest.approx(np.average([r.loss for r in results], weights=weights), rel=1e-12)
    assert losses.personal_loss == pytest.approx(np.average([r.personal_loss for r in results], weights=weights),
                                                 rel=1e-12)

    def folded(part, weight) -> dict:
        averager = OrderedAverager(3)
        for i, r in enumerate(results):
            averager.add(i, part(r), weight(r))
        return averager.sum()

    if dp:
        want = folded(lambda r: r.shared, lambda r: 1.0)
        got = sums.clipped
        assert sums.unclipped == 2 and sums.generic.total is None  # n = 5 and 9 were within the clip norm
    else:
        want = folded(lambda r: {"w": r.shared["w"]}, lambda r: float(r.num_samples))
        got = sums.generic
        rest = folded(lambda r: {"nu": r.shared["nu"]}, lambda r: float(r.num_samples))
        assert sums.rest.weight == pytest.approx(rest.weight, rel=1e-12)
        torch.testing.assert_close(sums.rest.total["nu"], rest.total["nu"], rtol=1e-12, atol=1e-12)
        up = folded(lambda r: r.upload, lambda r: 1.0)
        assert sums.uploads.count == 3 and sums.uploads.weight == 3.0
        torch.testing.assert_close(sums.uploads.total["w"], up.total["w"], rtol=1e-12, atol=1e-12)
        assert sums.uploads.mean()["w"].dtype == torch.float32
    assert got.count == 3 and got.weight == pytest.approx(want.weight, rel=1e-12)
    for k, v in want.total.items():
        torch.testing.assert_close(got.total[k], v, rtol=1e-12, atol=1e-12)
        assert got.mean()[k].dtype == torch.float32


def test_a_node_refuses_sums_that_secagg_would_clip():
    anchor = {"w": torch.tensor([0.0])}
    rule = build_rule("fedavg")
    layout = Layout.of(anchor, {"w"}, {}, dp=False)
    with pytest.raises(ValueError, match="secagg-clipping-range"):
        node_vector([result({"w": [50.0]}, 1, 0.5)], anchor, layout, Scales(1.0, 1.0, 1.0),
                    rule.aggregation_weight, 8.0)


ON = {"secure-aggregation": True, "secagg-num-shares": 3, "secagg-reconstruction-threshold": 2,
      "secagg-clipping-range": 8.0, "secagg-quantization-range": 2**22, "min-nodes": 3}


@pytest.mark.parametrize(("changes", "field"), [
    ({"secure-aggregation": False}, "secagg-num-shares"),  # a setting without effect
    ({"secure-aggregation": "yes"}, "secure-aggregation"),
    ({"secagg-num-shares": 2}, "secagg-num-shares"),
    ({"secagg-num-shares": 0}, "secagg-num-shares"),
    ({"secagg-reconstruction-threshold": 3}, "secagg-reconstruction-threshold"),
    ({"secagg-reconstruction-threshold": 1}, "secagg-reconstruction-threshold"),
    ({"secagg-clipping-range": -1.0}, "secagg-clipping-range"),
    ({"secagg-clipping-range": math.inf}, "secagg-clipping-range"),
    ({"secagg-quantization-range": 2**31}, "secagg-quantization-range"),
    ({"secagg-quantization-range": 0.5}, "secagg-quantization-range"),
    ({"min-nodes": 1}, "min-nodes"),
])
def test_secagg_settings_are_checked_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"run config {field}"):
        settings_from({**ON, **changes})


def test_secagg_settings_read_and_off():
    s = settings_from(ON)
    assert (s.num_shares, s.reconstruction_threshold, s.clipping_range, s.quantization_range) == (3, 2, 8.0, 2**22)
    assert s.quantum() == 16 / 2**22
    assert settings_from({"secure-aggregation": False, "secagg-num-shares": 0, "min-nodes": 1}) is None


@pytest.mark.parametrize("head", ["pfedhn", "pefll", "mtl", "fedfomo"])
def test_methods_whose_server_reads_each_client_are_refused(head):
    cfg = config_from_dict({"data": {"dataset": "synthetic", "num_clients": 4},
                            "train": {"rounds": 1, "head": head, "balanced_loss": "ce"}})
    with pytest.raises(ConfigError, match="train.head"):
        check_secure(prepare(cfg))


@pytest.mark.parametrize("train", [{"head": "hyper", "generic_rule": "scaffold"},
                                   {"head": "ditto", "balanced_loss": "ce"}, {"head": "none", "generic_rule": "feddyn"},
                                   {"head": "fedbabu", "balanced_loss": "ce"}])
def test_methods_whose_server_reads_only_sums_run(train):
    check_secure(prepare(config_from_dict({"data": {"dataset": "synthetic", "num_clients": 4},
                                           "train": {"rounds": 1, **train}})))


def test_secaggs_instructions_carry_the_round_exactly():
    message = RoundInput({"a": torch.randn(4, 3)}, {"c": torch.randn(2, dtype=F64)},
                         {3: {"m": torch.arange(5)}, 9: {"m": torch.zeros(1)}}, 0.5)
    head, back = wire.from_fit_ins(wire.fit_ins({"round": 2, "clip_norm": 0.5}, message, [3]))
    assert head == {"round": 2, "clip_norm": 0.5} and back.clip_norm == 0.5
    assert back.weights["a"].equal(message.weights["a"]) and back.broadcast["c"].dtype == F64
    assert list(back.per_client) == [3] and back.per_client[3]["m"].equal(torch.arange(5))



def test_a_supernode_set_to_secure_aggregation_sends_no_update_in_the_clear(tmp_path, monkeypatch):
    """A server that asks for a plain round (no SecAgg+) gets an error from it, and nothing is trained."""
    from fedrod_ray_flower import client_app
    from flwr.app import Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("run_id", "node_id", "task_id"):  # as a SuperNode's ClientApp process has them
        monkeypatch.setattr(TaskIdentity, f"_{name}", 1)
    content = RecordDict()
    wire.put_header(content, config="{}", round=0, clients=[0], clip_norm=None)
    context = Context(run_id=1, node_id=1, node_config={"secure-aggregation": True, "data-path": str(tmp_path / "d"),
                                                        "state-path": str(tmp_path / "s")},
                      state=RecordDict(), run_config={})
    with pytest.raises(PermissionError, match="secure-aggregation=true"):
        client_app.app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), context)
    assert not (tmp_path / "s").exists()


# --- with Flower's processes: a SuperLink and three SuperNodes (tests/test_flower.py's fixtures) -------------

CLIPPING, LEVELS = 4.0, 2**20
SECAGG = (f"secure-aggregation=true secagg-num-shares=3 secagg-reconstruction-threshold=2 "
          f"secagg-clipping-range={CLIPPING} secagg-quantization-range={LEVELS}")
METRIC_SLACK = 1e-3  # a metric of the weights (accuracy on 10,000 test images): a few examples may change sides
# The new clients' accuracy after fine-tuning from the weights: their own training carries the difference on, and
# their test sets are theirs (weighted by their classes): a few of theirs may change sides.
FINE_TUNED, FINE_TUNED_SLACK = {"pfl_new_after", "pfl_ft"}, 1e-2
# The SuperLink and SuperNodes, their shares of the clients and the in-process runs of ``configs`` (below).
federation, nodes, in_process = test_flower.federation, test_flower.nodes, test_flower.in_process


@pytest.fixture(scope="module")
def configs(tmp_path_factory, shared_data_dir) -> dict[str, Path]:
    """tests/test_flower.py's hyper config (whose clients ``nodes`` splits), for one round, without and with
    client-level DP, and without the evaluation after it where a test reads no metric of the weights (the
    round's record, the privacy it spent, the final weights)."""
    folder = tmp_path_factory.mktemp("secagg-configs")
    dp = write_config(folder, shared_data_dir, "dp", evaluate=False, head="hyper", rounds=1)
    # Client-level DP at a fixed noise multiplier; the noise and the sampling seeded, so that both runs draw
    # the same.
    dp.write_text(yaml.safe_dump({**yaml.safe_load(dp.read_text()), "privacy": {
        "enabled": True, "noise_multiplier": 0.5, "clip_norm": 1.0, "sampling": "fixed", "noise_seed": 3}}))
    return {"hyper": write_config(folder, shared_data_dir, "hyper", head="hyper", rounds=1), "dp": dp,
            "hyper-no-eval": write_config(folder, shared_data_dir, "hyper-no-eval", evaluate=False, head="hyper",
                                          rounds=1)}


def quantization_bound(num_nodes: int, mean_update: float, weight: float = 1.0) -> float:
    """The most a mean made from SecAgg+'s sum can differ from the exact one, per coordinate: each of the
    ``num_nodes`` vectors' entries is rounded by less than one quantum 2c / T, so the sums of the scaled
    updates s and of the scaled weights g are each off by less than e = num_nodes * 2c / T; the mean update s / g (g =
    ``weight``: 1 where every sampled client took part) is then off by less than e (1 + |s / g|) / (g - e)."""
    e = num_nodes * 2 * CLIPPING / LEVELS
    return e * (1 + mean_update) / (weight - e)


def initial_weights(config: Path) -> dict[str, torch.Tensor]:
    """The model's initial weights under ``config``: what every client's first update starts from."""
    return prepare(load_config(config)).build_model().state_dict()


def sampled_hosts(fed, config: Path, round_idx: int) -> dict[int, int]:
    """Round ``round_idx``'s sampled clients -> the index of the SuperNode of ``fed`` that hosts each."""
    cfg = load_config(config)
    hosts = {cid: i for i, path in enumerate(fed.nodes) for cid in NodeData.load(path).client_ids}
    return {cid: hosts[cid] for cid in sample_clients(cfg.seed, round_idx, cfg.data.num_clients,
                                                      cfg.train.client_fraction)}


@pytest.mark.slow
def test_secagg_is_the_unsecured_run_within_the_quantization_error_and_no_update_reaches_the_server(
        federation, configs, in_process, tmp_path):
    run_dir = tmp_path / "run"
    federation.run(configs["hyper"], run_dir, extra=SECAGG)
    want_dir = in_process("hyper")
    (got,), (want,) = records(run_dir), records(want_dir)
    assert got["clients_done"] == want["clients_done"] == 3 and got["clients_failed"] == 0
    a = load_file(str(run_dir / "final" / "model.safetensors"))
    b = load_file(str(want_dir / "final" / "model.safetensors"))
    initial = initial_weights(configs["hyper"])
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        mean_update = float((b[k].double() - initial[k].double()).abs().max()) if k in initial else 0.0
        ulp = float(torch.finfo(b[k].dtype).eps * b[k].double().abs().max())  # the cast to float32
        diff = float((a[k].double() - b[k].double()).abs().max())
        assert diff <= quantization_bound(3, mean_update) + ulp, (k, diff)
        worst = max(worst, diff)
    assert worst > 0, "no difference at all: the run was not quantized, so not securely aggregated"
    for key, value in want.items():
        if key in TIMING:
            continue
        if key in ("train_loss", "personal_loss"):
            assert abs(got[key] - value) <= quantization_bound(3, abs(value)) + 1e-12, key
        elif isinstance(value, float):
            assert abs(got[key] - value) <= (FINE_TUNED_SLACK if key in FINE_TUNED else METRIC_SLACK), key
        else:
            assert got[key] == value, key

    # What the server side wrote: the run directory (checkpoints included) and the SuperLink's database. No
    # sampled client's shared weights after its update (its last local model, on its SuperNode's disk) are in
    # either (the unsecured path keeps them in the run's client store).
    written = b"".join(p.read_bytes() for p in [*run_dir.rglob("*"), federation.database] if p.is_file())
    updates = []
    for cid, node in sampled_hosts(federation, configs["hyper"], 0).items():
        states = federation.run_states(node, configs["hyper"], run_dir) / f"client_{cid}"
        for state in states.glob("*.safetensors"):
            updates += [v for k, v in load_file(str(state)).items()
                        if k.startswith("local_model/") and v.numel() >= 8
                        and not v.flatten()[:8].equal(initial[k.split("/", 1)[1]].flatten()[:8])]
    # A unit that no sampled client's data moved ends equal in every update and in the mean: only a window of
    # an update that the served weights do not hold tells the update apart.
    served = b"".join(_bytes_of(t) for t in [*a.values(), *initial.values()])
    windows = [w for v in updates if (w := distinctive(v, served)) is not None]
    assert windows, "the SuperNodes kept no client's update"
    for window in windows:
        assert window not in written
    # The search does find what the server side did write: the global weights.
    assert all(_bytes_of(v.flatten()[:8]) in written for v in a.values() if v.numel() >= 8)


@pytest.mark.slow
def test_a_supernode_killed_mid_round_is_recovered_by_secagg(federation, configs, tmp_path):
    run_dir = tmp_path / "killed"
    sampled = sampled_hosts(federation, configs["hyper-no-eval"], 0)
    # The node with the fewest of the round's clients (at least one): it is training them when it dies.
    victim = min(set(sampled.values()), key=lambda node: sum(n == node for n in sampled.values()))
    lost = sorted(cid for cid, node in sampled.items() if node == victim)
    log = federation.root / f"supernode{victim}.log"
    before = log.read_text(errors="replace").count("Receiving: train message")
    # Round 1 only, not evaluated: the round's record is all this test reads.
    proc = federation.run(configs["hyper-no-eval"], run_dir, node_timeout=45, wait=False, extra=SECAGG)
    deadline = time.monotonic() + 600
    # SecAgg+'s third message to a node (its stage that collects the masked vectors) is the one it trains in.
    while log.read_text(errors="replace").count("Receiving: train message") < before + 3:
        assert time.monotonic() < deadline and proc.poll() is None, "the victim never reached SecAgg+'s stage 2"
        time.sleep(0.1)
    federation.kill_node(victim)
    try:
        assert proc.wait(timeout=900) == 0
    finally:
        federation.start_node(victim)
    (record,) = records(run_dir)
    # The round completed from the other SuperNodes: the victim's pairwise masks were recovered from their
    # shares, and the sum holds exactly the others' clients.
    assert record["failed_ids"] == lost and record["clients_done"] == len(sampled) - len(lost)
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_client_level_dp_under_secagg_spends_what_the_ray_runtime_spends(federation, configs, in_process, tmp_path):
    """The same epsilon and clip norm in every record as the in-process run (whose accountant the Ray runtime
    shares), and the same seeded noise on a sum within SecAgg+'s quantization error: every final weight within
    nodes * 2c / T of the in-process run's (the sum of the 3 clipped updates, off by 3 * that over 3, the
    expected number, which the noised mean divides by)."""
    run_dir = tmp_path / "dp"
    federation.run(configs["dp"], run_dir, extra=SECAGG)
    (got,), (want,) = records(run_dir), records(in_process("dp"))
    assert got["dp_epsilon"] == want["dp_epsilon"] and got["dp_clip_norm"] == want["dp_clip_norm"]
    assert got["clients_done"] == want["clients_done"] == 3
    a = load_file(str(run_dir / "final" / "model.safetensors"))
    b = load_file(str(in_process("dp") / "final" / "model.safetensors"))
    for k in a:
        ulp = float(torch.finfo(b[k].dtype).eps * b[k].double().abs().max())
        assert float((a[k].double() - b[k].double()).abs().max()) <= 3 * 2 * CLIPPING / LEVELS + ulp, k
    guarantee = [json.loads(p.read_text())["privacy"] for p in (run_dir / "final" / "meta.json",
                                                                in_process("dp") / "final" / "meta.json")]
    assert guarantee[0] == guarantee[1]


def test_a_round_whose_sampled_clients_sit_on_too_few_nodes_is_not_summed():
    """From the server's side: SecAgg+ over three nodes of which only one holds sampled clients gives that
    node's sum (the others send zeros). Such a round is declined before any node trains."""
    s = settings_from(ON)
    assert s.min_sampled_nodes == 2
    assert too_few_nodes({1: [3, 4], 2: [5], 3: []}, s) is None
    assert too_few_nodes({1: [3, 4], 2: [], 3: []}, s) == (
        "its 2 sampled client(s) sit on 1 SuperNode(s), fewer than run config secagg-min-sampled-nodes=2: their "
        "secure sum would reveal a single node's sum")
    assert too_few_nodes({1: [3, 4], 2: [], 3: []}, settings_from({**ON, "secagg-min-sampled-nodes": 1})) is None
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="run config secagg-min-sampled-nodes"):
            settings_from({**ON, "secagg-min-sampled-nodes": bad})
    with pytest.raises(ConfigError, match="run config secagg-min-sampled-nodes: has no effect"):
        settings_from({"secure-aggregation": False, "secagg-min-sampled-nodes": 2, "min-nodes": 1})
