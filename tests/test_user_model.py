"""The user's own model: model.arch as a package.module:factory import path, plug-ins registered through
entry points (fedrod_ray.models, fedrod_ray.datasets), the built-in resnet20, and a model trained with a
user factory served over HTTP."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import sys
import textwrap

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_api.settings import Settings
from fedrod_ray_tune.repro_spec import build_spec
from fedrod_ray_tune.space import load_sweep
from PIL import Image

from fedrod_ray.cli import main
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.data import declared_image_shape, load_dataset
from fedrod_ray.federation_state.setup import check_model_arch
from fedrod_ray.models import build_model, count_parameters
from fedrod_ray.models.export import ExportError, load_final

FACTORIES = '''
from torch import nn

def good(shape):
    return nn.Sequential(nn.Conv2d(shape[0], 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())

def spatial(shape):  # forgets to flatten: N x 4 x H x W
    return nn.Conv2d(shape[0], 4, 3, padding=1)

def not_a_module(shape):
    return [nn.Linear(3, 3)]

def raises(shape):
    raise ValueError("needs 32 x 32 images")
'''


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A temporary package ``userfactories`` on sys.path, forgotten afterwards."""
    (tmp_path / "pkg" / "userfactories").mkdir(parents=True)
    (tmp_path / "pkg" / "userfactories" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "userfactories" / "nets.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    yield tmp_path / "pkg"
    for name in [m for m in sys.modules if m.startswith("userfactories")]:
        del sys.modules[name]


def test_resnet20_shape_and_parameter_count():
    """He et al.'s CIFAR ResNet-20: 0.27M parameters with its 10-class layer (269,722 with a biased one)."""
    model = build_model("resnet20", 10, (3, 32, 32), None)
    assert model.feature_dim == 64
    body = count_parameters(model.body)
    assert body + 64 * 10 + 10 == 269_722
    x = torch.randn(5, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert model.features(x).shape == (5, 64) and model(x).shape == (5, 10)
    assert build_model("resnet20", 10, (1, 28, 28), "hyper").features(torch.randn(2, 1, 28, 28)).shape == (2, 64)
    assert config_from_dict({"model": {"arch": "resnet20"}}).model.arch == "resnet20"
    with pytest.raises(ConfigError, match="runtime.batched_clients: .*resnet20 has batch-norm"):
        config_from_dict({"model": {"arch": "resnet20"}, "runtime": {"batched_clients": 4}})


def test_factory_builds_with_the_input_shape_and_measured_feature_size(package):
    model = build_model("userfactories.nets:good", 3, (2, 9, 7), "linear", seed=1)
    assert model.feature_dim == 16 and model.personal_head.weight.shape == (3, 16)
    assert model(torch.randn(4, 2, 9, 7)).shape == (4, 3)
    again = build_model("userfactories.nets:good", 3, (2, 9, 7), "linear", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert config_from_dict({"model": {"arch": "userfactories.nets:good"}}).model.arch == "userfactories.nets:good"


@pytest.mark.parametrize("arch, words", [
    ("userfactories.nets:spatial", r"maps a 2 x 1 x 8 x 8 batch to \(2, 4, 8, 8\), not 2 x d features"),
    ("userfactories.nets:not_a_module", "returned a list, not a torch nn.Module"),
    ("userfactories.nets:raises", r"failed: ValueError: needs 32 x 32 images"),
    ("userfactories.nets:missing", "has no attribute 'missing'"),
    ("userfactories.absent:good", "cannot import userfactories.absent .*ModuleNotFoundError"),
])
def test_bad_factories_name_model_arch_and_what_failed(package, arch, words):
    with pytest.raises(ConfigError, match="^model.arch: .*" + words):
        build_model(arch, 3, (1, 8, 8), None)


def test_an_unknown_arch_name_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="model.arch: 'resnet56' is not one of"):
        config_from_dict({"model": {"arch": "resnet56"}})
    with pytest.raises(ConfigError, match="model.arch: 'pkg.mod:' is not one of"):
        config_from_dict({"model": {"arch": "pkg.mod:"}})


def test_declared_image_shape_is_read_without_loading_the_data(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (6, 9, 7, 3), dtype=np.uint8)  # N x H x W x C
    y = np.arange(6) % 2
    for name, images in (("nhwc", x), ("nchw", x.transpose(0, 3, 1, 2)), ("grey", x[..., 0])):
        np.savez(tmp_path / f"{name}.npz", x_train=images, y_train=y, x_test=images, y_test=y)
        data = config_from_dict({"data": {"dataset": "arrays", "path": str(tmp_path / f"{name}.npz")}}).data
        assert declared_image_shape(data) == load_dataset(data).image_shape == ((1, 9, 7) if name == "grey" else (3, 9, 7))
    for split in ("train", "test"):
        (tmp_path / "pngs" / split / "a").mkdir(parents=True)
        Image.fromarray(x[0]).save(tmp_path / "pngs" / split / "a" / "0.png")
    data = config_from_dict({"data": {"dataset": "folder", "path": str(tmp_path / "pngs")}}).data
    assert declared_image_shape(data) == load_dataset(data).image_shape == (3, 9, 7)
    assert declared_image_shape(config_from_dict({"data": {"dataset": "cifar100"}}).data) == (3, 32, 32)
    # Nothing to read here: loading the data reports it.
    assert declared_image_shape(config_from_dict({"data": {"dataset": "arrays", "path": "nowhere.npz"}}).data) is None


def test_model_arch_is_checked_when_the_config_is_checked(package, tmp_path):
    """Before any data loads: this .npz lacks y_train, which only loading it would find."""
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 6, 5, 3), np.uint8), x_test=np.zeros((2, 6, 5, 3), np.uint8),
             y_test=np.zeros(2, np.int64))
    (tmp_path / "c.yaml").write_text(json.dumps({
        "data": {"dataset": "arrays", "path": str(tmp_path / "d.npz")}, "model": {"arch": "userfactories.nets:spatial"}}))
    rc, _out, err = run_main(["train", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run")])
    assert rc == 2 and err.startswith("fedrod-ray: error: model.arch: the module userfactories.nets:spatial built "
                                      "maps a 2 x 3 x 6 x 5 batch to (2, 4, 6, 5), not 2 x d features"), err
    # A built-in dataset's shape is fixed: no data needed (here there is none to download).
    cfg = config_from_dict({"data": {"dataset": "mnist", "data_dir": str(tmp_path / "none"), "download": False},
                            "model": {"arch": "userfactories.nets:raises"}})
    with pytest.raises(ConfigError, match=r"^model.arch: userfactories.nets:raises\(\(1, 28, 28\)\) failed: "
                                          "ValueError: needs 32 x 32"):
        check_model_arch(cfg)
    check_model_arch(config_from_dict({"data": {"dataset": "mnist", "data_dir": str(tmp_path / "none")},
                                       "model": {"arch": "userfactories.nets:good"}}))
    # The built-in archs are left to prepare: nothing is imported or built while the config loads.
    check_model_arch(config_from_dict({"model": {"arch": "resnet20"}}))


def test_sweeps_and_reproductions_check_model_arch_before_any_trial(package, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps({"data": {"dataset": "synthetic", "num_clients": 4, "synthetic_train_per_class": 5,
                                         "synthetic_test_per_class": 2},
                                "model": {"arch": "userfactories.nets:good"}, "train": {"rounds": 2}}))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({"base": str(base), "search": {"model.arch": {
        "choice": ["userfactories.nets:good", "userfactories.nets:not_a_module"]}}}))
    with pytest.raises(ConfigError, match="^model.arch: userfactories.nets:not_a_module.* returned a list, not"):
        load_sweep(sweep)
    base.write_text(base.read_text().replace("nets:good", "nets:raises"))
    with pytest.raises(ConfigError, match="^model.arch: userfactories.nets:raises"):
        build_spec("ablation", base, [0], rounds=2)


PLUGIN = '''
import numpy as np
import torch
from torch import nn
from fedrod_ray.data import RawImages, from_raw

def tiny(cfg, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (20, 1, 6, 6), dtype=np.uint8)
    y = np.arange(20) % 2
    return from_raw("tiny", RawImages(x, y, x[:6], y[:6], ("even", "odd")), cfg)

def flat(shape):
    return nn.Flatten()
'''


def test_plugins_through_entry_points(tmp_path, monkeypatch):
    """A distribution's entry_points.txt (what pip writes for [project.entry-points]) registers a dataset and a
    model; the config takes their names and ``fedrod-ray list`` shows them."""
    site = tmp_path / "site"
    (site / "demo_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "demo_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-plugin\n"
                                                               "Version: 0.1\n")
    (site / "demo_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[fedrod_ray.datasets]\ntiny = demo_plugin:tiny\n\n[fedrod_ray.models]\nflat = demo_plugin:flat\n")
    (site / "demo_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    try:
        rc, out, err = run_main(["list"])
        assert rc == 0, err
        lines = dict(line.split(": ", 1) for line in out.splitlines())
        assert lines["dataset plug-ins (data.dataset)"] == "tiny (demo_plugin:tiny)"
        assert lines["model plug-ins (model.arch)"] == "flat (demo_plugin:flat)"
        cfg = config_from_dict({"data": {"dataset": "tiny"}, "model": {"arch": "flat"}})
        ds = load_dataset(cfg.data, seed=0)
        assert ds.class_names == ["even", "odd"] and ds.image_shape == (1, 6, 6)
        model = build_model(cfg.model.arch, 2, ds.image_shape, None)
        assert model.feature_dim == 36
        with pytest.raises(ConfigError, match="data.dataset: 'tinny' is not one of .*did you mean tiny"):
            config_from_dict({"data": {"dataset": "tinny"}})
    finally:
        sys.modules.pop("demo_plugin", None)


def _png(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_serve_a_model_trained_with_a_user_factory(package, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (60, 8, 8), dtype=np.uint8)
    y = np.arange(60) % 3
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:15], y_test=y[:15],
             class_names=np.array(["red", "green", "blue"]), client_train=np.arange(60) % 4)
    config = tmp_path / "c.yaml"
    config.write_text(textwrap.dedent(f"""
        data: {{dataset: arrays, path: {tmp_path / 'd.npz'}, partition: natural, num_clients: 4}}
        model: {{arch: "userfactories.nets:good"}}
        train: {{head: hyper, rounds: 2, client_fraction: 1.0, local_epochs: 1, batch_size: 8}}
        runtime: {{torch_threads: 1}}
    """))
    threads = torch.get_num_threads()
    try:
        rc, _out, err = run_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, err
    meta = json.loads((tmp_path / "run" / "final" / "meta.json").read_text())
    assert meta["arch"] == "userfactories.nets:good" and meta["image_shape"] == [1, 8, 8]
    assert meta["class_names"] == ["red", "green", "blue"] and len(meta["mean"]) == 1

    # A factory is code the final/ names: served only when the operator allows it.
    with pytest.raises(ExportError, match="arch 'userfactories.nets:good' is not one this loader may build"):
        create_app(str(tmp_path / "run"))
    allowed = Settings(model_dir=str(tmp_path / "run"), allow_factories=["userfactories.nets:good"])
    with TestClient(create_app(allowed)) as client:
        info = client.get("/v1/model").json()
        assert info["arch"] == "userfactories.nets:good" and info["input"]["shape"] == [1, 8, 8]
        r = client.post("/v1/predict", json={"images_png": [_png(x[0]), _png(x[1])],
                                             "class_distribution": [0.5, 0.5, 0.0], "top_k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert {e["label"] for e in body["generic"]["top_k"][0]} == {"red", "green", "blue"}
        served = client.app.state.service.current.served
        with torch.no_grad():
            xs = (torch.from_numpy(x[:2]).float()[:, None] / 255 - meta["mean"][0]) / meta["std"][0]
            expected = served.model(xs).softmax(1)
        assert torch.allclose(torch.tensor(body["generic"]["probabilities"]), expected, atol=1e-5)

    # Without the factory's package, the service refuses the final/ and says what is missing.
    sys.path.remove(str(package))
    for name in [m for m in sys.modules if m.startswith("userfactories")]:
        del sys.modules[name]
    with pytest.raises(ExportError, match="final: model.arch: cannot import userfactories.nets"):
        load_final(str(tmp_path / "run"), allowed.allow_factories)
    with pytest.raises(ExportError, match="model.arch: cannot import userfactories.nets"):
        create_app(allowed)
