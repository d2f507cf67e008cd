"""Per-round metrics as files in the run directory: metrics.jsonl, metrics.csv and curves.png.

The whole history is rewritten atomically each round (it is small), which also makes a resumed run's
files identical to an uninterrupted one's: resuming keeps exactly the records up to the checkpoint.
"""

from __future__ import annotations

import csv
import io
import json
import math

from .metric_schema import title
from .plotting import figure, png, round_axis
from .storage import RunStorage

CURVES = ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_new_before")


class MetricsLog:
    def __init__(self, storage: RunStorage, records: list[dict] | None = None):
        self.storage = storage
        self.records: list[dict] = list(records or [])

    @classmethod
    def resume(cls, storage: RunStorage, rounds_done: int) -> MetricsLog:
        records = []
        if storage.exists("metrics.jsonl"):
            for line in storage.read_bytes("metrics.jsonl").decode().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    if rec["round"] <= rounds_done:
                        records.append(rec)
        return cls(storage, records)

    def append(self, record: dict) -> None:
        self.records.append(record)
        self.flush()

    def flush(self) -> None:
        self.storage.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.storage.write_bytes("metrics.csv", to_csv(self.records).encode())
        png = plot_curves(self.records)
        if png is not None:
            self.storage.write_bytes("curves.png", png)


def to_csv(records: list[dict]) -> str:
    columns: list[str] = []
    for r in records:
        columns.extend(k for k in r if k not in columns)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()


def plot_curves(records: list[dict]) -> bytes | None:
    """Accuracy curves over rounds as PNG bytes (None before the first evaluation)."""
    evaluated = [r for r in records if r.get("gfl_gm") is not None]
    if not evaluated:
        return None
    with figure(figsize=(7, 4.2), dpi=110) as (fig, ax):
        for key in CURVES:
            points = [(r["round"], r[key]) for r in evaluated if _is_number(r.get(key))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, [100 * y for y in ys], marker="o" if len(xs) < 30 else None, markersize=3,
                        label=title(key))
        round_axis(ax)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(evaluated[-1].get("name", "") or "accuracy")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        return png(fig)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)
