"""Typed configuration: YAML files, --set overrides and errors that name the field."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedrod_ray.config import (
    ConfigError,
    ExperimentConfig,
    check_resume,
    config_from_dict,
    config_from_record,
    dump_config,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_shipped_config_files_are_all_found():
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "synthetic_tiny.yaml", "mnist_paper.yaml",
                                         "fmnist_paper.yaml", "cifar10_paper.yaml", "cifar100_paper.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)
    # a dumped config loads back to the same thing
    assert load_config(path, []) == cfg
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg


def test_paper_config_values():
    cfg = load_config(Path(CONFIGS[0]).parent / "fmnist_paper.yaml")
    assert cfg.data.dataset == "fmnist"
    assert cfg.data.num_clients == 100
    assert cfg.train.client_fraction == 0.2
    assert cfg.train.weight_decay == 1e-5
    assert cfg.train.momentum == 0.9


@pytest.fixture(autouse=True)
def not_in_a_ray_job(monkeypatch):
    """runtime.mode auto resolves from RAY_ADDRESS: these tests expect it unset."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def resolved_defaults() -> ExperimentConfig:
    """The defaults as loading resolves them (runtime.mode auto -> local, away from Ray)."""
    cfg = ExperimentConfig()
    cfg.runtime.mode = "local"
    return cfg


def test_defaults():
    cfg = config_from_dict({})
    assert cfg == resolved_defaults()
    assert cfg.runtime.client_resources == {"num_cpus": 1.0}


def test_overrides():
    cfg = config_from_dict({"train": {"lr": 0.5}}, [
        "train.lr=0.1",
        "train.head=hyper",
        "data.dataset=cifar10",
        "seed=7",
        "train.augment=true",
        "runtime.client_resources={num_cpus: 2, num_gpus: 0.5}",
    ])
    assert cfg.train.lr == 0.1
    assert cfg.train.head == "hyper"
    assert cfg.data.dataset == "cifar10"
    assert cfg.seed == 7
    assert cfg.train.augment is True
    assert cfg.runtime.client_resources == {"num_cpus": 2.0, "num_gpus": 0.5}
    assert isinstance(cfg.runtime.client_resources["num_cpus"], float)


def test_nested_dict_dotted_override():
    cfg = config_from_dict({"runtime": {"client_resources": {"num_cpus": 1}}},
                           ["runtime.client_resources.num_gpus=0.25"])
    assert cfg.runtime.client_resources == {"num_cpus": 1.0, "num_gpus": 0.25}
    cfg = config_from_dict({}, ["runtime.client_resources.num_gpus=0.25"])
    assert cfg.runtime.client_resources["num_gpus"] == 0.25


def test_override_does_not_mutate_input():
    data = {"train": {"lr": 0.5}}
    config_from_dict(data, ["train.lr=0.1", "train.rounds=3"])
    assert data == {"train": {"lr": 0.5}}


def test_null_override_for_optional_field():
    cfg = config_from_dict({"train": {"augment": True}}, ["train.augment=null"])
    assert cfg.train.augment is None


