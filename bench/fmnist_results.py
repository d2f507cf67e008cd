"""Publish the Fashion-MNIST reproduction (``deploy/reproduce_fmnist.sh OUT``) into the repository: each job's
small result files into ``bench/results/fmnist/<job>/`` and its tables into docs/results.md's "Where it stands".

Each job in OUT is read as ``fedrod-ray reproduce --status`` reads it (from Tune's trial files, without Ray,
so a job still running is published as far as it got) and its ``table.md``, ``results.csv``, ``rounds.csv``,
``curves.png`` and ``reproduce.yaml`` are copied with its provenance (``provenance.yaml``, ``runs/``: each
run's own config.yaml, and the trial tables of the sweeps whose choice it took; tune/provenance.py, written
here for a job that ``fedrod-ray reproduce`` ran); checkpoints stay in OUT. A job not in OUT keeps what an
earlier publication committed (a reproduction that had to start again on another machine does not erase the
rows it has not reached yet), nor does a job in OUT less far along than the committed one (fewer trials
finished, or as many and fewer rounds trained in all).

    python bench/fmnist_results.py /path/to/out                  # every job found in OUT
    python bench/fmnist_results.py --page-only                   # the page's tables from what is committed
    python bench/fmnist_results.py --page-only --replot          # and the page's curves from rounds.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
from pathlib import Path

import yaml
from fedrod_ray_tune.provenance import PROVENANCE_FILE, RUNS, record
from fedrod_ray_tune.report import COLUMNS, mean_std, plot_curves
from fedrod_ray_tune.report import CURVES as CURVE_KEYS
from fedrod_ray_tune.repro_spec import ReproSpec
from fedrod_ray_tune.reproduce import status, trials_on_disk
from fedrod_ray_tune.tables import DP_EPSILONS

from fedrod_ray.outputs.metric_schema import title

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "bench" / "results" / "fmnist"
PAGE = ROOT / "docs" / "results.md"
FILES = ("table.md", "results.csv", "rounds.csv", "curves.png", "reproduce.yaml")
MARK = ("<!-- fmnist-status -->", "<!-- /fmnist-status -->")
# deploy/reproduce_fmnist.sh's jobs, in its order, with what the page calls them; main_a0.3_rest ran at 31c8cab
# (Meta-BSM before its fix) and is kept as the record of the collapse.
JOBS = {
    "main_a0.3": "Main table, Dir(0.3)",
    "main_a0.3_rest": "Main table, Dir(0.3): its Fed-RoD (Meta-BSM) row before the fix, on its own (collapsed)",
    "meta_bsm_a0.3": "Main table, Dir(0.3): Fed-RoD (Meta-BSM) after its fix",
    "new_clients": "New clients (Dir(0.3), 50 train + 50 held out, 20 per round)",
    "main_a0.1": "Main table, Dir(0.1)",
    "meta_bsm_a0.1": "Main table, Dir(0.1): Fed-RoD (Meta-BSM) after its fix",
    "init_a0.3": "Protocol audit: `model.init=pytorch`, Dir(0.3)",
    "seeds_a0.3": "Seeds 1 and 2, Dir(0.3)",
    "normalize_a0.3": "Protocol audit: `data.normalize=false`, Dir(0.3)",
    "momentum_a0.3": "Protocol audit: `train.momentum_buffers=keep`, Dir(0.3)",
    "pfl_a0.3": "Main table, Dir(0.3): personalized-FL baselines without a selected parameter",
    "pfl_tuned_a0.3": "Main table, Dir(0.3): local-only, MTL and Ditto (λ selected by `sweep_lambda`)",
    "pfl_plain_a0.3": "Main table, Dir(0.3): Per-FedAvg and pFedMe (parameters selected by their sweeps)",
    "pfl_a0.1": "Main table, Dir(0.1): personalized-FL baselines without a selected parameter",
    "pfl_tuned_a0.1": "Main table, Dir(0.1): local-only, MTL and Ditto (λ selected by `sweep_lambda`)",
    "pfl_plain_a0.1": "Main table, Dir(0.1): Per-FedAvg and pFedMe (parameters selected by their sweeps)",
    "seeds_a0.1": "Seeds 1 and 2, Dir(0.1): seed 2's trials stopped as they started, its split leaving client 58 "
                  "without examples",
    "seed3_a0.1": "Seed 3, Dir(0.1): the third seed, seed 2's split leaving a client without examples",
    "privacy": "Client-level DP: privacy–utility, 1,000 clients, Dir(0.3), P-FL over 100 sampled clients "
               "([privacy](privacy.md#figures))",
}

# deploy/reproduce_fmnist.sh's rows run alone, a table each: a personalized-FL row (`<row>_a0.3`, `<row>_a0.1`;
# its PFL_ROWS), a new-clients row (`<method>_new_clients`) and the privacy table's pair at one epsilon
# (`privacy_eps<e>`). The page shows such a job only
# once published, and its rows in the table they belong to where they got further than the same rows there.
ALONE = ("mtl", "lg_fedavg", "fedper", "perfedavg", "pfedme", "ditto", "fedfomo", "fedrep", "local", "fedbabu",
         "pfedhn", "pefll")
ALONE_JOBS = {f"{row}_a{alpha}": f"Main table, Dir({alpha}): one personalized-FL row alone"
              for alpha in ("0.3", "0.1") for row in ALONE}
ALONE_JOBS |= {f"privacy_eps{eps}": "Client-level DP: the privacy table's two methods at one ε alone"
               for eps in ("inf", *DP_EPSILONS)}
# The new-clients table's rows of the methods built for new clients (`<method>_new_clients`), a job each.
NEW_CLIENT_JOBS = {"fedavg_new_clients": "New clients: FedAvg alone",
                   "hyper_new_clients": "New clients: Fed-RoD (hyper), seeds 1 and 2",
                   "fedbabu_new_clients": "New clients: FedBABU alone",
                   "pfedhn_new_clients": "New clients: pFedHN alone", "pefll_new_clients": "New clients: PeFLL alone"}
ALONE_JOBS |= NEW_CLIENT_JOBS
JOBS.update(ALONE_JOBS)

# The jobs whose curves.png the page shows under their table (G-FL and P-FL (PM) by evaluated round).
CURVES = ("main_a0.3", "main_a0.1")
# A row the page shows from another job: the main tables' Fed-RoD (Meta-BSM) ran before its fix (aaf1586) and
# was rerun alone; the page's table names where the row comes from, and that job keeps its own table.
ROW_FROM = {"main_a0.3": ("Fed-RoD (Meta-BSM)", "meta_bsm_a0.3"), "main_a0.1": ("Fed-RoD (Meta-BSM)", "meta_bsm_a0.1")}
# The main tables' other rows, run as jobs of their own (each from one commit): the page shows every row of the
# paper's Table 1 in one table, each appended row marked ¶n, a note naming the n-th job and its commit.
ROWS_FROM = {f"main_a{alpha}": (f"pfl_a{alpha}", f"pfl_tuned_a{alpha}", f"pfl_plain_a{alpha}",
                                  *(job for job in ALONE_JOBS if job.endswith(alpha)))
             for alpha in ("0.3", "0.1")}
ROWS_FROM["privacy"] = tuple(job for job in ALONE_JOBS if job.startswith("privacy_"))
ROWS_FROM["new_clients"] = tuple(NEW_CLIENT_JOBS)
# The jobs of several of a main table's rows, which the rows run alone can stand in for.
GROUPS = {job for sources in ROWS_FROM.values() for job in sources if job not in ALONE_JOBS}


def commit_of(log: Path) -> str:
    """The commit a job ran from, as deploy/reproduce_fmnist.sh logs it (``=== <time> <job> (commit X)``)."""
    found = re.findall(r"\(commit ([0-9a-f]+)\)", log.read_text()) if log.is_file() else []
    if len(set(found)) > 1:
        raise SystemExit(f"{log}: the job ran from several commits ({', '.join(sorted(set(found)))}); "
                         "a table must come from one")
    return found[0] if found else "unknown"


def finished_records(results_csv: Path) -> list[dict]:
    with open(results_csv) as f:
        return [r for r in csv.DictReader(f) if r["status"] == "finished"]


def job_progress(results_csv: Path) -> tuple[int, int]:
    """How far a job got: its trials finished, then the rounds its trials trained in all."""
    with open(results_csv) as f:
        records = list(csv.DictReader(f))
    return sum(r["status"] == "finished" for r in records), sum(int(r["rounds"]) for r in records)


def jobs_in(out: Path) -> list[str]:
    """JOBS that ``out`` holds, in JOBS' order; not one that is starting (Tune has not created its trials)."""
    return [job for job in JOBS if (out / job / "reproduce.yaml").is_file() and (out / job / "trials").is_dir()]


