"""final/: the served model's save/load round trip, its version id, and what a bad final/ is rejected for."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from fedrod_ray.data.classes import CLASS_NAMES, class_names
from fedrod_ray.models import build_model
from fedrod_ray.models.export import FORMAT_VERSION, ExportError, ModelMeta, load_final, save_final
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]


def _source(variant, seed=1):
    model = build_model("mnist_cnn", 10, (1, 28, 28), variant, 16, seed)
    if variant == "hyper":
        # The hypernetwork's output layer starts at zero, which would make every generated head 0.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            out = model.hypernet.net[2].weight
            out.copy_(torch.randn(out.shape, generator=g) * 0.1)
    model.eval()
    weights = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("personal_head.")}
    return model, weights


def _heads(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {cid: torch.randn(10, 50, generator=g) for cid in range(n)}


def _meta(head, **changes):
    meta = ModelMeta(dataset="mnist", class_names=[str(i) for i in range(10)], image_shape=[1, 28, 28],
                     mean=[0.1307], std=[0.3081], arch="mnist_cnn", head=head, hyper_hidden=16, rule="fedavg",
                     balanced_loss="bsm", round=5, metrics={"gfl_gm": 0.5, "pfl_pm": 0.75})
    for k, v in changes.items():
        setattr(meta, k, v)
    return meta


def _save(run, head, seed=1, **meta_changes):
    _, weights = _source(None if head == "none" else head, seed)
    heads = _heads() if head == "linear" else None
    return save_final(RunStorage(str(run)), _meta(head, **meta_changes), weights, heads)


def _version_id(doc):
    """By hand: sha256 of the canonical JSON of everything but version_id, first 16 hex digits."""
    rest = {k: v for k, v in doc.items() if k != "version_id"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _edit_meta(run, change, keep_id=False):
    meta_path = run / "final" / "meta.json"
    doc = json.loads(meta_path.read_text())
    change(doc)
    if not keep_id:
        doc["version_id"] = _version_id(doc)
    meta_path.write_text(json.dumps(doc))


def _rewrite(run, name, data):
    """Replace a final/ file and update meta.json's hash and version id, as a consistent writer would."""
    (run / "final" / name).write_bytes(data)
    _edit_meta(run, lambda doc: doc["files"].update({name: hashlib.sha256(data).hexdigest()}))


# --- round trip ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["none", "linear", "hyper"])
def test_round_trip(tmp_path, head):
    source, weights = _source(None if head == "none" else head)
    heads = _heads() if head == "linear" else None
    meta = _meta(head)
    vid = save_final(RunStorage(str(tmp_path)), meta, weights, heads)

    expected = {"model.safetensors", "meta.json"} | ({"personal.safetensors"} if head == "linear" else set())
    assert {p.name for p in (tmp_path / "final").iterdir()} == expected  # no temp files left behind

    served = load_final(str(tmp_path))
    assert served.version_id == vid and len(vid) == 16
    assert served.meta == meta and served.meta.num_classes == 10
    assert not served.model.training
    state = served.model.state_dict()
    assert {k for k in state if not k.startswith("personal_head.")} == set(weights)
    for k, v in weights.items():
        assert torch.equal(state[k], v), k

    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(served.model(x), source(x))
    if head == "linear":
        assert set(served.personal_heads) == {0, 1, 2}
        for cid, t in heads.items():
            assert torch.equal(served.personal_head(cid), t)
        assert torch.count_nonzero(served.model.personal_head.weight) == 0
        with pytest.raises(KeyError, match="7"):
            served.personal_head(7)
    else:
        assert served.personal_heads == {}


def test_meta_json_contents_and_write_order(tmp_path):
    written = []

    class Recording(RunStorage):
        def write_bytes(self, rel, data):
            written.append(rel)
            super().write_bytes(rel, data)

    _, weights = _source("linear")
    vid = save_final(Recording(str(tmp_path)), _meta("linear"), weights, _heads())
    assert written == ["final/model.safetensors", "final/personal.safetensors", "final/meta.json"]

    doc = json.loads((tmp_path / "final" / "meta.json").read_text())
    assert doc["format"] == "fedrod-ray/final" and doc["format_version"] == 1 == FORMAT_VERSION
    assert doc["num_classes"] == 10 and doc["head"] == "linear" and doc["round"] == 5
    assert doc["files"] == {name: hashlib.sha256((tmp_path / "final" / name).read_bytes()).hexdigest()
                            for name in ("model.safetensors", "personal.safetensors")}
    assert doc["version_id"] == vid == _version_id(doc)
    # The loader accepts the storage object as well as a path.
    assert load_final(RunStorage(str(tmp_path))).version_id == vid


