"""A reproduction's results as files (``write_results``): results.csv and rounds.csv, table.md (mean ± std
over the seeds, with its markers: ⋆ no global model, † fine-tuned PM, ‡ failed updates, "-" no P-FL
(GM)) and curves.png, from what ``reproduce.collect`` read of its trials. bench/fmnist_results.py formats
the published results with the same columns and ``mean_std``."""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedrod_ray.outputs.metric_schema import ACCURACIES, BY_KEY, title
from fedrod_ray.outputs.plotting import figure, png, round_axis
from fedrod_ray.personalization import METHODS
from fedrod_ray.specs.methods import HEADS

from .repro_spec import ReproSpec
from .tables import DP_CLIP_NORM

# The table's columns (fractions in the records, % in the table).
COLUMNS = ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global")
NEW_COLUMNS = ("gfl_gm", "pfl_new_before", "pfl_new_after")
CURVES = ("gfl_gm", "pfl_pm")
# eval_round: the round the metrics were measured at (the last evaluated one; rounds for a finished trial).
# updates / failed_updates: sampled clients' local updates over the reported rounds, and those that failed
# (left out of their round's average), the first of them in first_failed_round (0: none).
CSV_COLUMNS = ("row", "seed", "rounds", "eval_round", "status", *ACCURACIES, "wall_s", "updates", "failed_updates",
               "first_failed_round")


@dataclass
class Collected:
    """What a reproduction's files are written from: one record per (row, seed) (results.csv, table.md),
    each trial's CURVES at its evaluated rounds (curves.png) and its reports round by round (rounds.csv)."""
    records: list[dict]
    curves: dict[tuple[str, int], dict[str, list[float]]]
    rounds: list[dict]


def mean_std(values: list[float]) -> str:
    """Fractions as ``mean ± std`` in % with 2 decimals, the sample std (n - 1) over the seeds; one value:
    the value alone; none: ``-``."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {100 * statistics.stdev(values):.2f}"


def pm_metric(overrides: dict[str, Any]) -> str:
    """The row's P-FL (PM): for FT, the fine-tuned global model's (pfl_ft)."""
    return "pfl_ft" if overrides.get("eval.finetune_train") else "pfl_pm"


def format_table(spec: ReproSpec, records: list[dict]) -> str:
    columns = NEW_COLUMNS if spec.table == "new-clients" else COLUMNS
    seeds = ", ".join(map(str, spec.seeds))
    heading = (f"Table {spec.table}: base {Path(spec.base).name}, {spec.rounds} rounds, seeds {seeds}; "
               "mean ± std over the seeds (sample std), accuracies in %; wall (h): a trial's wall time as it ran "
               "(its rounds' seconds), its seeds' mean, beside the trials that shared the machine.")
    lines = [heading, "",
             "| method | " + " | ".join(map(title, columns)) + " | wall (h) |",
             "|---|" + "|".join("---:" for _ in columns) + "|---:|"]
    footnotes = []
    for label, overrides in spec.rows.items():
        method = METHODS[spec.row_config(label, spec.seeds[0]).train.head]
        mine = [r for r in records if r["row"] == label and r["status"] == "finished"]
        name = label if len(mine) == len(spec.seeds) else f"{label} ({len(mine)} of {len(spec.seeds)} seeds)"
        if not mine:  # how far it got: the metrics of its last evaluation, at the round they were measured
            mine = [r for r in records if r["row"] == label and r["status"] != "error" and r["eval_round"]]
            reached = max((r["rounds"] for r in records if r["row"] == label), default=0)
            at = sorted({r["eval_round"] for r in mine})
            name = (f"{label} (not started)" if not reached else f"{label} (not finished: round {reached} of "
                    f"{spec.rounds}; " + (f"values at round {', '.join(map(str, at))})" if at else "not yet evaluated)"))
        cells = []
        for key in columns:
            mark = ""
            if key == "pfl_pm" and pm_metric(overrides) == "pfl_ft":
                key, mark = "pfl_ft", " †"
                footnote = (f"† {label}: {title('pfl_pm')} is `pfl_ft`, the global model fine-tuned for "
                            f"{_epochs(overrides['eval.finetune_epochs'])} (ERM) on each client's own data "
                            "at the last round.")
                footnotes += [footnote] if footnote not in footnotes else []
            if key in ("gfl_gm", "pfl_gm") and not HEADS[method.name].global_model:
                mark = " ⋆"
                footnote = ("⋆ no global model: the GM is the mean of the clients' final personalized models, as "
                            "the paper reads these methods.")
                footnotes += [footnote] if footnote not in footnotes else []
            if key == "pfl_gm" and method.pm_from_global:
                # Its GM is made to be adapted: the paper has no P-FL (GM) for it (results.csv has the value).
                cells.append("-")
                continue
            cells.append(mean_std([r[key] for r in mine]) + mark)
        walls = [r["wall_s"] for r in mine if not math.isnan(r["wall_s"])]
        cells.append(f"{statistics.fmean(walls) / 3600:.2f}" if walls else "-")
        # A row whose clients' updates failed (a diverged model's non-finite loss, a crashed client) is not a
        # plain result: say so next to its numbers.
        failing = [r for r in records if r["row"] == label and r.get("failed_updates")]
        if failing:
            name += " ‡"
            seeds_failed = "; ".join(f"seed {r['seed']}: {r['failed_updates']} of {r['updates']}, the first in round "
                                     f"{r['first_failed_round']}" for r in failing)
            footnotes.append(f"‡ {label}: sampled clients' local updates failed and were left out of their "
                             f"rounds' averages ({seeds_failed}); the run's log names each error (e.g. a "
                             "non-finite local loss).")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if spec.table == "new-clients":
        epochs = sorted({row["eval.finetune_epochs"] for row in spec.rows.values()})
        footnotes.append("New clients never train: P-FL of the held-out clients with the global model (hyper: "
                         "+ its zero-shot head) before, and after fine-tuning it on their own data for "
                         f"{' or '.join(map(_epochs, epochs))} at the last round.")
    if spec.table == "privacy":
        private = next(label for label, row in spec.rows.items() if row.get("privacy.enabled"))
        seeded = spec.row_config(private, spec.seeds[0]).privacy.noise_seed is not None
        noise = ("seeded (privacy.noise_seed): ε holds only against whoever does not know the seed" if seeded
                 else "from the OS's CSPRNG")
        footnotes.append("ε: client-level DP at δ = 1e-5 (RDP accountant), the noise multiplier derived from the target "
                         f"over the run's rounds, Poisson sampling, updates clipped to {DP_CLIP_NORM:g}, noise and "
                         f"sampling {noise}; ε = ∞: the method without DP. The personalized head never leaves its "
                         "client and takes no noise.")
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"


def _epochs(n: int) -> str:
    return f"{n} epoch" + ("s" if n != 1 else "")


def write_results(spec: ReproSpec, collected: Collected, out_dir: Path) -> None:
    (out_dir / "results.csv").write_text(csv_text(CSV_COLUMNS, collected.records))
    # The schema's keys that some trial reported, in the schema's order.
    reported = [k for k in BY_KEY if k not in ("round", "name") and any(k in r for r in collected.rounds)]
    (out_dir / "rounds.csv").write_text(csv_text(("row", "seed", "round", *reported), collected.rounds))
    (out_dir / "table.md").write_text(format_table(spec, collected.records))
    plot_curves(spec, collected.curves, out_dir / "curves.png")


def csv_text(columns: tuple[str, ...], rows: list[dict]) -> str:
    """``rows`` as CSV text with ``columns``; NaN and absent values as empty cells."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()})
    return out.getvalue()