def publish(out: Path, job: str, force: bool) -> None:
    status(out / job)
    folder = DEST / job
    if (folder / "results.csv").is_file() and not force:
        before, now = (job_progress(path) for path in (folder / "results.csv", out / job / "results.csv"))
        if now < before:
            print(f"{job}: kept what is committed ({before[0]} trials finished, {before[1]} rounds in all, "
                  f"against {now[0]} and {now[1]} in {out / job}; --force replaces it)", flush=True)
            return
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name in FILES:
        shutil.copyfile(out / job / name, folder / name)
    commit = commit_of(out / f"{job}.log")
    if not (out / job / PROVENANCE_FILE).is_file():  # fedrod-ray reproduce's: its trials are the runs' folders
        record(out / job, [(trial.config, Path(trial.path)) for trial in trials_on_disk(out / job)], commit,
               f"deploy/reproduce_fmnist.sh OUT (its job {job})")
    provenance = yaml.safe_load((out / job / PROVENANCE_FILE).read_text())
    for name in (PROVENANCE_FILE, *(s["trials"] for s in provenance["sweeps"].values())):
        shutil.copyfile(out / job / name, folder / name)
    shutil.copytree(out / job / RUNS, folder / RUNS)
    (folder / "COMMIT").write_text(commit + "\n")
    print(f"{job}: {folder.relative_to(ROOT)}", flush=True)


