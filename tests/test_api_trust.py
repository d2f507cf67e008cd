"""The trust boundary around a model directory (issue 33), in-process: a final/ names code by its arch, so
loading one imports only what the server's operator allowed, and nothing raised while loading takes the
server down; a final/ whose predictions would not be finite is refused. tests/test_api_limits.py makes the
same probes over real uvicorn and Ray Serve."""

from __future__ import annotations

import sys

import pytest
import torch
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_api.settings import Settings
from served import MARKER_ENV, edit_meta, make_final, marking_package

from fedrod_ray.models.export import ExportError, load_final, save_final
from fedrod_ray.outputs.storage import RunStorage

TOKEN = "trust-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
COUNTS = {"class_counts": [1] * 10}
# What a crafted meta.json's arch may name: Python's own callables, and a package on the server's path whose
# import and factories write a marker file.
CRAFTED = ["builtins:print", "sys:exit", "os:system", "fedrodmarker:net", "fedrodmarker:exits",
           "fedrodmarker:interrupts"]


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """The marker file the package ``fedrodmarker`` (importable here) writes when any of it runs."""
    monkeypatch.syspath_prepend(str(marking_package(tmp_path)))
    path = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(path))
    yield path
    sys.modules.pop("fedrodmarker", None)


def _client(run, **settings) -> TestClient:
    return TestClient(create_app(Settings(model_dir=str(run), **settings), admin_token=TOKEN))


def _reload(client, run):
    return client.post("/v1/admin/reload", headers=ADMIN, json={"model_dir": str(run)})


def _still_serving(client, version: str) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["model_version"] == version
    assert client.post("/v1/heads", json=COUNTS).status_code == 200


@pytest.mark.parametrize("arch", CRAFTED)
def test_a_crafted_arch_is_refused_before_anything_runs(tmp_path, marker, arch):
    version = make_final(tmp_path / "run", "hyper")
    crafted = tmp_path / "crafted"
    make_final(crafted, "hyper")
    edit_meta(crafted, arch=arch)  # its hashes and version_id recomputed: only the arch check is left
    with _client(tmp_path / "run") as client:
        r = _reload(client, crafted)
        assert r.status_code == 409 and r.json()["field"] == "model_dir", r.text
        assert f"arch '{arch}' is not one this loader may build" in r.json()["detail"]
        assert f"still serving version {version}" in r.json()["detail"]
        _still_serving(client, version)
    with pytest.raises(ExportError, match=f"arch '{arch}' is not one"):
        create_app(str(crafted))
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize("arch,raised", [("fedrodmarker:exits", "SystemExit"),
                                         ("fedrodmarker:interrupts", "KeyboardInterrupt")])
def test_an_allowed_factory_that_raises_cannot_take_the_server_down(tmp_path, marker, arch, raised):
    version = make_final(tmp_path / "run", "hyper")
    crafted = tmp_path / "crafted"
    make_final(crafted, "hyper")
    edit_meta(crafted, arch=arch)
    with _client(tmp_path / "run", allow_factories=[arch]) as client:
        r = _reload(client, crafted)
        assert r.status_code == 409 and r.json()["field"] == "model_dir", r.text
        assert f"raised {raised}" in r.json()["detail"]
        _still_serving(client, version)
    assert marker.read_text().split() == ["imported", arch.split(":")[1]]  # allowed, so it did run


def test_a_factory_is_allowed_by_its_exact_path(tmp_path):
    make_final(tmp_path, "none")
    edit_meta(tmp_path, arch="fedrodmarker:net")
    for allowed in ([], ["fedrodmarker:exits"], ["fedrodmarker:net.x"]):
        with pytest.raises(ExportError, match="arch 'fedrodmarker:net' is not one"):
            load_final(str(tmp_path), allowed)
    with pytest.raises(ValueError, match="allow_factories"):
        Settings(model_dir=str(tmp_path), allow_factories=["fedrodmarker"])


def _std(value):
    return lambda run: edit_meta(run, std=[value])


def _scaled(prefix, factor=1e30):
    """Every weight under ``prefix`` times ``factor``: still finite, and saved as a consistent final/."""
    def damage(run):
        served = load_final(str(run))
        weights = {k: v * factor if k.startswith(prefix) else v for k, v in served.model.state_dict().items()}
        save_final(RunStorage(str(run)), served.meta, weights)
    return damage


@pytest.mark.parametrize("damage,words", [
    (_std(0.0), "std is [0.0]"), (_std(float("nan")), "std is [nan]"), (_std(-0.3), "std is [-0.3]"),
    (lambda run: edit_meta(run, mean=[float("inf")]), "mean is [inf]"),
    (_scaled(""), "the generic head gives non-finite logits"),
    (_scaled("hypernet."), "the hypernetwork's head for the uniform distribution gives non-finite logits"),
], ids=["std-0", "std-nan", "std-negative", "mean-inf", "weights-1e30", "hypernet-1e30"])
def test_a_model_whose_predictions_would_not_be_finite_is_refused(tmp_path, damage, words):
    version = make_final(tmp_path / "run", "hyper")
    bad = tmp_path / "bad"
    make_final(bad, "hyper")
    damage(bad)
    assert all(torch.isfinite(t).all() for t in load_final(str(bad)).model.state_dict().values())
    with _client(tmp_path / "run") as client:
        r = _reload(client, bad)
        assert r.status_code == 409 and r.json()["field"] == "model_dir", r.text
        assert words in r.json()["detail"]
        _still_serving(client, version)
    with pytest.raises(ExportError, match="non-finite|std|mean"):
        create_app(str(bad))
