"""Which clients a private round sampled, from the attacker's side (issue 60; docs/privacy.md): what a run
directory's records, logs and config say of it, with client-level DP and without.

The attack reads each round's virtual seconds (or the step of the virtual clock) and finds the client whose
duration it is, the durations being what anyone computes from config.yaml (the speeds are seeded): the
round's slowest sampled client. Without DP it names one each round; under DP the fields it needs are not
there, unless ``privacy.disclose_sampling`` puts them back, and then the log says the amplification is gone.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_federation import BASE, make_federation

from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import config_from_dict, load_config
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.outputs.metric_schema import EVALUATED
from fedrod_ray.outputs.sampling_secrecy import SAMPLING_FIELDS, hide_client_ids, redact_record
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation, RoundFailedError
from fedrod_ray.server_math.server import sample_clients

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DP = ("privacy.enabled=true", "privacy.noise_multiplier=1.0", "privacy.clip_norm=0.1", "train.rounds=3",
      "eval.eval_every=3")
# What a private round's record may hold: the schedule, counts, the server's own timings, the un-noised mean
# losses (docs/privacy.md says what they are), the accountant's figures and the evaluation's.
ALLOWED = {"round", "name", "lr", "clients", "clients_done", "clients_failed", "train_loss", "personal_loss",
           "train_seconds", "seconds", "dp_epsilon", "dp_clip_norm", *EVALUATED}


def named_by_clock(records: list[dict], durations) -> list[set[int]]:
    """The attack: per round, the clients whose duration is the round's virtual seconds (read, or the step of
    the virtual clock): the slowest sampled client, or nobody when the records do not say."""
    named, clock = [], 0.0
    for rec in records:
        seconds = rec.get("round_virtual_seconds")
        if seconds is None and rec.get("virtual_time") is not None:
            seconds = rec["virtual_time"] - clock
        clock = rec.get("virtual_time", clock)
        named.append(set() if seconds is None else
                     {cid for cid, d in enumerate(durations) if math.isclose(d, seconds, rel_tol=1e-9)})
    return named


def test_redaction_by_hand():
    record = {"round": 1, "clients": 3, "failed_ids": [4], "virtual_time": 9.5, "round_virtual_seconds": 9.5,
              "train_loss": 0.5}
    hidden = config_from_dict({}, list(DP)).privacy
    shown = config_from_dict({}, [*DP, "privacy.disclose_sampling=true"]).privacy
    plain = config_from_dict({}, []).privacy
    assert redact_record(record, hidden) == {"round": 1, "clients": 3, "train_loss": 0.5}
    assert redact_record(record, shown) == record == redact_record(record, plain)
    assert (hide_client_ids("[round 2] client 17 failed: x; 2 of 3 clients failed (clients 3, 17)")
            == "[round 2] a sampled client failed: x; 2 of 3 clients failed (sampled clients)")


def _run(*overrides, log=None):
    fed = make_federation(*overrides, log=log)
    return fed, [fed.step(r) for r in range(fed.rounds)]


def test_the_clock_names_a_sampled_client_without_dp():
    """The attack works on a plain run (this is what the DP run must not allow)."""
    fed, records = _run("train.rounds=3", "eval.eval_every=3")
    attacker = make_federation("train.rounds=3", "eval.eval_every=3").durations  # from the config alone
    for r, named in enumerate(named_by_clock(records, attacker)):
        sampled = sample_clients(fed.cfg.seed, r, fed.setup.num_clients, fed.cfg.train.client_fraction)
        assert named and named <= set(sampled), r


def test_a_private_runs_records_and_logs_do_not_say_who_was_sampled(tmp_path):
    """A private run's directory (secure sampling): no record field names a client or varies with which
    were sampled beyond counts, the clock attack names nobody, and no log line names a client."""
    lines: list[str] = []
    cfg = config_from_dict({**BASE, "run_dir": str(tmp_path)}, list(DP))
    records = run_local(cfg, RunStorage(str(tmp_path)), log=lines.append)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == records and len(records) == 3
    for rec in written:
        assert set(rec) <= ALLOWED, set(rec) - ALLOWED
        assert not set(rec) & set(SAMPLING_FIELDS)
    attacker = _federation_of(load_config(str(tmp_path / "config.yaml"))).durations  # from config.yaml alone
    assert named_by_clock(written, attacker) == [set(), set(), set()]
    assert not any("disclose_sampling" in line for line in lines)


def test_disclosed_sampling_is_named_and_the_log_says_what_it_costs():
    lines: list[str] = []
    fed, records = _run(*DP, "privacy.noise_seed=5", "privacy.disclose_sampling=true", log=lines.append)
    attacker = make_federation(*DP, "privacy.noise_seed=5", "privacy.disclose_sampling=true").durations
    truth = [set(fed.dp.sample(r)) for r in range(3)]
    named = named_by_clock(records, attacker)
    assert any(named) and all(n <= t for n, t in zip(named, truth))
    assert any("privacy.disclose_sampling=true" in line and "amplification no longer applies" in line
               for line in lines)


def test_a_failed_client_is_not_named_under_dp():
    """A sampled client that fails: counted, never named, in the record, the log and the error that stops
    the run; with disclose_sampling, named as without DP."""
    overrides = (*DP, "privacy.noise_seed=5", "privacy.sampling=fixed", "runtime.max_failed_fraction=0.5")
    for disclose in (False, True):
        lines: list[str] = []
        fed = make_federation(*overrides, f"privacy.disclose_sampling={str(disclose).lower()}", log=lines.append)
        bad = fed.dp.sample(0)[0]
        fed.clients[bad] = ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})
        record = fed.step(0)
        assert record["clients_failed"] == 1
        failed = [line for line in lines if "failed" in line]
        assert failed
        if disclose:
            assert record["failed_ids"] == [bad] and any(f"client {bad} failed" in line for line in failed)
        else:
            assert "failed_ids" not in record and all(f"client {bad}" not in line for line in lines)
            assert any("a sampled client failed" in line for line in failed)
    fed = make_federation(*overrides[:-1], "runtime.max_failed_fraction=0")
    bad = fed.dp.sample(0)[0]
    fed.clients[bad] = ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})
    with pytest.raises(RoundFailedError) as e:
        fed.step(0)
    assert "(sampled clients)" in str(e.value) and f"client {bad}" not in str(e.value)


def _federation_of(cfg):
    """The federation anyone with the code builds from a run's config (no training)."""
    setup = prepare(cfg)
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
