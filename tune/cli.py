"""``fedrod-ray tune`` and ``fedrod-ray reproduce``: registered with the library's CLI through the
``fedrod_ray.commands`` entry point."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedrod_ray.cli import add_logger_argument, logger_overrides
from fedrod_ray.config import ConfigError
from fedrod_ray.specs.datasets import DATASETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="sweep hyperparameters of whole federations with Ray Tune")
    p.add_argument("--config", help="sweep file (see tune/quickstart.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the sweep file: num_samples=4, set.train.rounds=5, "
                        "search.train.lr={grid: [0.01, 0.1]} (repeatable)")
    p.add_argument("--sweep-dir", help="where trials and results go (default runs/sweeps/<sweep name>)")
    p.add_argument("--resume", metavar="SWEEP_DIR", help="continue an interrupted sweep")
    add_logger_argument(p)
    p.set_defaults(handler=tune_command)


def tune_command(args) -> int:
    from .space import load_sweep
    from .sweep import resume_spec, run_sweep

    if args.resume:
        if args.config or args.set or args.logger:
            raise ConfigError("--resume takes the sweep saved in SWEEP_DIR; drop --config and --set")
        sweep_dir = Path(args.resume)
        spec = resume_spec(sweep_dir)
        print(f"resuming the sweep in {sweep_dir}", flush=True)
    else:
        if not args.config:
            raise ConfigError("tune needs --config SWEEP_FILE (or --resume SWEEP_DIR)")
        spec = load_sweep(args.config, args.set + [f"set.{o}" for o in logger_overrides(args)])
        sweep_dir = Path(args.sweep_dir or f"runs/sweeps/{spec.name}")
        _pin_data_dir(spec)
    t0 = time.perf_counter()
    rows = run_sweep(spec, sweep_dir, resume=bool(args.resume))
    print(f"done: {len(rows)} trials in {time.perf_counter() - t0:.0f} s; sweep directory {sweep_dir}: "
          "results.md, results.csv, pareto.png, best.yaml", flush=True)
    if rows:
        print((sweep_dir / "results.md").read_text(), flush=True)
    return 0


def _pin_data_dir(spec) -> None:
    base = spec.experiment_config({})
    if base.data.path is not None:
        # The user's own data: relative to where the sweep was started, not to a trial's working directory.
        spec.fixed["data.path"] = str(Path(base.data.path).expanduser().resolve())
    elif base.data.dataset in DATASETS and base.data.dataset != "synthetic" and base.data.data_dir is None:
        # Found here ($FEDROD_DATA_DIR or the cache), so that every trial, and a resumed sweep, reads
        # the same directory whatever its worker's environment.
        from fedrod_ray.data import resolve_data_dir

        spec.fixed["data.data_dir"] = str(resolve_data_dir(None).resolve())


def register_reproduce(sub: argparse._SubParsersAction) -> None:
    from .tables import TABLES

    p = sub.add_parser("reproduce", help="run every row of one of the paper's tables over seeds, with Ray Tune")
    p.add_argument("--table", help=f"which table: {', '.join(TABLES)}")
    p.add_argument("--config", help="base experiment config (see configs/); the table's rows change the method")
    p.add_argument("--row", action="append", default=[], metavar="LABEL",
                   help="run only this row of the table, e.g. --row FedAvg --row 'Fed-RoD (linear)' (repeatable)")
    p.add_argument("--seeds", help="a count (3: seeds 0, 1, 2) or a list (0,5,7; '7,' for seed 7 alone)")
    p.add_argument("--rounds", type=int, help="rounds per trial (train.rounds; default: the base config's)")
    p.add_argument("--finetune-epochs", type=int, default=None,
                   help="epochs of fine-tuning in the rows that fine-tune (FT, new clients); default 5")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a base config field for every row, e.g. --set data.alpha=0.3 (repeatable); "
                        "a field that a row sets is an error")
    p.add_argument("--resources", metavar="YAML", help="per trial, as in a sweep file: "
                                                        "'{client_slots: 2, client: {num_cpus: 1, num_gpus: 0.5}}'")
    p.add_argument("--out", help="where trials and results go (default runs/reproduce/<table>_<config name>)")
    p.add_argument("--resume", metavar="OUT_DIR", help="continue an interrupted reproduction")
    add_logger_argument(p)
    p.add_argument("--status", metavar="OUT_DIR", help="write and print the table of a reproduction as far as it "
                                                       "got (running or stopped), from its files, without Ray")
    p.set_defaults(handler=reproduce_command)


def reproduce_command(args) -> int:
    import yaml

    from fedrod_ray.outputs.lock import holder

    from .repro_spec import build_spec, load_spec, parse_seeds, parse_sets
    from .reproduce import reproduce, status

    if args.resume or args.status:
        flag = "--resume" if args.resume else "--status"
        given = [f for f in ("table", "row", "config", "seeds", "rounds", "finetune_epochs", "set", "logger", "resources", "out",
                             "status" if args.resume else "resume") if getattr(args, f) not in (None, [])]
        if given:
            raise ConfigError(f"{flag} takes the reproduction saved in OUT_DIR; drop --{given[0].replace('_', '-')}")
    if args.status:
        out_dir = Path(args.status)
        records = status(out_dir)
        done = sum(r["status"] == "finished" for r in records)
        running = holder(out_dir)
        print(f"{out_dir}: {done} of {len(records)} trials finished; table.md, results.csv, rounds.csv, "
              "curves.png written", flush=True)
        print(f"running now: {running}" if running else "no command is running on it", flush=True)
        print((out_dir / "table.md").read_text(), flush=True)
        return 0
    if args.resume:
        out_dir = Path(args.resume)
        spec = load_spec(out_dir)
        print(f"resuming the reproduction in {out_dir}", flush=True)
    else:
        if not (args.table and args.config and args.seeds):
            raise ConfigError("reproduce needs --table, --config and --seeds (or --resume OUT_DIR)")
        try:
            resources = yaml.safe_load(args.resources) if args.resources else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--resources: not YAML: {e}") from None
        if resources is not None and not isinstance(resources, dict):
            raise ConfigError(f"--resources: expected a mapping, got {args.resources!r}")
        spec = build_spec(args.table, args.config, parse_seeds(args.seeds), args.rounds,
                          parse_sets(args.set + logger_overrides(args)), resources, args.row, args.finetune_epochs)
        _pin_data_dir(spec)
        out_dir = Path(args.out or f"runs/reproduce/{spec.name}")
    t0 = time.perf_counter()
    records = reproduce(spec, out_dir, resume=bool(args.resume))
    failed = [f"{r['row']} (seed {r['seed']})" for r in records if r["status"] != "finished"]
    print(f"done: {len(records)} trials in {time.perf_counter() - t0:.0f} s; {out_dir}: table.md, results.csv, "
          "rounds.csv, curves.png", flush=True)
    print((out_dir / "table.md").read_text(), flush=True)
    if failed:
        print(f"fedrod-ray: {len(failed)} trial(s) did not finish: {', '.join(failed)}; the table leaves them out. "
              f"Continue with: fedrod-ray reproduce --resume {out_dir}", file=sys.stderr, flush=True)
        return 1
    return 0