def mean_curve(runs: list[dict[str, list[float]]], key: str) -> tuple[list[float], list[float], list[float]]:
    """Rounds, mean and std (sample std, as in the table; 0 for one run) over the runs of ``key``, at the
    rounds every run reached."""
    n = min(len(run["round"]) for run in runs)
    values = [[run[key][i] for run in runs] for i in range(n)]
    return (runs[0]["round"][:n], [statistics.fmean(v) for v in values],
            [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values])


def plot_curves(spec: ReproSpec, curves: dict, path: Path) -> None:
    """Each row's CURVES by evaluated round (mean ± std over its seeds), the legend beside the plots, off the
    curves."""
    import matplotlib

    colors = matplotlib.colormaps["tab20" if len(spec.rows) > 10 else "tab10"]
    over = f"seed {spec.seeds[0]}" if len(spec.seeds) == 1 else f"mean ± std over {len(spec.seeds)} seeds"
    with figure(ncols=len(CURVES), figsize=(12, 4.8), sharex=True) as (fig, axes):
        for i, label in enumerate(spec.rows):
            runs = [c for (row, _), c in sorted(curves.items()) if row == label]
            if not runs:
                continue
            for ax, key in zip(axes, CURVES):
                rounds, mean, std = mean_curve(runs, key)
                ax.plot(rounds, [100 * m for m in mean], color=colors(i), label=label,
                        marker="." if len(rounds) < 20 else None)
                ax.fill_between(rounds, [100 * (m - s) for m, s in zip(mean, std)],
                                [100 * (m + s) for m, s in zip(mean, std)], color=colors(i), alpha=0.15,
                                linewidth=0)
        for ax, key in zip(axes, CURVES):
            round_axis(ax)
            ax.set_ylabel(f"{title(key)}, %")
            ax.set_title(f"{title(key)}: {over}")
            ax.grid(alpha=0.3)
        if curves:
            axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize=8)
        fig.suptitle(f"table {spec.table}")
        path.write_bytes(png(fig, dpi=120))
