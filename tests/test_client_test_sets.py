"""Natural clients with test sets of their own (``client_test`` in an .npz, ``clients/<id>/test/`` in a folder):
each client's P-FL is its plain accuracy on its own test examples, in-process and on Ray actors; G-FL stays on
the whole test set (their union); and each bad input gives one clear error naming the field or the file."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedrod_ray.cli import main
from fedrod_ray.client_update.local import load_client_weights
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.data import DatasetFormatError, load_dataset, normalize
from fedrod_ray.executors.batched import BatchedExecutor
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.federation_state.setup import make_host, partition_dataset, prepare
from fedrod_ray.models.metrics import class_correct, pfl_accuracy, predict
from fedrod_ray.round_loop.federation import Federation

CLIENTS = 4  # 3 training clients and 1 held out
SIZE = 28  # the built-in mnist_cnn's (model.arch: auto), which Ray's actors import without a runtime_env


def save_npz(path: Path, **change) -> dict:
    """28 x 28 grey images of 3 classes; client k trains mostly on class k % 3 and is tested mostly on another
    class, so that its own accuracy and the global test set weighed by its classes are different numbers."""
    rng = np.random.default_rng(0)
    train_owner = np.repeat(np.arange(CLIENTS), 15)
    y_train = np.where(rng.random(len(train_owner)) < 0.7, train_owner % 3, rng.integers(0, 3, len(train_owner)))
    test_owner = np.repeat(np.arange(CLIENTS), 6)
    y_test = np.where(rng.random(len(test_owner)) < 0.6, (test_owner + 1) % 3, rng.integers(0, 3, len(test_owner)))
    patterns = rng.integers(0, 256, (3, SIZE, SIZE))

    def images(y):
        return np.clip(patterns[y] + rng.normal(0, 60, (len(y), SIZE, SIZE)), 0, 255).astype(np.uint8)

    arrays = {"x_train": images(y_train), "y_train": y_train, "x_test": images(y_test), "y_test": y_test,
              "client_train": train_owner, "client_test": test_owner, **change}
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return arrays


def npz_config(path: Path, *overrides: str):
    return config_from_dict({
        "seed": 1,
        "data": {"dataset": "arrays", "path": str(path), "partition": "natural", "num_clients": CLIENTS - 1,
                 "new_clients": 1},
        "train": {"head": "linear", "rounds": 2, "client_fraction": 1.0, "local_epochs": 1, "batch_size": 8},
        "eval": {"finetune_epochs": 1, "finetune_train": True},
        "runtime": {"torch_threads": 1},
    }, list(overrides))


def run(setup, executor) -> tuple[Federation, list[dict]]:
    fed = Federation(setup, executor, log=lambda s: None)
    return fed, [fed.step(r) for r in range(setup.cfg.train.rounds)]


def accuracy_of(model, x, y, personal: bool) -> float:
    return float((predict(model, x, 64, personal) == y).double().mean())


@pytest.mark.parametrize("batched", [0, 2])
def test_pfl_is_each_clients_plain_accuracy_on_its_own_test_examples(tmp_path, one_torch_thread, batched):
    arrays = save_npz(tmp_path / "own.npz")
    setup = prepare(npz_config(tmp_path / "own.npz", f"runtime.batched_clients={batched}"))
    fed, records = run(setup, BatchedExecutor(make_host(setup), batched) if batched else InProcessExecutor(make_host(setup)))
    rec = records[-1]
    ds, m = setup.dataset, setup.num_clients
    # Client m of the partition is the data's client named part.client_names[m]: its own test images, by hand.
    x_test = normalize(torch.from_numpy(arrays["x_test"][:, None]), ds.mean, ds.std)
    y_test = torch.from_numpy(arrays["y_test"])
    own = {cid: np.flatnonzero(arrays["client_test"] == int(name))
           for cid, name in enumerate(setup.partition.client_names)}

    def model_with(shared, personal=None):
        model = setup.build_model()
        load_client_weights(model, shared, personal)
        return model

    gm = model_with(fed.global_shared)
    assert rec["gfl_gm"] == pytest.approx(accuracy_of(gm, x_test, y_test, False), abs=1e-12)
    gm_acc = {cid: accuracy_of(gm, x_test[rows], y_test[rows], False) for cid, rows in own.items()}
    assert rec["pfl_gm"] == pytest.approx(np.mean([gm_acc[c] for c in range(m)]), abs=1e-12)
    assert rec["pfl_gm_new"] == pytest.approx(gm_acc[m], abs=1e-12)
    # PM: each client's own model, with its personalized logits; global reading: the GM with the client's head.
    pm = [accuracy_of(model_with(fed.clients[c].local_model, fed.clients[c].personal), x_test[own[c]],
                      y_test[own[c]], True) for c in range(m)]
    assert rec["pfl_pm"] == pytest.approx(np.mean(pm), abs=1e-12)
    pm_global = [accuracy_of(model_with(fed.global_shared, fed.clients[c].personal), x_test[own[c]],
                             y_test[own[c]], True) for c in range(m)]
    assert rec["pfl_pm_global"] == pytest.approx(np.mean(pm_global), abs=1e-12)
    # The held-out client never trained: its model before fine-tuning is the GM.
    assert rec["pfl_new_before"] == pytest.approx(gm_acc[m], abs=1e-12)
    assert 0 <= rec["pfl_new_after"] <= 1 and 0 <= rec["pfl_ft"] <= 1 and rec["finetune_failed"] == 0
    # Not what the global test set weighed by each client's classes gives (which is what this replaces).
    correct, total = class_correct(predict(gm, setup.test.x, 64), setup.test.y, ds.num_classes)
    assert abs(rec["pfl_gm"] - float(pfl_accuracy(correct, total, setup.class_dists)[:m].mean())) > 1e-3


def test_ray_actors_give_the_same_metrics(tmp_path, ray_session, one_torch_thread):
    save_npz(tmp_path / "own.npz")
    cfg = npz_config(tmp_path / "own.npz", "runtime.mode=ray")
    local = prepare(npz_config(tmp_path / "own.npz"))
    _, expected = run(local, InProcessExecutor(make_host(local)))
    setup = prepare(cfg)
    executor = RayExecutor(setup, plan_layout(cfg.runtime, CLIENTS, ray_session.cluster_resources()))
    try:
        _, records = run(setup, executor)
    finally:
        executor.close()
    keys = ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_gm_new", "pfl_new_before", "pfl_new_after", "pfl_ft")
    assert [{k: r[k] for k in keys if k in r} for r in records] == [{k: r[k] for k in keys if k in r}
                                                                  for r in expected]
    assert "pfl_ft" in records[-1]


def write_png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), value, np.uint8), mode="L").save(path)


def write_clients(root: Path, tests: dict[str, dict[str, int]] | None = None) -> Path:
    """clients/<name>/<class>/ with a few images each and, per ``tests``, clients/<name>/test/<class>/."""
    train = {"alice": {"cat": 3, "dog": 1}, "bob": {"dog": 2}, "carol": {"cat": 1, "eel": 2}}
    tests = {"alice": {"dog": 2}, "bob": {"cat": 1, "eel": 1}, "carol": {"eel": 3}} if tests is None else tests
    for name, per_class in train.items():
        for cls, n in per_class.items():
            for i in range(n):
                write_png(root / "clients" / name / cls / f"{i}.png", 10 * i)
    for name, per_class in tests.items():
        for cls, n in per_class.items():
            for i in range(n):
                write_png(root / "clients" / name / "test" / cls / f"{i}.png", 10 * i + 5)
    return root


def test_folder_layout_client_test_sets_and_the_partition_command(tmp_path):
    root = write_clients(tmp_path / "d")
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{dataset: folder, path: {root}, partition: natural, num_clients: 2, new_clients: 1}}\n")
    cfg = config_from_dict({"data": {"dataset": "folder", "path": str(root), "partition": "natural",
                                     "num_clients": 2, "new_clients": 1}})
    ds = load_dataset(cfg.data)
    assert ds.class_names == ["cat", "dog", "eel"] and ds.client_names == ("alice", "bob", "carol")
    assert len(ds.train_y) == 9 and len(ds.test_y) == 7  # "test" is no class: the global test set is the union
    part = partition_dataset(cfg, ds)
    for m, name in enumerate(part.client_names):
        k = ds.client_names.index(name)
        assert np.array_equal(np.flatnonzero(part.test_clients == m), np.flatnonzero(ds.test_clients == k))
        expected = {"alice": [0, 2, 0], "bob": [1, 0, 1], "carol": [0, 0, 3]}[name]
        assert part.test_counts[m].tolist() == expected
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["partition", "--config", str(config)]) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:5] == ["client", "name", "kind", "n", "test"]
    row = next(line for line in lines if " carol " in line).split()
    assert row[4] == "3"  # carol's own test examples, beside its 3 training ones
    assert "own test sets: 7 examples; per client min 2, median 2, max 3" in out.getvalue()


def _npz_error(tmp_path, **change) -> str:
    save_npz(tmp_path / "bad.npz", **change)
    with pytest.raises(DatasetFormatError) as e:
        load_dataset(config_from_dict({"data": {"dataset": "arrays", "path": str(tmp_path / "bad.npz")}}).data)
    assert "bad.npz: client_test" in str(e.value)
    return str(e.value)


def test_bad_client_test_arrays_are_one_clear_error(tmp_path):
    owners = np.repeat(np.arange(CLIENTS), 6)
    assert "client 4 has test examples but no training examples" in _npz_error(
        tmp_path, client_test=np.where(owners == 3, 4, owners))
    assert "client 3 has no test examples; either every client has its own test set or none does" in _npz_error(
        tmp_path, client_test=np.where(owners == 3, 0, owners))
    assert "one client id per test image (24)" in _npz_error(tmp_path, client_test=owners[:-1])
    assert "client ids of client_train's kind" in _npz_error(tmp_path, client_test=owners.astype(str))
    assert "no client_train" in _npz_error(tmp_path, client_train=None)


@pytest.mark.parametrize("tests, where, words", [
    ({"alice": {"dog": 1}, "bob": {"cat": 1}}, "clients/carol", "has no test/ folder while other clients do"),
    (None, "clients/dave", "has test images but no training images"),
])
def test_bad_client_test_folders_name_the_folder(tmp_path, tests, where, words):
    root = write_clients(tmp_path / "d", tests)
    if tests is None:
        write_png(root / "clients" / "dave" / "test" / "cat" / "0.png", 1)
    with pytest.raises(DatasetFormatError, match=words) as e:
        load_dataset(config_from_dict({"data": {"dataset": "folder", "path": str(root)}}).data)
    assert str(e.value).startswith(str(root / where))


def test_the_pfl_estimate_is_refused_with_own_test_sets(tmp_path):
    save_npz(tmp_path / "own.npz")
    with pytest.raises(ConfigError, match="eval.estimate_size: the P-FL estimate samples the global test set"):
        prepare(npz_config(tmp_path / "own.npz", "eval.estimate_size=6", "eval.eval_every=2"))