def test_integer_for_float_field_is_accepted():
    cfg = config_from_dict({"train": {"lr": 1, "gamma": 0}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.gamma == 0.0 and isinstance(cfg.train.gamma, float)
    cfg = config_from_dict({}, ["train.momentum=0"])
    assert isinstance(cfg.train.momentum, float)


def test_scientific_notation_override():
    cfg = config_from_dict({}, ["train.lr=1e-3", "train.weight_decay=1e-05"])
    assert cfg.train.lr == 0.001
    assert cfg.train.weight_decay == 1e-5


def test_scientific_notation_with_dot_override():
    cfg = config_from_dict({}, ["train.weight_decay=1.0e-5"])
    assert cfg.train.weight_decay == 1e-5


@pytest.mark.parametrize(("data", "overrides", "field"), [
    ({"train": {"lrr": 0.1}}, [], "train.lrr"),
    ({}, ["train.lrr=0.1"], "train.lrr"),
    ({}, ["runtime.devices=2"], "runtime.devices"),
    ({"bogus": 1}, [], "bogus"),
])
def test_unknown_key_names_the_field(data, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict(data, overrides)


@pytest.mark.parametrize(("override", "field"), [
    ("train.lr=fast", "train.lr"),
    ("train.rounds=2.5", "train.rounds"),
    ("train.rounds=true", "train.rounds"),
    ("train.augment=maybe", "train.augment"),
    ("data.dataset=5", "data.dataset"),
    ("runtime.client_resources.num_cpus=lots", "runtime.client_resources.num_cpus"),
    ("runtime.client_resources=4", "runtime.client_resources"),
    ("train=5", "train"),
])
def test_wrong_type_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict({}, [override])


@pytest.mark.parametrize(("override", "field"), [
    ("train.head=deep", "train.head"),
    ("train.balanced_loss=focal", "train.balanced_loss"),
    ("data.dataset=imagenet", "data.dataset"),
    ("train.generic_rule=scaffold_v2", "train.generic_rule"),
    ("runtime.mode=slurm", "runtime.mode"),
    ("train.momentum_buffers=carry", "train.momentum_buffers"),
])
def test_bad_choice_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict({}, [override])


@pytest.mark.parametrize(("override", "field"), [
    ("train.lr=-0.1", "train.lr"),
    ("train.lr=0", "train.lr"),
    ("train.gamma=-1", "train.gamma"),
    ("train.momentum=-0.5", "train.momentum"),
    ("data.num_clients=0", "data.num_clients"),
    ("data.new_clients=-1", "data.new_clients"),
    ("train.client_fraction=1.5", "train.client_fraction"),
    ("runtime.client_resources.num_gpus=-1", "runtime.client_resources.num_gpus"),
    ("runtime.client_cache=-1", "runtime.client_cache"),
])
def test_out_of_range_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict({}, [override])


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.balanced_loss=ce", "train.gamma=1"], r"train\.gamma: has no effect with train\.balanced_loss=ce"),
    (["train.balanced_loss=reweight", "train.gamma=0.5"], r"train\.gamma: has no effect"),
    (["train.head=linear", "model.hyper_hidden=32"], r"model\.hyper_hidden: has no effect with train\.head=linear"),
    (["train.head=none", "model.hyper_hidden=16"], r"model\.hyper_hidden: has no effect"),
    (["train.generic_rule=fedavg", "train.rule_params.mu=0.1"], r"unknown config key train\.rule_params\.mu"),
    (["train.generic_rule=scaffold", "train.rule_params.alpha=0.1"], r"train\.rule_params\.alpha.*scaffold"),
    (["train.generic_rule=fedprox", "train.rule_params.alpha=0.1"], r"train\.rule_params\.alpha.*valid keys here: mu"),
    (["runtime.mode=local", "runtime.address=auto"], r"runtime\.address: has no effect with runtime\.mode=local"),
    (["runtime.mode=ray", "runtime.device=cuda"], r"runtime\.device: has no effect with runtime\.mode=ray"),
    (["runtime.mode=local", "runtime.coordinator_restarts=0"],
     r"runtime\.coordinator_restarts: has no effect with runtime\.mode=local"),
    (["runtime.mode=local", "runtime.max_restarts=5"], r"runtime\.max_restarts: has no effect with runtime\.mode=local"),
    (["train.momentum=0", "train.momentum_buffers=keep"],
     r"train\.momentum_buffers: keep has no effect with train\.momentum=0"),
    (["eval.estimate_size=100"], r"eval\.estimate_size: has no effect when every round is evaluated exactly"),
    (["eval.estimate_size=100", "eval.eval_every=5", "train.rounds=1"], r"eval\.estimate_size: has no effect"),
    (["data.num_clients=100", "runtime.client_cache=100"],
     r"runtime\.client_cache: has no effect with data\.num_clients=100 \(every client's state stays in memory\)"),
])
def test_a_setting_without_effect_is_an_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({}, overrides)


NATURAL = {"dataset": "arrays", "path": "x.npz", "partition": "natural"}


def test_a_null_override_restores_the_default():
    """``--set key=null`` takes a setting of a base config out: the key gets its default, whatever its type."""
    base = {"data": {"alpha": 0.3, "min_per_client": 5}, "train": {"lr": 0.5, "meta_bsm": {"meta_lr": 0.2}},
            "runtime": {"client_resources": {"num_cpus": 2, "num_gpus": 0.5}}}
    defaults = ExperimentConfig()
    cfg = config_from_dict(base, ["data.alpha=null", "train.lr=", "train.meta_bsm=null",
                                  "runtime.client_resources.num_gpus=null", "train.gamma=null", "eval.batch_size=null"])
    assert cfg.data.alpha == defaults.data.alpha and cfg.data.min_per_client == 5
    assert cfg.train.lr == defaults.train.lr and cfg.train.meta_bsm == defaults.train.meta_bsm
    assert cfg.runtime.client_resources == {"num_cpus": 2.0}
    assert base["data"] == {"alpha": 0.3, "min_per_client": 5}  # the base is left as it was
    # A key the base does not hold has nothing to take out; a key that names no setting is still an error.
    with pytest.raises(ConfigError, match=r"unknown config key data\.alhpa \(did you mean data\.alpha\?\)"):
        config_from_dict(base, ["data.alhpa=null"])
    with pytest.raises(ConfigError, match=r"unknown config key train\.meta_bsm\.lr; valid keys here: gamma_lr"):
        config_from_dict(base, ["train.meta_bsm.lr=null"])


def test_each_null_override_says_what_the_key_became():
    """The console names what ``--set key=null`` left: data.alpha=null is not "no alpha" but its default."""
    from fedrod_ray.config.overrides import defaults_taken

    overrides = ["data.alpha=null", "train.lr=0.5", "model.hyper_hidden=", "privacy=null",
                 "runtime.client_resources.num_gpus=null"]
    cfg = config_from_dict({"data": {"alpha": 0.3}, "model": {"hyper_hidden": 8}}, overrides)
    assert defaults_taken(cfg, overrides) == [
        "--set data.alpha=null: data.alpha takes its default, 0.1",
        "--set model.hyper_hidden=null: model.hyper_hidden takes its default, null",
        "--set privacy=null: privacy has its defaults",
        "--set runtime.client_resources.num_gpus=null: runtime.client_resources.num_gpus is taken out",
    ]


@pytest.mark.parametrize(("override", "message"), [
    ("rounds=3", r"^rounds: expected a mapping, got 3 \(rounds is a section; did you mean train\.rounds\?\)$"),
    ("eval=2", r"^eval: expected a mapping, got 2$"),  # no setting is called eval: no guess
])
def test_a_value_given_to_a_section_points_to_the_setting_of_that_name(override, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({}, [override])


def test_a_base_configs_setting_without_effect_is_taken_out_from_the_command_line():
    """The issue's case: quickstart.yaml sets data.alpha, which a natural partition does not use."""
    quickstart = Path(CONFIGS[0]).parent / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"^data\.alpha: has no effect .*; remove it, or --set data\.alpha=null$"):
        load_config(quickstart, ["data.partition=natural"])
    cfg = load_config(quickstart, ["data.partition=natural", "data.alpha=null"])
    assert cfg.data.partition == "natural" and cfg.data.alpha == ExperimentConfig().data.alpha


@pytest.mark.parametrize(("data", "overrides", "key"), [
    ({}, ["train.balanced_loss=ce", "train.gamma=1"], "train.gamma"),
    ({}, ["train.head=linear", "model.hyper_hidden=32"], "model.hyper_hidden"),
    ({}, ["train.meta_bsm.hidden=7"], "train.meta_bsm.hidden"),
    ({"data": NATURAL}, ["data.imbalance_ratio=10"], "data.imbalance_ratio"),
    ({}, ["data.partition=iid", "data.min_per_client=5"], "data.min_per_client"),
    ({}, ["data.path=x.npz"], "data.path"),
    ({}, ["eval.finetune_train=true"], "eval.finetune_train"),
    ({}, ["eval.finetune_epochs=2"], "eval.finetune_epochs"),
    ({}, ["eval.estimate_size=100"], "eval.estimate_size"),
    ({}, ["train.momentum=0", "train.momentum_buffers=keep"], "train.momentum_buffers"),
    ({}, ["runtime.mode=local", "runtime.address=auto"], "runtime.address"),
    ({}, ["runtime.mode=ray", "runtime.device=cuda"], "runtime.device"),
    ({}, ["runtime.mode=ray", "runtime.batched_clients=2"], "runtime.batched_clients"),
    ({}, ["train.balanced_loss=meta_bsm", "train.step=compiled"], "train.step"),
    ({}, ["tracking.mlflow_uri=http://mlflow:5000"], "tracking.mlflow_uri"),
])
def test_every_setting_without_effect_says_how_to_take_it_out(data, overrides, key):
    """Each "has no effect" error names --set <key>=null, and that override does take the setting out."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*has no effect .*; remove it, or "
                                          rf"--set {re.escape(key)}=null"):
        config_from_dict(data, overrides)
    config_from_dict(data, [*overrides, f"{key}=null"])


@pytest.mark.parametrize(("record", "key", "kept"), [
    # A record keeps every setting, defaults included, as the version that wrote it had them (up to b37490f,
    # train.meta_bsm.meta_lr defaulted to 1.0).
    ({"train": {"balanced_loss": "ce", "meta_bsm": {"meta_lr": 1.0, "meta_per_class": 10, "hidden": 100}}},
     "train.meta_bsm.meta_lr", None),
    ({"train": {"balanced_loss": "bsm", "meta_bsm": {"meta_lr": 0.5, "meta_per_class": 3, "hidden": 7}}},
     "train.meta_bsm.hidden", None),
    ({"data": {**NATURAL, "alpha": 0.7, "imbalance_ratio": 5}}, "data.alpha", None),
    # Where the setting had an effect, the record keeps what it ran with.
    ({"train": {"balanced_loss": "meta_bsm", "meta_bsm": {"meta_lr": 1.0, "meta_per_class": 10, "hidden": 100}}},
     "train.meta_bsm.meta_lr", 1.0),
    ({"data": {"alpha": 0.7}}, "data.alpha", 0.7),
])
def test_a_record_drops_the_settings_that_had_no_effect_in_it(record, key, kept):
    """A checkpoint's or a reproduction's config loads whatever its unused settings hold: they never had an
    effect, and a default changed since must not make an old run unreadable. A user's config with the same
    values is refused (a setting without effect), and the record itself is left as it was."""
    before = yaml.safe_dump(record)
    got = functools.reduce(getattr, key.split("."), config_from_record(record))
    assert got == (kept if kept is not None else functools.reduce(getattr, key.split("."), ExperimentConfig()))
    assert yaml.safe_dump(record) == before
    if kept is None:
        with pytest.raises(ConfigError, match=rf"{re.escape(key.rsplit('.', 1)[0])}\.\w+: has no effect"):
            config_from_dict(record)


def test_a_record_is_checked_like_a_users_config_for_everything_else():
    with pytest.raises(ConfigError, match=r"train\.lr: must be > 0"):
        config_from_record({"train": {"balanced_loss": "ce", "lr": -1, "meta_bsm": {"meta_lr": 1.0}}})
    with pytest.raises(ConfigError, match=r"unknown config key train\.gama"):
        config_from_record({"train": {"gama": 1}})


@pytest.mark.parametrize(("key", "replacement"), [
    ("train.algorithm=fedavg", "train.head"),
    ("train.variant=hyper", "train.head"),
    ("train.prox_mu=0.1", "train.rule_params.mu"),
    ("train.feddyn_alpha=0.1", "train.rule_params.alpha"),
])
def test_keys_of_earlier_versions_name_their_replacement(key, replacement):
    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} was replaced by {replacement}"):
        config_from_dict({}, [key])


def test_rule_params_are_typed_and_checked_by_the_rule():
    cfg = config_from_dict({}, ["train.generic_rule=fedprox", "train.rule_params.mu=1e-3"])
    assert cfg.train.rule_params == {"mu": 1e-3}
    assert config_from_dict({}, ["train.generic_rule=feddyn"]).train.rule_params == {"alpha": 0.01}  # the default
    for bad, msg in (("abc", "expected a number"), ("-1", "must be >= 0")):
        with pytest.raises(ConfigError, match=rf"train\.rule_params\.mu: {msg}"):
            config_from_dict({}, ["train.generic_rule=fedprox", f"train.rule_params.mu={bad}"])
    with pytest.raises(ConfigError, match=r"train\.rule_params\.alpha: must be > 0"):
        config_from_dict({}, ["train.generic_rule=feddyn", "train.rule_params.alpha=0"])


def test_losses_that_use_gamma_accept_it_and_hyper_hidden_defaults_to_the_paper():
    for loss in ("bsm", "ldam", "cdt"):
        assert config_from_dict({}, [f"train.balanced_loss={loss}", "train.gamma=0.5"]).train.gamma == 0.5
    assert config_from_dict({}, ["train.head=hyper"]).hyper_hidden == 16
    assert config_from_dict({}, ["train.head=hyper", "data.dataset=cifar10"]).hyper_hidden == 32
    assert config_from_dict({}, ["train.head=hyper", "model.hyper_hidden=8"]).hyper_hidden == 8


def test_resume_may_change_how_long_and_how_to_run_but_not_what_is_learned():
    saved = config_from_dict({}, ["train.rounds=10"])
    ok = config_from_dict({}, ["train.rounds=20", "eval.eval_every=5", "runtime.mode=ray", "name=other",
                               "data.data_dir=/elsewhere"])
    check_resume(saved, ok, rounds_done=10)
    for override, field in (("seed=1", "seed"), ("data.dataset=cifar10", "data.dataset"),
                            ("data.alpha=0.5", "data.alpha"), ("data.num_clients=50", "data.num_clients"),
                            ("train.generic_rule=scaffold", "train.generic_rule"), ("train.head=hyper", "train.head"),
                            ("train.lr=0.1", "train.lr")):
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: the checkpoint was trained with"):
            check_resume(saved, config_from_dict({}, ["train.rounds=10", override]), rounds_done=3)
    with pytest.raises(ConfigError, match=r"train\.rounds: the checkpoint has already completed 10 rounds"):
        check_resume(saved, config_from_dict({}, ["train.rounds=5"]), rounds_done=10)


def test_mode_auto_is_ray_where_ray_is(monkeypatch):
    """Inside a Ray job (whose driver always has RAY_ADDRESS) or given an address, the federation runs
    on Ray; elsewhere in this process. The resolved mode is what config.yaml records."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert config_from_dict({}).runtime.mode == "local"
    assert config_from_dict({}, ["runtime.address=auto"]).runtime.mode == "ray"
    assert config_from_dict({}, ["runtime.mode=ray"]).runtime.mode == "ray"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # what the job supervisor gives a job's driver
    assert config_from_dict({}).runtime.mode == "ray"
    assert config_from_dict({}, ["runtime.mode=local"]).runtime.mode == "local"
    assert "mode: ray" in dump_config(config_from_dict({}))
    # A dashboard address exported for `ray job submit` is not a cluster this process trains on.
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert config_from_dict({}).runtime.mode == "local"


def test_zero_allowed_where_non_negative():
    cfg = config_from_dict({}, ["train.gamma=0", "train.weight_decay=0", "data.new_clients=0"])
    assert cfg.train.gamma == 0.0


def test_malformed_override():
    with pytest.raises(ConfigError):
        config_from_dict({}, ["train.lr"])
    with pytest.raises(ConfigError):
        config_from_dict({}, ["=3"])
    with pytest.raises(ConfigError):
        config_from_dict({"seed": 0}, ["seed.x=1"])


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_load_config_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError):
        load_config(p)