# The rows run with more seeds: the main table's job (seed 0) and the jobs of the other seeds, by main table. The
# page shows them together as mean ± std under the main table.
SEEDS = {"main_a0.3": ("seeds_a0.3",), "main_a0.1": ("seeds_a0.1", "seed3_a0.1")}


def seeds_table(main: str) -> str:
    """The rows of ``main``'s SEEDS jobs over all their seeds' finished trials, mean ± std, each seed's job and
    commit named. A row's seed 0 comes from the main table's job or, for a personalized-FL row (Dir(0.1)'s
    best, `BEST_PFL`), from the job that ran it alone; "" until the main job and a SEEDS job are published
    and a trial of a SEEDS job has finished."""
    alpha = main.removeprefix("main_a")
    alone = [job for job in ALONE_JOBS if job.endswith(f"_a{alpha}")]
    jobs = [job for job in (main, *alone, *SEEDS[main]) if (DEST / job / "results.csv").is_file()]
    more = [job for job in SEEDS[main] if job in jobs]
    if main not in jobs or not more:
        return ""
    records = {job: finished_records(DEST / job / "results.csv") for job in jobs}
    rows = list(dict.fromkeys(r["row"] for job in more for r in records[job]))
    if not rows:
        return ""
    lines = ["| method | " + " | ".join(map(title, COLUMNS)) + " | seeds |",
             "|---|" + "|".join("---:" for _ in COLUMNS) + "|---|"]
    used = []
    for row in rows:
        by_seed = {}
        for job in jobs:
            for r in records[job]:
                if r["row"] == row:
                    by_seed.setdefault(r["seed"], (job, r))
        mine = [by_seed[seed] for seed in sorted(by_seed, key=int)]
        used += [job for job, _ in mine if job not in used]
        cells = [mean_std([float(r[key]) for _, r in mine]) for key in COLUMNS]
        seeds = ", ".join(f"{r['seed']} (`{job}`)" for job, r in mine)
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {seeds} |")
    commits = ", ".join(f"`{job}` at `{(DEST / job / 'COMMIT').read_text().strip()}`"
                        for job in jobs if job in used)
    return (f"**Main table, Dir({alpha}): the rows run with more seeds** (mean ± sample std over the seeds each names; "
            f"{commits})\n\n" + "\n".join(lines))


