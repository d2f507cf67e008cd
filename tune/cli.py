"""``fedrod-ray tune``: registered with the library's CLI through the ``fedrod_ray.commands`` entry point."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fedrod_ray.config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="sweep hyperparameters of whole federations with Ray Tune")
    p.add_argument("--config", help="sweep file (see tune/quickstart.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the sweep file: num_samples=4, set.train.rounds=5, "
                        "search.train.lr={grid: [0.01, 0.1]} (repeatable)")
    p.add_argument("--sweep-dir", help="where trials and results go (default runs/sweeps/<sweep name>)")
    p.add_argument("--resume", metavar="SWEEP_DIR", help="continue an interrupted sweep")
    p.set_defaults(handler=tune_command)


def tune_command(args) -> int:
    from .space import load_sweep
    from .sweep import resume_spec, run_sweep

    if args.resume:
        if args.config or args.set:
            raise ConfigError("--resume takes the sweep saved in SWEEP_DIR; drop --config and --set")
        sweep_dir = Path(args.resume)
        spec = resume_spec(sweep_dir)
        print(f"resuming the sweep in {sweep_dir}", flush=True)
    else:
        if not args.config:
            raise ConfigError("tune needs --config SWEEP_FILE (or --resume SWEEP_DIR)")
        spec = load_sweep(args.config, args.set)
        sweep_dir = Path(args.sweep_dir or f"runs/sweeps/{spec.name}")
        base = spec.experiment_config({})
        if base.data.dataset != "synthetic" and base.data.data_dir is None:
            # Found here ($FEDROD_DATA_DIR or the cache), so that every trial, and a resumed sweep, reads
            # the same directory whatever its worker's environment.
            from fedrod_ray.data import resolve_data_dir

            spec.fixed["data.data_dir"] = str(resolve_data_dir(None).resolve())
    t0 = time.perf_counter()
    rows = run_sweep(spec, sweep_dir, resume=bool(args.resume))
    print(f"done: {len(rows)} trials in {time.perf_counter() - t0:.0f} s; sweep directory {sweep_dir}: "
          "results.md, results.csv, pareto.png, best.yaml", flush=True)
    if rows:
        print((sweep_dir / "results.md").read_text(), flush=True)
    return 0
