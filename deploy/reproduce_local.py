"""Sweeps and reproduction trials as in-process runs on one machine without Ray (a borrowed GPU box, say),
in parallel processes, then read back into the folders ``fedrod-ray tune`` and ``fedrod-ray reproduce`` write.

The sweeps (tune/pfl_*.yaml for the main tables' rows, tune/new_*.yaml, ranked on held-out validation
clients, for the new-clients table's) choose values their table rows then use,
and a machine lent for minutes cannot wait for a human in between: ``run`` trains the sweeps' trials, takes
each sweep's best (its ``metric`` at its last round, as ``fedrod-ray tune`` ranks them), and trains the table
jobs with it, until a deadline; a run stopped there keeps its checkpoints and metrics, and its row says the
round it reached. Three steps, the first and last where Ray is installed (they build and read the specs):

    python deploy/reproduce_local.py plan PLAN.json --sweep tune/pfl_fedbabu.yaml ... --job fedbabu_a0.3 ...
    python deploy/reproduce_local.py run PLAN.json OUT --device cuda --workers 16 --deadline 480
    python deploy/reproduce_local.py collect PLAN.json OUT DEST --commit SHA

``collect`` writes ``DEST/<job>/`` as ``fedrod-ray reproduce --out`` would (reproduce.yaml: the spec as
planned, with the sweep's choice where the runs took it; trials/; its results from ``fedrod-ray reproduce
--status``'s reading of the trials' own files), its provenance (``provenance.yaml`` and ``runs/``: each run's
own config.yaml, tune/provenance.py) with the log line that bench/fmnist_results.py reads its commit from,
and ``DEST/<sweep>.csv``, one line per trial. The runs are in-process runs (``runtime.mode=local``) on
``--device``: on a GPU their numbers are not bitwise those of a CPU run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE = ROOT / "configs" / "fmnist_paper.yaml"
# deploy/reproduce_fmnist.sh's jobs that this runs: the new-client split and the main tables' two alphas.
NEW_CLIENT_SPLIT = {"data.alpha": 0.3, "data.num_clients": 50, "data.new_clients": 50, "train.client_fraction": 0.4}
ROW_OF = {"fedbabu": "FedBABU", "pfedhn": "pFedHN", "pefll": "PeFLL", "hyper": "Fed-RoD (hyper)", "fedavg": "FedAvg"}
# The new-clients jobs' budgets beside the split, each at FedAvg's client compute (100 rounds x 20 clients x 5
# epochs = 10,000 client-epochs): the hypernetwork methods at their official 5,000 server steps, pFedHN's one a
# returned client (250 rounds x 20 clients, 2 epochs each), PeFLL's one a round (5,000 rounds x 2 clients, 1
# epoch each), the learning rate decaying over the run as over 100 rounds, evaluated 5 times.
NEW_CLIENT_BUDGET = {
    "pfedhn": {"train.rounds": 250, "train.local_epochs": 2, "train.lr_decay": 0.995988, "eval.eval_every": 50},
    "pefll": {"train.rounds": 5000, "train.client_fraction": 0.04, "train.local_epochs": 1,
              "train.lr_decay": 0.999799, "eval.eval_every": 1000},
}


def sweep_of(job: str) -> str:
    """The sweep whose choice ``job``'s row takes: tune/new_<head>.yaml's for a new-clients job (ranked on
    held-out validation clients), tune/pfl_<head>.yaml's for a main-table one."""
    head, _, table = job.partition("_")
    return f"new_{head}" if table == "new_clients" else f"pfl_{head}"


def job_spec(job: str, seeds: list[int], sets: dict | None = None):
    """``fedrod-ray reproduce``'s spec of one of reproduce_fmnist.sh's jobs: <head>_a0.3, <head>_a0.1,
    <head>_new_clients (<head>: a key of ROW_OF); ``sets`` (plan's --set) on top."""
    from fedrod_ray_tune.repro_spec import build_spec

    head, _, table = job.partition("_")
    if table == "new_clients":
        return build_spec("new-clients", BASE, seeds, rows=[ROW_OF[head]],
                          overrides={**NEW_CLIENT_SPLIT, **NEW_CLIENT_BUDGET.get(head, {}), **(sets or {})})
    alpha = {"a0.3": 0.3, "a0.1": None}[table]
    return build_spec("main", BASE, seeds, overrides={**({"data.alpha": alpha} if alpha else {}), **(sets or {})},
                      rows=[ROW_OF[head]])