def row_line(table: str, label: str) -> int:
    """The index of ``label``'s line in a table.md's lines (its name, then an optional note or mark)."""
    cells = [line.split("|")[1].strip() if line.startswith("|") else "" for line in table.splitlines()]
    found = [i for i, cell in enumerate(cells) if cell == label or cell.startswith((f"{label} (", f"{label} ‡"))]
    if len(found) != 1:
        raise SystemExit(f"row {label!r}: {len(found)} lines of the table hold it, not 1")
    return found[0]


def with_row_from(table: str, job: str) -> str:
    """``table`` (``job``'s table.md) with ROW_FROM's row taken from the job that reran it, marked §."""
    label, source = ROW_FROM[job]
    if not (DEST / source / "table.md").is_file():
        return table
    theirs = (DEST / source / "table.md").read_text()
    line = theirs.splitlines()[row_line(theirs, label)]
    lines = table.splitlines()
    lines[row_line(table, label)] = line.replace(f"| {label}", f"| {label} §", 1)
    commit = (DEST / source / "COMMIT").read_text().strip()
    at = next(i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("|")) + 1
    lines.insert(at, f"\n§ {label}: from `{source}` (commit `{commit}`, below), the row rerun after the fix of "
                     "Meta-BSM; this table's own commit ran the method before it.")
    return "\n".join(lines)


def progress(line: str) -> tuple[str, float]:
    """A table.md row's method and how far it got: the round of a row not finished, 0 not started, inf done."""
    cell = line.split("|")[1].strip()
    if cell.endswith("(not started)"):
        return cell.removesuffix(" (not started)"), 0
    if found := re.fullmatch(r"(.+?) \(not finished: round (\d+) of .*", cell):
        return found[1], int(found[2])
    return re.sub(r" ‡$", "", cell), float("inf")


def with_rows_from(table: str, job: str) -> str:
    """``table`` (``job``'s table.md) with every row of ROWS_FROM's jobs (their footnotes too, a paragraph each),
    each marked ¶n for the n-th job shown, and a note naming each job and its commit. A method that the table
    or several of those jobs ran shows the row that got furthest (the later job's where they tie), in its
    place."""
    lines = table.splitlines()
    at = next(i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("|")) + 1
    rows: dict[str, tuple[float, str, str | None]] = {}
    for line in lines[4:at]:
        method, got = progress(line)
        rows[method] = (got, line, None)
    notes = []
    for source in ROWS_FROM[job]:
        if not (DEST / source / "table.md").is_file():
            continue
        theirs = [line for line in (DEST / source / "table.md").read_text().splitlines()[4:] if line]
        for line in theirs:
            if line.startswith("|"):
                method, got = progress(line)
                # A job's row replaces the table's own only where it got further; another job's, also on a tie.
                prior = rows.get(method)
                if prior is None or got > prior[0] or (got == prior[0] and prior[2] is not None):
                    rows[method] = (got, line, source)
        notes += [line for line in theirs if not line.startswith("|") and line not in lines + notes]
    used = {source for _, _, source in rows.values()}
    shown = [source for source in ROWS_FROM[job] if source in used]
    mark = {source: f"¶{n}" for n, source in enumerate(shown, 1)}
    if shown:
        notes.append("Rows run as jobs of their own (each job's table is below): " + ", ".join(
            f"{mark[source]} `{source}` (commit `{(DEST / source / 'COMMIT').read_text().strip()}`)"
            for source in shown) + ".")
    body = [row if source is None else row.replace("| ", f"| {mark[source]} ", 1) for _, row, source in rows.values()]
    return "\n".join(lines[:4] + body + lines[at:] + [part for note in notes for part in ("", note)])