def test_load_config_with_overrides_and_empty_file(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load_config(p) == resolved_defaults()
    p.write_text("train:\n  lr: 0.2\n")
    assert load_config(p, ["train.rounds=3"]).train.lr == 0.2
    assert load_config(p, ["train.rounds=3"]).train.rounds == 3
    assert load_config(None) == resolved_defaults()


def test_momentum_buffers_default_to_reset_and_keep_refuses_scaffold():
    """The paper does not say whether momentum buffers survive between a client's rounds: the default is
    reset (what every earlier version did). SCAFFOLD's control variate assumes buffers from zero."""
    assert config_from_dict({}).train.momentum_buffers == "reset"
    assert config_from_dict({}, ["train.momentum_buffers=keep"]).train.momentum_buffers == "keep"
    for rule in ("fedavg", "fedprox", "feddyn", "local"):
        config_from_dict({}, ["train.momentum_buffers=keep", f"train.generic_rule={rule}", "train.head=linear"])
    with pytest.raises(ConfigError, match=r"^train\.momentum_buffers: keep cannot be used with "
                                          r"train\.generic_rule=scaffold, whose control variate assumes"):
        config_from_dict({}, ["train.momentum_buffers=keep", "train.generic_rule=scaffold"])
    saved = config_from_dict({}, ["train.rounds=10"])
    with pytest.raises(ConfigError, match=r"^train\.momentum_buffers: the checkpoint was trained with 'reset'"):
        check_resume(saved, config_from_dict({}, ["train.rounds=10", "train.momentum_buffers=keep"]), rounds_done=3)


@pytest.mark.parametrize("overrides, field", [
    (["data.num_clients=10", "eval.clients=10"], "eval.clients"),
    (["train.rounds=5", "eval.eval_every=2", "eval.at_end=false", "eval.finetune_epochs=1", "data.new_clients=2"],
     "eval.finetune_epochs"),
])
def test_evaluation_settings_that_cannot_work_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, overrides)
    assert str(e.value).startswith(field), str(e.value)


def test_loading_a_config_imports_no_torch():
    code = ("import sys; from fedrod_ray.config import load_config; load_config('configs/quickstart.yaml'); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_config_lists_no_plug_in_name():
    """A plug-in's name is its spec's (fedrod_ray.specs): the config's modules may use one only as a field's
    default value."""
    from fedrod_ray.config.sections import MODES
    from fedrod_ray.specs.datasets import DATASETS, USER_DATASETS
    from fedrod_ray.specs.losses import LOSSES
    from fedrod_ray.specs.methods import HEADS
    from fedrod_ray.specs.models import ARCHS
    from fedrod_ray.specs.rules import RULES

    # Less the words that are also the config's own: runtime.mode's "local", "none" in its messages.
    names = {*DATASETS, *USER_DATASETS, *LOSSES, *HEADS, *ARCHS, *RULES} - {*MODES, "none"}
    found = []
    for path in sorted((REPO / "fedrod_ray" / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        defaults = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.AnnAssign) and node.value}
        found += [f"{path.name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in defaults]
    assert not found, found
