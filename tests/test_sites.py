"""Sites (``data.dataset: sites``, docs/sites.md): the config, what a site reads of its data, the site's store,
the server's view of the sites; and, on a real multi-node local Ray cluster (tests/sites_cluster.py), runs at
two sites against the same federation in one process."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from sites_data import PER_CLIENT, SITES, make_sites, sites_config

from fedrod_ray.clients.client import ClientState
from fedrod_ray.clients.site_store import SiteStateError, SiteStore
from fedrod_ray.config import ConfigError, DataConfig, config_from_dict
from fedrod_ray.data import load_server_test
from fedrod_ray.data.files import DatasetFormatError
from fedrod_ray.data.folder import read_folder
from fedrod_ray.data.sites import client_counts, index_site, read_client, read_own_test, read_server_test
from fedrod_ray.federation_state.final import write_final
from fedrod_ray.federation_state.setup import prepare_server
from fedrod_ray.federation_state.site_setup import SiteSetup
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.models.export import load_final
from fedrod_ray.outputs.storage import RunStorage

# --- the config ---------------------------------------------------------------------------------------------


def site_cfg(**sections) -> dict:
    cfg = {"data": {"dataset": "sites", "path": "/srv/test", "partition": "natural", "num_clients": 4},
           "sites": [{"name": "a", "path": "/data/a"}, {"name": "b", "path": "/data/b"}]}
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


def test_a_sites_config_needs_nothing_else_and_runs_on_ray():
    cfg = config_from_dict(site_cfg())
    assert cfg.runtime.mode == "ray"  # auto: sites are Ray nodes
    assert [(s.name, s.path, s.store, s.data_cache) for s in cfg.sites] == [("a", "/data/a", None, 8),
                                                                             ("b", "/data/b", None, 8)]


@pytest.mark.parametrize(("change", "field"), [
    ({"data": {"dataset": "mnist", "path": None}}, "sites: has no effect"),
    ({"sites": []}, "sites: data.dataset=sites"),
    ({"sites": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, "sites.1.name:"),
    ({"sites": [{"name": "../a", "path": "/x"}]}, "sites.0.name:"),
    ({"sites": [{"name": "a", "paht": "/x"}]}, "unknown config key sites.0.paht"),
    ({"data": {"partition": "dirichlet"}}, "data.partition:"),
    ({"data": {"new_clients": 1, "num_clients": 3}}, "data.new_clients:"),
    ({"data": {"download": False}}, "data.download:"),
    ({"runtime": {"mode": "local"}}, "runtime.mode:"),
    ({"runtime": {"clients_per_actor": 2}}, "runtime.clients_per_actor:"),
    ({"eval": {"estimate_size": 100, "eval_every": 2}}, "eval.estimate_size:"),
    ({"rounds": {"mode": "fedbuff"}}, "rounds.mode:"),
    ({"train": {"head": "fedfomo", "balanced_loss": "ce"}}, "train.head:"),
])
def test_a_sites_config_error_names_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict(site_cfg(**change))
    assert str(e.value).startswith(field), str(e.value)


# --- a site's data ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sites(shared_data_dir, tmp_path_factory):
    return make_sites(tmp_path_factory.mktemp("sites"), shared_data_dir)


@pytest.fixture(scope="module")
def own_sites(shared_data_dir, tmp_path_factory):
    return make_sites(tmp_path_factory.mktemp("own"), shared_data_dir, own_tests=True)


def test_a_site_reports_its_clients_and_reads_each_as_the_in_memory_folder_has_it(sites):
    classes = read_server_test(str(sites["server"])).classes
    assert classes == tuple(str(c) for c in range(10))
    index = index_site(str(sites["a"]), classes, "sites.0.path")
    assert index.names == SITES["a"] and index.sizes == (PER_CLIENT,) * 3
    assert index.image_shape == (1, 28, 28) and not index.own_tests
    whole = read_folder(str(sites["all"]))  # every client of both sites, as data.dataset=folder reads them
    for k, name in enumerate(whole.client_names):
        site = "a" if name in SITES["a"] else "b"
        arrays = read_client(sites[site] / "clients" / name, classes)
        rows = whole.train_clients == k
        assert np.array_equal(arrays.x, whole.train_x[rows]) and np.array_equal(arrays.y, whole.train_y[rows])
        assert np.array_equal(client_counts(sites[site] / "clients" / name, classes),
                              np.bincount(arrays.y, minlength=10))
        assert read_own_test(sites[site] / "clients" / name, classes) is None


def test_a_site_of_npz_clients_reads_as_its_folders(sites, tmp_path):
    classes = tuple(str(c) for c in range(10))
    for name in SITES["a"]:
        arrays = read_client(sites["a"] / "clients" / name, classes)
        (tmp_path / "clients").mkdir(exist_ok=True)
        np.savez(tmp_path / "clients" / f"{name}.npz", x_train=arrays.x[:, 0], y_train=arrays.y,
                 x_test=arrays.x[:2, 0], y_test=arrays.y[:2])
    index = index_site(str(tmp_path), classes, "sites.0.path")
    assert index.names == SITES["a"] and index.sizes == (PER_CLIENT,) * 3 and index.own_tests
    for name in SITES["a"]:
        folder, npz = (read_client(p, classes) for p in (sites["a"] / "clients" / name,
                                                             tmp_path / "clients" / f"{name}.npz"))
        assert np.array_equal(folder.x, npz.x) and np.array_equal(folder.y, npz.y)
        assert np.array_equal(client_counts(tmp_path / "clients" / f"{name}.npz", classes),
                              np.bincount(folder.y, minlength=10))
        assert np.array_equal(read_own_test(tmp_path / "clients" / f"{name}.npz", classes)[1], folder.y[:2])


def test_clients_with_their_own_test_sets(own_sites):
    classes = tuple(str(c) for c in range(10))
    assert index_site(str(own_sites["b"]), classes, "sites.1.path").own_tests
    x, y = read_own_test(own_sites["b"] / "clients" / "b0", classes)
    assert x.shape == (12, 1, 28, 28) and len(set(y.tolist())) == 3


def test_a_client_class_the_server_does_not_know_is_refused(sites, tmp_path):
    classes = tuple(str(c) for c in range(9))  # no class "9"
    with pytest.raises(DatasetFormatError, match=r"class '9' is not one of the server's"):
        for name in SITES["b"]:
            read_client(sites["b"] / "clients" / name, classes)


def test_the_server_reads_its_test_set_only(sites, tmp_path):
    """The server's data.path holds no training data: an .npz with x_train is refused; its normalisation is
    the test set's own statistics, so nothing of the sites' data reaches the server."""
    test = read_server_test(str(sites["server"]))
    np.savez(tmp_path / "with_train.npz", x_test=test.x, y_test=test.y, x_train=test.x, y_train=test.y)
    with pytest.raises(DatasetFormatError, match="the server holds no training data"):
        read_server_test(str(tmp_path / "with_train.npz"))
    np.savez(tmp_path / "test.npz", x_test=test.x[:, 0], y_test=test.y, class_names=np.array(test.classes))
    ds = load_server_test(DataConfig(dataset="sites", path=str(tmp_path / "test.npz"), partition="natural"))
    assert ds.train_x.shape == (0, 1, 28, 28) and len(ds.test_y) == 100 and ds.class_names == list(test.classes)
    pixels = test.x.astype(np.float32) / 255
    assert ds.mean == pytest.approx((pixels.mean(),)) and ds.std == pytest.approx((pixels.std(),))


def test_the_server_setup_numbers_the_sites_clients_in_blocks(sites):
    cfg = config_from_dict(sites_config(sites, "hyper"))
    server = prepare_server(cfg)
    classes = tuple(server.dataset.class_names)
    indexes = [index_site(str(sites[name]), classes, f"sites.{i}.path") for i, name in enumerate(SITES)]
    setup = SiteSetup.of(server, indexes)
    assert [(s.name, s.ids) for s in setup.sites] == [("a", range(3)), ("b", range(3, 6))]
    assert setup.num_clients == 6 and setup.all_client_ids == list(range(6))
    assert setup.sites[1].client_name(4) == "b1" and setup.sizes.tolist() == [PER_CLIENT] * 6
    with pytest.raises(RuntimeError, match="stays at its site"):
        _ = setup.class_dists
    cfg.data.num_clients = 5
    with pytest.raises(ConfigError, match=r"^data.num_clients: the sites hold 6 clients \(a 3, b 3\)"):
        SiteSetup.of(prepare_server(cfg), indexes)


def test_final_at_sites_serves_the_generic_model_and_no_clients_head(sites, tmp_path):
    """At sites the server never holds a phi_m: a linear run's final/ has the GM and no personal head (where an
    in-memory run's would have every client's)."""
    cfg = config_from_dict(sites_config(sites, "linear"))
    server = prepare_server(cfg)
    classes = tuple(server.dataset.class_names)
    setup = SiteSetup.of(server, [index_site(str(sites[n]), classes, "sites.0.path") for n in SITES])
    model = setup.build_model()
    glob = {k: v for k, v in model.state_dict().items() if k in set(model.shared_keys())}
    snap = Snapshot(3, cfg, glob, {}, {cid: ClientState(rounds_trained=1) for cid in range(6)})
    write_final(RunStorage(str(tmp_path)), setup, snap, {"gfl_gm": 0.5})
    served = load_final(RunStorage(str(tmp_path)))
    assert served.meta.head == "linear" and served.personal_heads == {}
    assert all(torch.equal(served.model.state_dict()[k], v) for k, v in glob.items())


# --- a site's store -----------------------------------------------------------------------------------------


def state(seed: int, rounds: int) -> ClientState:
    g = torch.Generator().manual_seed(seed)
    return ClientState(personal={"personal_head.weight": torch.randn(10, 8, generator=g)},
                       local_model={"w": torch.randn(3, generator=g)}, rounds_trained=rounds)


def test_a_site_store_keeps_each_version_and_gives_back_what_was_committed(tmp_path):
    store = SiteStore(str(tmp_path), capacity=0)  # nothing cached: every load reads the file
    digest = store.save("c1", state(0, 1))
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == ["1.safetensors"]
    again = SiteStore(str(tmp_path), capacity=4).load("c1", 1, digest)
    assert again.rounds_trained == 1 and all(torch.equal(a, b) for a, b in
                                             zip(again.tensors().values(), state(0, 1).tensors().values()))
    assert store.load("c1", 0, None).tensors() == {}  # version 0: the initial state, no file
    assert store.check({"c1": (1, digest)}) == []


def test_a_site_store_refuses_a_state_other_than_the_committed_one(tmp_path):
    """Attacker's side: a state file replaced (another run's, or edited) behind the server's back is refused,
    in memory as on disk; so is a version the store never had."""
    store = SiteStore(str(tmp_path), capacity=4)
    digest = store.save("c1", state(0, 1))
    other = SiteStore(str(tmp_path / "other"), capacity=0)
    other.save("c1", state(1, 1))
    (tmp_path / "c1" / "1.safetensors").write_bytes((tmp_path / "other" / "c1" / "1.safetensors").read_bytes())
    fresh = SiteStore(str(tmp_path), capacity=4)
    with pytest.raises(SiteStateError, match=r"client c1's state of version 1 has sha256 .*refusing to mix"):
        fresh.load("c1", 1, digest)
    with pytest.raises(SiteStateError, match="refusing to mix"):
        store.load("c1", 1, "0" * 64)  # the cached state is not the one named either
    with pytest.raises(SiteStateError, match="client c1 has no state of version 2"):
        fresh.load("c1", 2, digest)
    assert len(fresh.check({"c1": (1, digest), "c2": (1, digest)})) == 2


def test_a_site_store_prunes_the_versions_no_checkpoint_can_name(tmp_path):
    store = SiteStore(str(tmp_path), capacity=4)
    digests = {v: store.save("c1", state(v, v)) for v in (1, 2, 3)}
    store.save("c2", state(9, 1))
    assert store.prune({"c1": 3, "c2": 1}) == 2
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == ["3.safetensors"]
    assert sorted(p.name for p in (tmp_path / "c2").iterdir()) == ["1.safetensors"]
    assert store.load("c1", 3, digests[3]).rounds_trained == 3
    with pytest.raises(SiteStateError, match="no state of version 2"):
        store.load("c1", 2, digests[2])  # gone from memory too


# --- two sites on a multi-node local Ray cluster ------------------------------------------------------------

PFL = ("pfl_gm", "pfl_pm", "pfl_pm_global")


@pytest.fixture(scope="module")
def on_a_cluster(module_private_ray_env, tmp_path_factory, shared_data_dir) -> dict:
    """tests/sites_cluster.py, run once for the tests of this section (one cluster for all): what its RESULT line
    says."""
    run = tmp_path_factory.mktemp("sites-cluster") / "run"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sites_cluster.py"), str(run)], check=False, cwd=REPO,
                          env={**module_private_ray_env, "FEDROD_TEST_DATA": str(shared_data_dir)},
                          capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_two_sites_on_a_cluster(on_a_cluster):
    """A head with no CPU and no data, one labelled worker node per site (tests/sites_cluster.py)."""
    res = on_a_cluster

    # The same final weights as the federation in one process over the same clients and seed; the same records
    # but for P-FL means, which the sites send as sums (the order of the float additions differs).
    for head in ("hyper", "ditto"):
        assert res[f"{head}_weights_equal"] is True, head
        memory, at_sites = res[f"{head}_records"]
        for m, s in zip(memory, at_sites, strict=True):
            for key in m:
                if key in PFL:
                    assert (math.isnan(m[key]) and math.isnan(s[key])) or abs(m[key] - s[key]) < 1e-12, (key, m, s)
                elif key not in ("gfl_at", "pfl_at"):
                    assert m[key] == s[key], (key, m, s)
            assert s["gfl_at"] == "server: its test set"
            assert s["pfl_at"] == "sites: the server's test set, re-weighted"
    assert all(r["clients_done"] == 3 for r in res["hyper_records"][1])

    # No process of the head node (the driver, the coordinator) opened a file of the sites' data; each site's
    # node opened its own site's files only (the hook saw them: it works); the head's data dir never appeared.
    nodes = res["nodes"]
    opened = {}
    for entry in res["audit"]:
        who, path = entry.split(" ", 1)
        opened.setdefault(who, set()).add(path.split("/run/")[1].split("/")[0])
    assert set(opened) == set(nodes.values()), opened
    assert all(opened[nodes[name]] == {f"site-{name}"} for name in nodes), opened
    assert res["head_data_exists"] is False

    # The coordinator's checkpoint holds no client state, only each site's versions and hashes; each site's
    # store holds its own clients only.
    assert not [f for f in res["checkpoint_files"] if f.startswith("clients/")], res["checkpoint_files"]
    assert all(entry["file"] is None for entry in res["manifest_clients"].values())
    for name, site in res["manifest_sites"].items():
        assert set(site["clients"]) <= set(SITES[name]) and re.fullmatch(r"[0-9a-f]{64}", site["hash"])
        assert all(isinstance(v, int) and re.fullmatch(r"[0-9a-f]{64}", h) for v, h in site["clients"].values())
        assert set(res["stores"][name]) == set(site["clients"])
    # The stores keep what a kept checkpoint names and drop what none can (pruned as the run goes): the client
    # that trained every round kept its last two versions only.
    named = {(name, c, v) for m in res["kept_manifest_sites"] for name, site in m.items()
             for c, (v, _) in site["clients"].items()}
    kept = {(name, c, v) for name, clients in res["store_versions"].items() for c, vs in clients.items() for v in vs}
    assert named <= kept, (named, kept)
    oldest = {(name, c): min(v for n, cc, v in named if (n, cc) == (name, c)) for name, c, _ in named}
    assert all(v >= oldest[name, c] for name, c, v in kept), (kept, oldest)
    assert any(len(vs) == 2 and vs[0] > 1 for clients in res["store_versions"].values() for vs in clients.values())

    # Killed by SIGKILL after a checkpoint, then --resume: bitwise the uninterrupted run.
    assert res["killed_before_end"] is True and res["killed_at"] in ("round_000001", "round_000002")
    assert res["resumed_rc"] == 0, res["resumed_err"]
    assert res["resumed_weights_equal"] is True
    uninterrupted, resumed = res["resumed_records"]
    assert uninterrupted == resumed

    # A site whose store no longer holds the committed state is refused with a clear error (the CLI's own
    # one line); nothing of the run is changed.
    rc, said = res["tampered"]
    assert rc == 2 and len(said) == 1, res["tampered"]
    assert said[0].startswith("fedrod-ray: error: the sites' stores do not hold the states this checkpoint "
                              "committed:"), said
    assert res["tampered_run_unchanged"] is True
    # The sites' clients miscounted by the config: the error names the field, in one line.
    said = "fedrod-ray: error: data.num_clients: the sites hold 6 clients (a 3, b 3); set data.num_clients=6"
    assert res["miscounted"] == [2, [said]], res["miscounted"]
    # A coordinator started again after a death marks the rounds it trains again, at sites as on Ray.
    assert res["restart_marks"] == [1, 1, None], res["restart_marks"]


@pytest.mark.slow
def test_a_site_that_goes_away_and_comes_back(on_a_cluster):
    """Site a's node is removed while its actor trains (``node_loss`` in tests/sites_cluster.py): its clients are
    unavailable, not failed, and the rounds go on with site b's; a node with its label and directory comes back and
    its clients rejoin from the very states they had (the site checks each one's sha256 before it trains); a round
    whose clients are all away waits runtime.site_wait_s, then stops with a clear message."""
    res = on_a_cluster["node_loss"]
    assert res["seen_training"] is True and res["round_2_ended"] is True
    r1, r2, r3, r4 = res["records"]
    everyone = {"clients": 6, "clients_done": 6, "clients_failed": 0, "clients_unavailable": 0,
                "unavailable_ids": [], "pm_eval_unavailable": 0, "pm_eval_failed": 0}
    assert r1 == {"round": 1, **everyone}
    # Lost with its node, the client in training is unavailable too, never failed; site b's clients trained.
    away = {"clients": 6, "clients_done": 3, "clients_failed": 0, "clients_unavailable": 3,
            "unavailable_ids": [0, 1, 2], "pm_eval_unavailable": 3, "pm_eval_failed": 0}
    assert r2 == {"round": 2, **away} and r3 == {"round": 3, **away}
    assert r4 == {"round": 4, **everyone}
    # Back on the new node, each client of site a trained once more from the state it had before.
    assert res["a_actor_node"] == res["a_node_back"]
    assert {name: v for name, (v, _) in res["after"].items()} == {name: v + 1 for name, (v, _) in res["before"].items()}
    assert res["finite"] is True
    assert res["all_away"] == ("round 5: all 6 sampled clients are unavailable (site a has no live node; site b has "
                               "no live node); the run stops here (runtime.site_wait_s says how long a round waits "
                               "for a site to come back)")
    assert res["waited_s"] >= 2.0
