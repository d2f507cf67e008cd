"""The user's own data: an .npz of arrays (data.dataset: arrays), an image folder (folder), natural client
partitions from either, and each bad input's one clear error naming the field or the file."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedrod_ray.cli import main
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.data import DatasetFormatError, DatasetNotFoundError, load_dataset
from fedrod_ray.federation_state.setup import partition_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fedrod_example.data import write_folder


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def data_cfg(**data):
    return config_from_dict({"data": data}).data


def pixel_stats(x_nchw: np.ndarray):
    flat = x_nchw.transpose(1, 0, 2, 3).reshape(x_nchw.shape[1], -1).astype(np.float64) / 255
    return flat.mean(1), flat.std(1)


def save_npz(path: Path, rng, n_train=40, n_test=12, shape=(6, 5, 3), classes=3, **extra) -> dict:
    arrays = {"x_train": rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
              "y_train": rng.integers(0, classes, n_train), "x_test": rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
              "y_test": rng.integers(0, classes, n_test), **extra}
    np.savez(path, **arrays)
    return arrays


# --- arrays ---------------------------------------------------------------------------------------------


def test_arrays_nhwc_nchw_and_grey_layouts(tmp_path):
    rng = np.random.default_rng(0)
    nhwc = save_npz(tmp_path / "nhwc.npz", rng, class_names=np.array(["cat", "dog", "eel"]))
    nchw = {k: v.transpose(0, 3, 1, 2) if k.startswith("x_") else v for k, v in nhwc.items()}
    np.savez(tmp_path / "nchw.npz", **nchw)
    a = load_dataset(data_cfg(dataset="arrays", path=str(tmp_path / "nhwc.npz")))
    b = load_dataset(data_cfg(dataset="arrays", path=str(tmp_path / "nchw.npz")))
    for ds in (a, b):
        assert ds.image_shape == (3, 6, 5) and ds.train_x.dtype == torch.uint8
        assert torch.equal(ds.train_x, torch.from_numpy(nchw["x_train"]))
        assert torch.equal(ds.test_y, torch.from_numpy(nhwc["y_test"]))
        assert ds.class_names == ["cat", "dog", "eel"] and ds.num_classes == 3 and ds.train_clients is None
        mean, std = pixel_stats(nchw["x_train"])  # per channel, on the training images
        assert np.allclose(ds.mean, mean, atol=1e-6) and np.allclose(ds.std, std, atol=1e-6)
    grey = {k: v[..., 0] if k.startswith("x_") else v for k, v in nhwc.items() if k != "class_names"}
    np.savez(tmp_path / "grey.npz", **grey)
    g = load_dataset(data_cfg(dataset="arrays", path=str(tmp_path / "grey.npz"), normalize=False))
    assert g.image_shape == (1, 6, 5) and g.mean == (0.0,) and g.class_names == ["class_0", "class_1", "class_2"]


@pytest.mark.parametrize("change, words", [
    (lambda a: a.update(x_train=a["x_train"][:, :3, :, :]), "ambiguous"),  # 40 x 3 x 5 x 3
    (lambda a: a.update(x_train=a["x_train"].astype(np.float32)), "uint8"),
    (lambda a: a.pop("y_test"), "lacks y_test"),
    (lambda a: a.update(y_train=a["y_train"] + 5), "y_train: labels must lie in 0..2"),
    (lambda a: a.update(x_test=a["x_test"][:, :4]), "x_test's are"),
    (lambda a: a.update(client_test=np.zeros(12, np.int64)), "client_test names the clients of the test examples"),
    (lambda a: a.update(client_train=np.array([0, 2] * 20)), "client 1 has no examples"),
    (lambda a: a.update(client_train=np.zeros(39, np.int64)), "one client id per training image"),
])
def test_arrays_bad_inputs_name_the_file_and_array(tmp_path, change, words):
    arrays = save_npz(tmp_path / "ok.npz", np.random.default_rng(1), class_names=np.array(["a", "b", "c"]))
    change(arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetFormatError, match=words) as e:
        load_dataset(data_cfg(dataset="arrays", path=str(tmp_path / "bad.npz")))
    assert "bad.npz" in str(e.value)


def test_missing_path_names_data_path(tmp_path):
    for dataset in ("arrays", "folder"):
        with pytest.raises(DatasetNotFoundError, match=r"data\.path: .*nowhere"):
            load_dataset(data_cfg(dataset=dataset, path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="data.path: data.dataset=folder reads"):
        data_cfg(dataset="folder")
    with pytest.raises(ConfigError, match="data.path: has no effect with data.dataset=mnist"):
        data_cfg(dataset="mnist", path="x.npz")


# --- folder ---------------------------------------------------------------------------------------------


def write_png(path: Path, pixels: np.ndarray, mode: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, mode=mode).save(path)


def test_folder_decodes_every_pixel_with_class_names_from_folders(tmp_path):
    rng = np.random.default_rng(2)
    images = {}
    for split, n in (("train", 3), ("test", 2)):
        for cls in ("zebra", "ant"):
            for i in range(n):
                images[(split, cls, i)] = rng.integers(0, 256, (8, 6, 3), dtype=np.uint8)  # H x W x C
                write_png(tmp_path / split / cls / f"{i}.png", images[(split, cls, i)], "RGB")
    ds = load_dataset(data_cfg(dataset="folder", path=str(tmp_path)))
    assert ds.class_names == ["ant", "zebra"] and ds.image_shape == (3, 8, 6) and not ds.augment
    # Sorted by class, then file name.
    expected = np.stack([images[("train", c, i)] for c in ("ant", "zebra") for i in range(3)]).transpose(0, 3, 1, 2)
    assert torch.equal(ds.train_x, torch.from_numpy(expected)) and ds.train_y.tolist() == [0, 0, 0, 1, 1, 1]
    assert ds.test_y.tolist() == [0, 0, 1, 1] and ds.train_clients is None
    mean, std = pixel_stats(expected)
    assert np.allclose(ds.mean, mean, atol=1e-6) and np.allclose(ds.std, std, atol=1e-6)


def _mixed_size(root: Path) -> Path:
    bad = root / "train" / "b" / "1.png"
    write_png(bad, np.zeros((9, 8), np.uint8), "L")
    return bad


def _mixed_mode(root: Path) -> Path:
    bad = root / "test" / "a" / "9.png"
    write_png(bad, np.zeros((8, 8, 3), np.uint8), "RGB")
    return bad


def _empty_class(root: Path) -> Path:
    bad = root / "train" / "c"
    bad.mkdir()
    return bad


def _not_an_image(root: Path) -> Path:
    bad = root / "train" / "a" / "notes.txt"
    bad.write_text("x")
    return bad


def _empty_client(root: Path) -> Path:
    (root / "clients").mkdir()
    (root / "train").rename(root / "clients" / "full")
    bad = root / "clients" / "empty"
    bad.mkdir()
    return bad


def _client_test_set_beside_test(root: Path) -> Path:
    _empty_client(root).rmdir()
    write_png(root / "clients" / "full" / "test" / "a" / "0.png", np.full((8, 8), 7, np.uint8), "L")
    return root / "test"


@pytest.mark.parametrize("damage, words", [
    (_mixed_size, r"8x9 L, but .*0\.png \(the first image\) is 8x8 L"),
    (_mixed_mode, "8x8 RGB, but .* is 8x8 L"),
    (_empty_class, "empty class folder"),
    (_not_an_image, "not an image file"),
    (_client_test_set_beside_test, r"the clients have test sets of their own .* remove test/"),
    (_empty_client, r"no class folders \(and so no examples\)"),
])
def test_folder_bad_inputs_name_the_first_file_that_differs(tmp_path, damage, words):
    for split in ("train", "test"):
        for cls in ("a", "b"):
            write_png(tmp_path / split / cls / "0.png", np.full((8, 8), 7, np.uint8), "L")
    bad = damage(tmp_path)
    with pytest.raises(DatasetFormatError, match=words) as e:
        load_dataset(data_cfg(dataset="folder", path=str(tmp_path)))
    assert str(e.value).startswith(str(bad))


# --- natural partitions -----------------------------------------------------------------------------------


def test_natural_clients_from_a_folder_keep_exactly_their_examples(tmp_path):
    root = write_folder(tmp_path / "d", clients=6, classes=4, size=8, per_client=12, test_per_class=3)
    cfg = config_from_dict({"seed": 3, "data": {"dataset": "folder", "path": str(root), "partition": "natural",
                                                "num_clients": 5, "new_clients": 1}})
    ds = load_dataset(cfg.data)
    part = partition_dataset(cfg, ds)
    assert sorted(part.client_names) == [f"client_{k:02d}" for k in range(6)] and part.num_train_clients == 5
    for m, name in enumerate(part.client_names):
        folder = root / "clients" / name
        expected = sorted(folder.rglob("*.png"))
        assert len(part.client_indices[m]) == len(expected)
        # The very images of its folder, with their classes.
        k = ds.client_names.index(name)
        assert np.array_equal(part.client_indices[m], np.flatnonzero(ds.train_clients == k))
        counts = {c: len(list((folder / c).glob("*.png"))) for c in ds.class_names if (folder / c).is_dir()}
        assert {ds.class_names[c]: int(n) for c, n in enumerate(part.counts[m]) if n} == counts
    # The held-out client is a whole natural client, chosen by the seed.
    assert len(part.new_client_ids) == 1
    assert sum(len(i) for i in part.client_indices) == len(ds.train_y)


def test_natural_clients_from_an_npz_with_string_ids(tmp_path):
    owners = np.array(["shop_b", "shop_a", "shop_c", "shop_a"] * 10)
    save_npz(tmp_path / "n.npz", np.random.default_rng(4), client_train=owners)
    cfg = config_from_dict({"data": {"dataset": "arrays", "path": str(tmp_path / "n.npz"), "partition": "natural",
                                     "num_clients": 3}})
    part = partition_dataset(cfg, load_dataset(cfg.data))
    by_name = dict(zip(part.client_names, part.client_indices))
    for name in ("shop_a", "shop_b", "shop_c"):
        assert np.array_equal(by_name[name], np.flatnonzero(owners == name))


@pytest.mark.parametrize("data, words", [
    ({"alpha": 0.5}, "data.alpha: has no effect with data.partition=natural"),
    ({"imbalance_ratio": 10}, "data.imbalance_ratio: has no effect"),
    ({"min_per_client": 5}, "data.min_per_client: has no effect"),
])
def test_settings_without_effect_on_natural_partitions_are_errors(data, words):
    with pytest.raises(ConfigError, match=words):
        config_from_dict({"data": {"dataset": "arrays", "path": "x.npz", "partition": "natural", **data}})
    with pytest.raises(ConfigError, match="train.balanced_loss: meta_bsm"):
        config_from_dict({"data": {"partition": "natural"}, "train": {"balanced_loss": "meta_bsm"}})


def test_natural_partition_needs_clients_and_their_number(tmp_path):
    save_npz(tmp_path / "plain.npz", np.random.default_rng(5))
    cfg = config_from_dict({"data": {"dataset": "arrays", "path": str(tmp_path / "plain.npz"),
                                     "partition": "natural"}})
    with pytest.raises(ConfigError, match="data.partition: natural needs data that names its clients"):
        partition_dataset(cfg, load_dataset(cfg.data))
    save_npz(tmp_path / "n.npz", np.random.default_rng(5), client_train=np.arange(40) % 4)
    cfg = config_from_dict({"data": {"dataset": "arrays", "path": str(tmp_path / "n.npz"), "partition": "natural",
                                     "num_clients": 4, "new_clients": 1}})
    with pytest.raises(ConfigError, match=r"data.num_clients: the data holds 4 natural clients, .* not 4 \+ 1"):
        partition_dataset(cfg, load_dataset(cfg.data))


def test_partition_command_and_training_on_natural_clients_with_resume(tmp_path):
    root = write_folder(tmp_path / "d", clients=4, classes=3, size=8, per_client=10, test_per_class=4)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({
        "name": "natural", "data": {"dataset": "folder", "path": str(root), "partition": "natural",
                                    "num_clients": 3, "new_clients": 1},
        # The example's factory (examples/ is on sys.path).
        "model": {"arch": "fedrod_example.model:small_cnn"},
        "train": {"head": "linear", "rounds": 2, "client_fraction": 1.0, "local_epochs": 1, "batch_size": 10},
        "runtime": {"torch_threads": 1}}))
    threads = torch.get_num_threads()
    try:
        rc, out, err = run_main(["partition", "--config", str(config)])
        assert rc == 0, err
        assert "name" in out.splitlines()[0] and "client_03" in out and "clients: 4 (3 train, 1 new)" in out
        run = tmp_path / "run"
        rc, out, err = run_main(["train", "--config", str(config), "--run-dir", str(run)])
        assert rc == 0, err
        # The data moved (a cluster job's upload lands elsewhere each time): data.path may change on resume.
        root.rename(tmp_path / "moved")
        rc, out, err = run_main(["train", "--resume", str(run), "--set", "train.rounds=3",
                                 "--set", f"data.path={tmp_path / 'moved'}"])
        assert rc == 0, err
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3] and "pfl_gm_new" in records[-1]
    meta = json.loads((run / "final" / "meta.json").read_text())
    assert meta["dataset"] == "folder" and meta["class_names"] == ["class_a", "class_b", "class_c"]
    assert meta["image_shape"] == [1, 8, 8] and meta["round"] == 3
    # Every natural client, training and held out, keeps its phi_m under its id.
    heads = sorted(json.loads((run / "final" / "meta.json").read_text())["files"])
    assert heads == ["model.safetensors", "personal.safetensors"]


@pytest.mark.parametrize(("size", "arch", "message"), [
    (8, "mnist_cnn", "model.arch: mnist_cnn takes images of at least 16 x 16, not 8 x 8"),
    (6, "auto", "model.arch: auto has no built-in ConvNet for 6 x 6 images"),
])
def test_an_arch_that_cannot_take_the_images_is_refused_before_training(tmp_path, size, arch, message):
    root = write_folder(tmp_path / "d", clients=2, classes=2, size=size, per_client=4, test_per_class=1,
                        natural=False)
    (tmp_path / "empty.yaml").write_text("{}")
    rc, _out, err = run_main(["train", "--config", str(tmp_path / "empty.yaml"), "--run-dir", str(tmp_path / "run"),
                             "--set", "data.dataset=folder", "--set", f"data.path={root}", "--set",
                             f"model.arch={arch}"])
    assert rc == 2 and err.startswith(f"fedrod-ray: error: {message}"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_auto_fits_a_folder_of_16x16_rgb_images(tmp_path):
    """The built-in ConvNets size their first FC layer from the image: auto trains on a size the paper never
    used, and the served model is rebuilt for it."""
    root = write_folder(tmp_path / "d", clients=2, classes=3, size=16, per_client=6, test_per_class=2,
                        mode="RGB", natural=False)
    (tmp_path / "empty.yaml").write_text("{}")
    run = tmp_path / "run"
    rc, _out, err = run_main(["train", "--config", str(tmp_path / "empty.yaml"), "--run-dir", str(run),
                             "--set", "data.dataset=folder", "--set", f"data.path={root}",
                             "--set", "data.num_clients=2", "--set", "data.partition=iid",
                             "--set", "data.alpha=null", "--set", "train.rounds=1", "--set", "train.local_epochs=1",
                             "--set", "train.client_fraction=1.0", "--set", "train.batch_size=8"])
    assert rc == 0, err
    meta = json.loads((run / "final" / "meta.json").read_text())
    assert meta["arch"] == "mnist_cnn" and meta["image_shape"] == [3, 16, 16]
    from fedrod_ray.models.export import load_final
    from fedrod_ray.outputs.storage import RunStorage

    served = load_final(RunStorage(str(run)))
    assert served.model.body[-2].in_features == 64  # one 1 x 1 map of 64 channels


def test_bad_data_is_one_line_on_the_command_line(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "test").mkdir()
    (tmp_path / "empty.yaml").write_text("{}")
    rc, _out, err = run_main(["partition", "--config", str(tmp_path / "empty.yaml"), "--set", "data.dataset=folder",
                             "--set", f"data.path={tmp_path}"])
    assert rc == 2 and err.strip() == f"fedrod-ray: error: {tmp_path / 'train' / 'a'}: empty class folder (no " \
                                      ".png/.jpg/.jpeg images)"