def page_block() -> str:
    parts = []
    for job, heading in JOBS.items():
        folder = DEST / job
        if not (folder / "table.md").is_file():
            if job in GROUPS:
                parts.append(f"**{heading}** (`{job}`): not run as a group; the rows the main table marks ¶ "
                             "ran as jobs of their own.")
            elif job not in ALONE_JOBS:
                parts.append(f"**{heading}** (`{job}`): not run yet.")
            continue
        commit = (folder / "COMMIT").read_text().strip()
        table = (folder / "table.md").read_text().strip()
        if job in ROW_FROM:
            table = with_row_from(table, job)
        if job in ROWS_FROM:
            table = with_rows_from(table, job)
        parts.append(f"**{heading}** (`{job}`; commit `{commit}`; files in `bench/results/fmnist/{job}/`)\n\n"
                     + table)
        if job in CURVES:
            # Relative to docs/: the image shows on GitHub, and docs/hooks/generated.py publishes it in the site.
            parts.append(f"![{heading}: G-FL (GM) and P-FL (PM) by round](../bench/results/fmnist/{job}/curves.png)")
        if job in SEEDS and (seeds := seeds_table(job)):
            parts.append(seeds)
    return "\n\n".join(parts)


def write_page() -> None:
    text = PAGE.read_text()
    start, end = text.index(MARK[0]) + len(MARK[0]), text.index(MARK[1])
    PAGE.write_text(text[:start] + "\n" + page_block() + "\n" + text[end:])


def replot(job: str) -> None:
    """Redraw a committed job's curves.png from its rounds.csv (the evaluated rounds of every trial) as
    ``fedrod-ray reproduce`` draws it."""
    doc = yaml.safe_load((DEST / job / "reproduce.yaml").read_text())
    spec = ReproSpec(base=doc["base"], search={}, table=doc["table"], rows=doc["rows"], seeds=doc["seeds"])
    curves: dict[tuple[str, int], dict[str, list[float]]] = {}
    with open(DEST / job / "rounds.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["gfl_gm"]:
                curve = curves.setdefault((r["row"], int(r["seed"])), {k: [] for k in ("round", *CURVE_KEYS)})
                for k in curve:
                    curve[k].append(float(r[k]) if r[k] else float("nan"))
    plot_curves(spec, curves, DEST / job / "curves.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="?", help="deploy/reproduce_fmnist.sh's OUT")
    p.add_argument("--page-only", action="store_true", help="only rewrite docs/results.md's tables")
    p.add_argument("--force", action="store_true",
                   help="replace a committed job even where it got further than OUT's (more trials finished, or more rounds)")
    p.add_argument("--replot", action="store_true", help="redraw the curves the page shows from their rounds.csv")
    args = p.parse_args()
    if args.replot:
        for job in CURVES:
            replot(job)
    if not args.page_only:
        if args.out is None:
            p.error("OUT is needed unless --page-only")
        jobs = jobs_in(args.out)
        if not jobs:
            raise SystemExit(f"{args.out}: holds none of the jobs {', '.join(JOBS)}")
        for job in jobs:
            publish(args.out, job, args.force)
    write_page()
    print(f"{PAGE.relative_to(ROOT)}: {MARK[0]} block rewritten", flush=True)


if __name__ == "__main__":
    main()