# --- the hypernetwork's zero-shot head ------------------------------------------------------------------


def test_zero_shot_head(tmp_path):
    source, weights = _source("hyper")
    save_final(RunStorage(str(tmp_path)), _meta("hyper"), weights)
    served = load_final(str(tmp_path))
    a = torch.zeros(10)
    a[3] = 1.0
    head = served.zero_shot_head(a)
    assert head.shape == (10, 50)
    # One-hot a picks column 3 of the first layer: H(e_3) = W2 relu(W1[:, 3]), reshaped to (C, feature_dim).
    w1, w2 = weights["hypernet.net.0.weight"], weights["hypernet.net.2.weight"]
    assert torch.allclose(head, (w2 @ torch.relu(w1[:, 3])).view(10, 50), atol=1e-6)
    with torch.no_grad():
        assert torch.equal(head, source.hypernet(a).view(10, 50))
    assert torch.count_nonzero(head) > 0
    with pytest.raises(ValueError):
        served.zero_shot_head(torch.ones(9) / 9)


@pytest.mark.parametrize("head", ["none", "linear"])
def test_zero_shot_head_needs_hyper(tmp_path, head):
    _save(tmp_path, head)
    with pytest.raises(ValueError, match="hyper"):
        load_final(str(tmp_path)).zero_shot_head(torch.ones(10) / 10)


# --- version id -------------------------------------------------------------------------------------------


def test_version_id_is_a_function_of_the_content(tmp_path):
    a, b = _save(tmp_path / "a", "hyper"), _save(tmp_path / "b", "hyper")
    assert a == b
    assert (tmp_path / "a/final/meta.json").read_bytes() == (tmp_path / "b/final/meta.json").read_bytes()

    _, weights = _source("hyper")
    weights["generic_head.weight"] = weights["generic_head.weight"].clone()
    weights["generic_head.weight"][0, 0] += 1.0
    changed = save_final(RunStorage(str(tmp_path / "c")), _meta("hyper"), weights)
    assert changed != a
    assert _save(tmp_path / "d", "hyper", round=6) != a


# --- a bad final/ is an ExportError -----------------------------------------------------------------------


def test_missing_final(tmp_path):
    with pytest.raises(ExportError, match="meta.json"):
        load_final(str(tmp_path / "no-such-run"))
    (tmp_path / "run" / "final").mkdir(parents=True)
    with pytest.raises(ExportError, match="meta.json"):
        load_final(str(tmp_path / "run"))


def test_truncated_model_file(tmp_path):
    _save(tmp_path, "none")
    path = tmp_path / "final" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ExportError, match="model.safetensors"):
        load_final(str(tmp_path))


def test_model_file_from_another_save(tmp_path):
    _save(tmp_path / "a", "none", seed=1)
    _save(tmp_path / "b", "none", seed=2)
    load_final(str(tmp_path / "a"))
    shutil.copy(tmp_path / "b/final/model.safetensors", tmp_path / "a/final/model.safetensors")
    with pytest.raises(ExportError, match="sha256"):
        load_final(str(tmp_path / "a"))


def test_meta_not_json(tmp_path):
    _save(tmp_path, "none")
    (tmp_path / "final" / "meta.json").write_bytes(b"{not json\xff")
    with pytest.raises(ExportError, match="JSON"):
        load_final(str(tmp_path))


def test_other_format_version(tmp_path):
    _save(tmp_path, "none")
    _edit_meta(tmp_path, lambda doc: doc.update(format_version=99))
    with pytest.raises(ExportError) as err:
        load_final(str(tmp_path))
    assert "99" in str(err.value) and "format_version 1" in str(err.value)


def test_meta_edited_by_hand(tmp_path):
    _save(tmp_path, "none")
    _edit_meta(tmp_path, lambda doc: doc["metrics"].update(gfl_gm=0.99), keep_id=True)
    with pytest.raises(ExportError, match="version_id"):
        load_final(str(tmp_path))


def test_meta_field_of_wrong_type(tmp_path):
    _save(tmp_path, "none")
    _edit_meta(tmp_path, lambda doc: None)
    load_final(str(tmp_path))  # the edit itself leaves a valid final/
    _edit_meta(tmp_path, lambda doc: doc.update(round="5"))
    with pytest.raises(ExportError, match="round"):
        load_final(str(tmp_path))
    _edit_meta(tmp_path, lambda doc: doc.update(round=5, num_classes=9))
    with pytest.raises(ExportError, match="num_classes"):
        load_final(str(tmp_path))