def local_config(cfg) -> dict:
    """A trial's config as an in-process run, checked: the trial's Ray placement dropped (``run`` names the
    device)."""
    from fedrod_ray.config import config_from_dict

    data = cfg.to_dict()
    data["runtime"] = {"mode": "local", "torch_threads": 1,
                       "checkpoint_every": data["runtime"]["checkpoint_every"]}
    data.pop("run_dir", None)
    config_from_dict(data)
    return data


def plan(args) -> None:
    from fedrod_ray_tune.repro_spec import parse_sets
    from fedrod_ray_tune.space import load_sweep

    sets = parse_sets(args.set)
    sweeps, jobs = [], []
    for path in args.sweep:
        spec = load_sweep(ROOT / path, [f"set.{a}" for a in args.set])
        keys = list(spec.search)
        for i, values in enumerate(itertools.product(*(spec.search[k]["grid"] for k in keys))):
            params = dict(zip(keys, values))
            sweeps.append({"sweep": spec.name, "metric": spec.metric, "name": f"{spec.name}_{i:02d}",
                           "params": params, "config": local_config(spec.trial_config(params))})
    for job in args.job:
        head = job.partition("_")[0]
        seeds = [int(s) for s in args.seeds.get(job, "0").split(",")]
        spec = job_spec(job, seeds, sets)
        for seed in seeds:
            row = ROW_OF[head]
            jobs.append({"job": job, "head": head, "row": row, "seed": seed, "name": f"{job}_s{seed}",
                         "sweep": sweep_of(job),
                         "config": local_config(spec.row_config(row, seed))})
    specs = {job: job_spec(job, [int(s) for s in args.seeds.get(job, "0").split(",")], sets).to_dict()
             for job in args.job}
    Path(args.plan).write_text(json.dumps({"command": command(args), "sweeps": sweeps, "jobs": jobs, "specs": specs},
                                          indent=1))
    print(f"{len(sweeps)} sweep trials, {len(jobs)} table runs -> {args.plan}")


def command(args) -> str:
    """This command as run, its own files named as the module's docstring names them (PLAN.json, OUT, DEST),
    not by this machine's paths."""
    names = {getattr(args, k, None): v for k, v in (("plan", "PLAN.json"), ("out", "OUT"), ("dest", "DEST"))}
    return shlex.join(["python", "deploy/reproduce_local.py", *(names.get(a, a) for a in sys.argv[1:])])


def last_record(run_dir: Path) -> dict:
    """The run's last evaluated round's record (metrics.jsonl), {} if none."""
    from fedrod_ray.outputs.results import read_records
    from fedrod_ray.outputs.storage import RunStorage

    evaluated = [r for r in read_records(RunStorage(str(run_dir))) if "gfl_gm" in r]
    return evaluated[-1] if evaluated else {}


