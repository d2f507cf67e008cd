"""``fedrod-ray``: train a federation, inspect a partition, list what can be configured, print the config's
JSON Schema, and the commands that optional parts register (``serve``, from api/)."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

from . import __version__
from .config import ConfigError, check_resume, config_from_dict, config_schema, load_config
from .config.overrides import defaults_taken
from .config.sections import LOGGERS
from .drivers.threads import passive_if_busy
from .specs.datasets import DATASETS

COMMANDS = "fedrod_ray.commands"  # entry-point group: callables that add a subcommand to the parser


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML experiment config (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=0.05 (repeatable)")
    p.add_argument("--data-dir", help="dataset directory (default: $FEDROD_DATA_DIR, then the user cache dir)")


def _plain_text(doc: str) -> str:
    """A docstring as a terminal shows it: without reST's ``literal`` markup."""
    return re.sub(r"``([^`]+)``", r"\1", doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedrod-ray", description=_plain_text(__doc__))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run federated training")
    _add_config_args(train, required=False)
    train.add_argument("--run-dir", help="where metrics, checkpoints and the final model go (default runs/<name>)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    train.add_argument("--mode", choices=["local", "ray"], help="in-process or on Ray (default: runtime.mode)")
    train.add_argument("--address", help="Ray cluster address ('auto' or ray://host:port); implies --mode ray")
    add_logger_argument(train)

    part = sub.add_parser("partition", help="print the clients' class counts for a config")
    _add_config_args(part)

    sub.add_parser("list", help="list the datasets, partitions, feature extractors (with plug-ins), heads, "
                                "generic rules and balanced losses")
    sub.add_parser("schema", help="print the JSON Schema of an experiment config (fedrod_ray/config.schema.json)")

    # Commands of the optional parts (``fedrod-ray serve`` from api/), registered through an entry point:
    # the library never imports them by name.
    for command in sorted(entry_points(group=COMMANDS), key=lambda ep: ep.name):
        command.load()(sub)
    return parser


def _overrides(args) -> list[str]:
    extra = list(args.set)
    if args.data_dir:
        extra.append(f"data.data_dir={args.data_dir}")
    if getattr(args, "mode", None):
        extra.append(f"runtime.mode={args.mode}")
    if getattr(args, "address", None):
        extra += ["runtime.mode=ray", f"runtime.address={args.address}"]
    return extra + logger_overrides(args)


def logger_overrides(args) -> list[str]:
    """``--logger tensorboard --logger mlflow`` as the config key ``tracking.loggers``."""
    return [f"tracking.loggers=[{', '.join(args.logger)}]"] if getattr(args, "logger", None) else []


def add_logger_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logger", action="append", choices=LOGGERS, metavar="{" + ",".join(LOGGERS) + "}",
                   help="log every round's metrics, the config and the final model to this experiment "
                        "tracker (repeat for several; tracking.loggers; needs pip install -e '.[tracking]')")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``ray job stop``, Kubernetes, a batch scheduler): the run stops as Ctrl-C stops it."""


def _resume_hint(storage) -> str:
    from .federation_state.checkpoint import latest_checkpoint_name

    if latest_checkpoint_name(storage) is None:
        return "no round was checkpointed yet: start it again with the same command"
    return f"continue it with: fedrod-ray train --resume {storage.uri}"


@contextlib.contextmanager
def _stop_on_sigterm(storage):
    """SIGTERM raises Terminated while the run lasts (from the main thread: signals go nowhere else). Yields
    a list that holds the signal once it came: Ray's calls may turn the exception into a plain
    KeyboardInterrupt on its way out."""
    received: list[int] = []

    def stop(signum, frame):
        # Said at once, not after unwinding: a Ray job's supervisor follows SIGTERM with SIGKILL in seconds.
        print(f"fedrod-ray: stopped by SIGTERM; {_resume_hint(storage)}", file=sys.stderr, flush=True)
        received.append(signum)
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_train(args) -> int:
    if args.resume and args.config:
        raise ConfigError("--resume takes the config saved in the run directory; drop --config")
    if not args.resume and not args.config:
        raise ConfigError("train needs --config FILE (or --resume RUN_DIR)")
    # The config first: its errors come before torch is imported.
    cfg = None if args.resume else load_config(args.config, _overrides(args))
    from .federation_state.checkpoint import latest_checkpoint_name
    from .outputs.lock import exclusive_run_dir
    from .outputs.storage import RunStorage

    if cfg is None:
        storage = RunStorage(args.resume)
        if latest_checkpoint_name(storage) is None:
            raise ConfigError(f"--resume: no checkpoint found in {args.resume}/checkpoints")
    else:
        run_dir = args.run_dir or cfg.run_dir or f"runs/{cfg.name}"
        storage = RunStorage(run_dir)
    with exclusive_run_dir(storage):
        if cfg is not None and latest_checkpoint_name(storage) is not None:
            raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                              "or choose another --run-dir")
        return _train(args, storage, cfg)


def _train(args, storage, cfg) -> int:
    """Train the run in ``storage`` (its lock held): a new one with ``cfg``, or (``cfg`` None) the one there
    resumed."""
    from .federation_state.checkpoint import CheckpointFormatError, load_checkpoint
    from .lifecycle.run import RunLostError

    ckpt = None
    if cfg is None:
        try:
            ckpt = load_checkpoint(storage)
        except CheckpointFormatError as e:
            raise ConfigError(f"--resume: {e}") from None
        cfg = config_from_dict(ckpt.config.to_dict(), _overrides(args))
        check_resume(ckpt.config, cfg, ckpt.rounds_done)
        print(f"resuming {args.resume} after round {ckpt.rounds_done}", flush=True)
    from .drivers.console import RoundProgress, format_summary
    from .federation_state.setup import check_model_arch

    check_model_arch(cfg)
    for line in defaults_taken(cfg, _overrides(args)):
        print(line, flush=True)
    # config.yaml records where the data and the run really were, so a resume finds them again.
    cfg.run_dir = storage.uri
    if cfg.data.path is not None:
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    elif cfg.data.data_dir is None and cfg.data.dataset in DATASETS and cfg.data.dataset != "synthetic":
        from .data import resolve_data_dir

        cfg.data.data_dir = str(resolve_data_dir(None).resolve())
    from .executors.runtimes import runtime_of

    if runtime_of(cfg).on_ray:  # the federation lives in a coordinator actor on the cluster
        from .drivers.ray_runtime import run_ray as run
    else:
        from .drivers.runner import run_local as run
    progress = RoundProgress(cfg.train.rounds, cfg.runtime.progress_seconds)
    log = progress.log(lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    terminated: list[int] = []
    try:
        with _stop_on_sigterm(storage) as terminated:
            records = run(cfg, storage, ckpt, log=log, progress=progress.update)
    except KeyboardInterrupt:
        if terminated:  # its line is out already
            return 128 + signal.SIGTERM
        print(f"fedrod-ray: interrupted; {_resume_hint(storage)}", file=sys.stderr, flush=True)
        return 130
    except RunLostError as e:
        print(f"fedrod-ray: {e}; {_resume_hint(storage)}", file=sys.stderr, flush=True)
        return 1
    print(format_summary(records, time.perf_counter() - t0, storage.uri), flush=True)
    return 0


def cmd_partition(args) -> int:
    cfg = load_config(args.config, _overrides(args))
    from .data import load_dataset
    from .data.partition import format_partition
    from .federation_state.setup import partition_dataset

    print(format_partition(partition_dataset(cfg, load_dataset(cfg.data, seed=cfg.seed))))
    return 0


def cmd_list(args) -> int:
    from .algorithms import RULES
    from .client_update.losses import BALANCED_LOSSES
    from .config.plugins import plugin_sources
    from .config.sections import PARTITIONS
    from .objectives import OBJECTIVES
    from .personalization import METHODS
    from .specs.datasets import DATASET_PLUGINS
    from .specs.losses import LOSSES
    from .specs.methods import HEADS
    from .specs.models import ARCHS, MODEL_PLUGINS

    def params(plugin, key: str = "train.rule_params") -> str:
        defaults = [f"{f}={v}" for f, v in vars(plugin.Params()).items()]
        return f" ({key}: {', '.join(defaults)})" if defaults else ""

    def plugins(group: str) -> str:
        return ", ".join(f"{name} ({source})" for name, source in plugin_sources(group).items()) or "none installed"

    print("datasets (data.dataset): " + ", ".join(DATASETS))
    print("your own data (data.dataset, with data.path): folder (train/<class>/ or clients/<client>/<class>/, "
          "and test/<class>/), arrays (an .npz)")
    print("dataset plug-ins (data.dataset): " + plugins(DATASET_PLUGINS))
    print("partitions (data.partition): " + ", ".join(PARTITIONS))
    print("feature extractors (model.arch): auto, " + ", ".join(ARCHS) + ", package.module:factory")
    print("model plug-ins (model.arch): " + plugins(MODEL_PLUGINS))
    print("personalization methods (train.head): " + ", ".join(
        n + params(METHODS[n], "train.head_params") for n in HEADS))
    print("generic rules (train.generic_rule): " + ", ".join(n + params(r) for n, r in sorted(RULES.items())))
    def settings(name: str) -> list[str]:
        return (["train.gamma"] if LOSSES[name].gamma else []) + ([f"train.{name}"] if name in OBJECTIVES else [])

    print("balanced losses (train.balanced_loss): " + ", ".join(
        n + (f" ({', '.join(settings(n))})" if settings(n) else "")
        for n in [*sorted(BALANCED_LOSSES), *sorted(OBJECTIVES)]))
    return 0


def cmd_schema(args) -> int:
    print(json.dumps(config_schema(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    passive_if_busy()  # before anything imports torch
    args = build_parser().parse_args(argv)
    try:
        handler = getattr(args, "handler", None) or {"train": cmd_train, "partition": cmd_partition,
                                                       "list": cmd_list, "schema": cmd_schema}[args.command]
        return handler(args)
    except ConfigError as e:
        print(f"fedrod-ray: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # Imported only now, so that --help and config errors start without torch: an error of these
        # classes comes from their modules, which are then loaded already.
        from .clients.site_store import SiteStateError
        from .data import DatasetFormatError, DatasetNotFoundError
        from .outputs.lock import DirectoryInUse
        from .round_loop.federation import RoundFailedError

        if isinstance(e, (DatasetNotFoundError, DatasetFormatError, SiteStateError)):
            print(f"fedrod-ray: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, RoundFailedError):
            print(f"fedrod-ray: training stopped: {e}", file=sys.stderr)
            return 1
        if isinstance(e, DirectoryInUse):
            print(f"fedrod-ray: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