def test_weight_keys_must_match_the_model(tmp_path):
    _save(tmp_path, "hyper")
    _, weights = _source("hyper")
    tensors = {k: v.contiguous() for k, v in weights.items()}
    _rewrite(tmp_path, "model.safetensors", st_save(tensors))
    load_final(str(tmp_path))  # the rewrite itself leaves a valid final/

    extra = torch.zeros(2)
    _rewrite(tmp_path, "model.safetensors", st_save({**tensors, "extra.weight": extra}))
    with pytest.raises(ExportError, match="extra.weight"):
        load_final(str(tmp_path))
    missing = {k: v for k, v in tensors.items() if k != "hypernet.net.0.weight"}
    _rewrite(tmp_path, "model.safetensors", st_save(missing))
    with pytest.raises(ExportError, match="hypernet.net.0.weight"):
        load_final(str(tmp_path))
    _rewrite(tmp_path, "model.safetensors", b"junk, not safetensors")
    with pytest.raises(ExportError, match="safetensors"):
        load_final(str(tmp_path))
    # save_final checks the same, so a bad final/ is never written in the first place.
    with pytest.raises(ExportError, match="extra.weight"):
        save_final(RunStorage(str(tmp_path / "other")), _meta("hyper"), {**weights, "extra.weight": extra})
    assert not (tmp_path / "other").exists()


def test_personal_head_shape(tmp_path):
    _save(tmp_path, "linear")
    heads = {str(cid): t for cid, t in _heads().items()}
    _rewrite(tmp_path, "personal.safetensors", st_save(heads))
    assert set(load_final(str(tmp_path)).personal_heads) == {0, 1, 2}

    _rewrite(tmp_path, "personal.safetensors", st_save({**heads, "2": torch.zeros(10, 49)}))
    with pytest.raises(ExportError, match="client 2"):
        load_final(str(tmp_path))
    _, weights = _source("linear")
    other = RunStorage(str(tmp_path / "other"))
    with pytest.raises(ExportError, match="client 2"):
        save_final(other, _meta("linear"), weights, {**_heads(), 2: torch.zeros(10, 49)})
    with pytest.raises(ValueError, match="linear"):
        save_final(other, _meta("linear"), weights)  # the heads left out


@pytest.mark.slow
def test_export_imports_neither_ray_nor_training_code():
    check = ("import sys, fedrod_ray.models.export; bad=[m for m in sys.modules if m=='ray' "
             "or m.startswith('ray.') or m in ('fedrod_ray.client_update.local',"
             "'fedrod_ray.round_loop.federation','fedrod_ray.clients.client',"
             "'fedrod_ray.lifecycle.coordinator')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True)
    # Stricter: nothing of fedrod_ray beyond the package itself, export, models, storage, config and specs (the
    # torch-free bottom layer, where models find model.init's choices).
    strict = ("import sys, fedrod_ray.models.export; "
              "ok=('fedrod_ray','fedrod_ray.models.export','fedrod_ray.outputs',"
              "'fedrod_ray.outputs.storage'); "
              "bad=[m for m in sys.modules if m.startswith('fedrod_ray') and m not in ok "
              "and not m.startswith(('fedrod_ray.models', 'fedrod_ray.config', 'fedrod_ray.specs'))]; "
              "assert not bad, bad")
    subprocess.run([sys.executable, "-c", strict], cwd=REPO, check=True)


# --- class names ------------------------------------------------------------------------------------------


def test_class_names():
    assert class_names("mnist", 10) == ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    assert class_names("emnist", 10) == class_names("mnist", 10)
    fmnist = class_names("fmnist", 10)
    assert len(fmnist) == 10 and fmnist[0] == "T-shirt/top" and fmnist[9] == "Ankle boot"
    cifar10 = class_names("cifar10", 10)
    assert len(cifar10) == 10 and (cifar10[0], cifar10[3], cifar10[9]) == ("airplane", "cat", "truck")
    cifar100 = class_names("cifar100", 100)
    assert len(cifar100) == 100 == len(set(cifar100))
    assert cifar100[0] == "apple" and cifar100[3] == "bear" and cifar100[-1] == "worm"
    assert cifar100[44:48] == ["lizard", "lobster", "man", "maple_tree"]
    assert cifar100 == sorted(cifar100)  # the official fine-label order is alphabetical
    assert class_names("synthetic", 10) == [f"class_{i}" for i in range(10)]
    assert class_names("unknown", 3) == ["class_0", "class_1", "class_2"]
    assert set(CLASS_NAMES) == {"mnist", "emnist", "fmnist", "cifar10", "cifar100"}
    with pytest.raises(ValueError, match="cifar10"):
        class_names("cifar10", 100)