class Runs:
    """Runs in their own processes, ``workers`` at a time, each in ``out/<entry's dir>/<entry's name>``: a
    finished one (final/ written) is skipped, one with a checkpoint resumed."""

    def __init__(self, out: Path, device: str, workers: int):
        self.out, self.device, self.workers = out, device, workers
        self.running: dict[str, tuple[dict, subprocess.Popen]] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}

    def start(self, e: dict) -> None:
        import yaml

        run_dir = self.out / e["dir"] / e["name"]
        if (run_dir / "final").is_dir():
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        config = with_values(e["config"], {"runtime.device": self.device})
        config_file = run_dir.parent / f"{e['name']}.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [sys.executable, "-c", "from fedrod_ray.cli import main; raise SystemExit(main())", "train"]
        cmd += (["--resume", str(run_dir)] if (run_dir / "checkpoints").is_dir() else
                ["--config", str(config_file), "--run-dir", str(run_dir)])
        with open(run_dir.parent / f"{e['name']}.log", "a") as log:
            self.running[e["name"]] = (e, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        print(f"{time.strftime('%H:%M:%S')} start {e['name']}", flush=True)

    def reap(self) -> None:
        for name, (e, p) in list(self.running.items()):
            if p.poll() is not None:
                rec = last_record(self.out / e["dir"] / name)
                print(f"{time.strftime('%H:%M:%S')} end {name} rc={p.returncode} round {rec.get('round')} "
                      f"gfl_gm {rec.get('gfl_gm')} pfl_pm {rec.get('pfl_pm')}", flush=True)
                del self.running[name]

    def stop(self, names) -> None:
        """SIGINT, once: a run stops after its round in flight (fedrod-ray train's Ctrl-C)."""
        for name in names:
            self.running[name][1].send_signal(signal.SIGINT)


def best_values(sweeps: list[dict], out: Path) -> dict[str, dict]:
    """Each sweep's best trial's values, by its metric at the trial's last evaluated round, among the
    trials that finished (final/ written); a sweep without one keeps the table's values ({})."""
    best: dict[str, tuple[float, dict]] = {}
    for e in sweeps:
        rec = last_record(out / e["name"])
        if not (out / e["name"] / "final").is_dir() or e["metric"] not in rec:
            continue
        if e["sweep"] not in best or rec[e["metric"]] > best[e["sweep"]][0]:
            best[e["sweep"]] = (rec[e["metric"]], e["params"])
    return {sweep: params for sweep, (_, params) in best.items()}


def with_values(config: dict, params: dict) -> dict:
    """``config`` with the dotted keys of ``params`` set."""
    config = json.loads(json.dumps(config))
    for key, value in params.items():
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def run(args) -> None:
    """The sweeps and the table runs that wait for none of them; once the sweeps are done (or at
    --sweep-deadline, stopped), the other table runs with each sweep's best values; at --deadline, all stop."""
    started = time.time()
    # A handler of our own, not an inherited SIG_IGN (a shell's `&`): the runs start with SIGINT at its
    # default, so that stop() reaches them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    doc = json.loads(Path(args.plan).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:  # each start (a resumed run is this command again)
        f.write(command(args) + "\n")
    runs = Runs(out, args.device, args.workers)
    sweeps = [{**e, "dir": "sweeps"} for e in doc["sweeps"]]
    swept = {e["sweep"] for e in sweeps}
    waiting = [{**e, "dir": "jobs"} for e in doc["jobs"] if e["sweep"] in swept]
    # The longest first: the table runs that wait for no sweep, then the sweeps' (shorter) trials.
    queue = [{**e, "dir": "jobs"} for e in doc["jobs"] if e["sweep"] not in swept] + sweeps
    names = {e["name"] for e in sweeps}
    sweeps_done = stopped = False
    while queue or runs.running or waiting:
        now = time.time() - started
        if not sweeps_done and (now >= args.sweep_deadline or not (names & ({e["name"] for e in queue}
                                                                    | set(runs.running)))):
            late = names & set(runs.running)
            if late:
                print(f"{time.strftime('%H:%M:%S')} sweep deadline: stopping {sorted(late)}", flush=True)
            runs.stop(late)
            queue = [e for e in queue if e["name"] not in names]
            while names & set(runs.running):
                time.sleep(1)
                runs.reap()
            chosen = best_values(sweeps, out / "sweeps")
            (out / "chosen.json").write_text(json.dumps(chosen, indent=1))
            print(f"{time.strftime('%H:%M:%S')} chosen: {chosen}", flush=True)
            queue += [{**e, "config": with_values(e["config"], chosen.get(e["sweep"], {}))} for e in waiting]
            waiting, sweeps_done = [], True
        if now >= args.deadline:
            if not stopped:
                print(f"deadline: not started {[e['name'] for e in queue]}", flush=True)
                runs.stop(list(runs.running))
                queue, stopped = [], True
            if now >= args.deadline + 120:
                for _, p in runs.running.values():
                    p.kill()
        while queue and len(runs.running) < runs.workers and not stopped:
            runs.start(queue.pop(0))
        time.sleep(2)
        runs.reap()


def collect(args) -> None:
    """The runs in OUT as a reproduction's folders (and each sweep's trials as one CSV) under DEST, each job's
    folder with its provenance (tune/provenance.py): its runs' own config.yaml, the commands, the commit, the
    round reached, and for a row that took a sweep's choice, the sweep's trial table and the chosen values."""
    doc = json.loads(Path(args.plan).read_text())
    out, dest = Path(args.out), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for sweep in sorted({e["sweep"] for e in doc["sweeps"]}):
        (dest / f"{sweep}.csv").write_text(sweep_table([e for e in doc["sweeps"] if e["sweep"] == sweep], out))
    chosen = json.loads((out / "chosen.json").read_text()) if (out / "chosen.json").is_file() else {}
    commands = [doc["command"], *((out / "commands.txt").read_text().splitlines()
                                  if (out / "commands.txt").is_file() else []), command(args)]
    for job in sorted({e["job"] for e in doc["jobs"]}):
        collect_job(job, [e for e in doc["jobs"] if e["job"] == job], doc, chosen, out, dest,
                    (args.commit, "; ".join(commands)))


def sweep_table(entries: list[dict], out: Path) -> str:
    """A sweep's trials as CSV: its values, the round reached, the metrics there, whether it finished."""
    metrics = list(dict.fromkeys(["gfl_gm", "pfl_pm", *(e["metric"] for e in entries)]))
    lines = [",".join(["trial", *entries[0]["params"], "round", *metrics, "finished"])]
    for e in entries:
        rec = last_record(out / "sweeps" / e["name"])
        lines.append(",".join(map(str, [e["name"], *e["params"].values(), rec.get("round"),
                                        *(rec.get(m) for m in metrics), (out / "sweeps" / e["name"] / "final").is_dir()])))
    return "\n".join(lines) + "\n"


def collect_job(job: str, entries: list[dict], doc: dict, chosen: dict, out: Path, dest: Path,
                provenance: tuple[str, str]) -> None:
    """One job's folder: its spec as planned with the sweep's choice the runs took, its trials (the runs'
    folders), its results, and its provenance; (commit, command)."""
    from fedrod_ray_tune.provenance import record
    from fedrod_ray_tune.repro_spec import SPEC_FILE
    from fedrod_ray_tune.reproduce import status
    from fedrod_ray_tune.sweep import TRIALS, start_dir
    from fedrod_ray_tune.trial import PARAMS_FILE

    spec = json.loads(json.dumps(doc["specs"][job]))
    sweeps = {}
    for e in entries:
        sweep = e["sweep"]
        if chosen.get(sweep):
            spec["rows"][e["row"]] = unflattened_row(spec["rows"][e["row"]], chosen[sweep])
            sweeps[e["row"]] = {"sweep": sweep, "trials": f"{sweep}.csv", "chosen": chosen[sweep]}
    target = dest / job
    if (target / TRIALS).exists():  # collected before: collected again from OUT
        shutil.rmtree(target / TRIALS)
    start_dir(target, SPEC_FILE, spec, "a reproduction", "DEST")
    (target / TRIALS).mkdir()
    for info in sweeps.values():
        shutil.copyfile(dest / info["trials"], target / info["trials"])
    trials = []
    for e in entries:
        if not (out / "jobs" / e["name"]).is_dir():  # not started: the table says so
            continue
        folder = target / TRIALS / e["name"]
        shutil.copytree(out / "jobs" / e["name"], folder)
        (folder / PARAMS_FILE).write_text(json.dumps({"row": e["row"], "seed": e["seed"]}))
        trials.append(({"row": e["row"], "seed": e["seed"]}, folder))
    status(target)
    record(target, trials, *provenance, sweeps=sweeps)
    # What bench/fmnist_results.py reads as the job's commit (reproduce_fmnist.sh's log line).
    (dest / f"{job}.log").write_text(f"=== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {job} "
                                     f"(commit {provenance[0]}) deploy/reproduce_local.py\n")
    print((target / "table.md").read_text(), flush=True)


def unflattened_row(row: dict, values: dict) -> dict:
    """A table row's overrides with a sweep's chosen ``values`` (dotted keys) set where the row sets them: a
    value under a mapping the row sets whole (``train.head_params``) goes into that mapping."""
    row = json.loads(json.dumps(row))
    for key, value in values.items():
        parent = next((k for k in row if key.startswith(k + ".") and isinstance(row[k], dict)), None)
        if parent is None:
            row[key] = value
        else:
            row[parent] = with_values(row[parent], {key[len(parent) + 1:]: value})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plan")
    a.add_argument("plan")
    a.add_argument("--sweep", action="append", default=[])
    a.add_argument("--job", action="append", default=[])
    a.add_argument("--seeds", type=json.loads, default={}, help='JSON: job -> "0,1,2" (default "0")')
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of every sweep trial and table run (a smoke test's rounds and clients)")
    a.set_defaults(fn=plan)
    b = sub.add_parser("run")
    b.add_argument("plan")
    b.add_argument("out")
    b.add_argument("--device", default="cuda")
    b.add_argument("--workers", type=int, default=os.cpu_count())
    b.add_argument("--sweep-deadline", type=float, default=240, help="seconds from the start for the sweeps")
    b.add_argument("--deadline", type=float, default=540, help="seconds from the start for everything")
    b.set_defaults(fn=run)
    c = sub.add_parser("collect")
    c.add_argument("plan")
    c.add_argument("out")
    c.add_argument("dest")
    c.add_argument("--commit", required=True, help="the commit the runs ran from")
    c.set_defaults(fn=collect)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
