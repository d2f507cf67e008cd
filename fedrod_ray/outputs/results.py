"""Per-round metrics as files in the run directory: metrics.jsonl, metrics.csv and curves.png.

A round's record is appended to both files (an object store, which cannot append, rewrites the object);
the CSV is rewritten whole only when a record brings a column it lacks (the first evaluation, the last
one's fine-tuning). The curves are redrawn on evaluation rounds only, the last round being one. A log's
first write rewrites both files whole with the records it holds, so a resumed run's files keep exactly
the records up to its checkpoint and end identical to an uninterrupted run's.
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
        self.columns = csv_columns(self.records)
        self.written = False  # whether the files hold exactly self.records

    @classmethod
    def resume(cls, storage: RunStorage, rounds_done: int) -> MetricsLog:
        return cls(storage, [r for r in read_records(storage) if r["round"] <= rounds_done])

    def append(self, record: dict) -> None:
        self.records.append(record)
        added = [k for k in record if k not in self.columns]
        self.columns += added
        if self.written:
            self.storage.append_bytes("metrics.jsonl", (json.dumps(record) + "\n").encode())
        else:
            self.storage.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.records).encode())
        if self.written and not added:
            self.storage.append_bytes("metrics.csv", csv_rows([record], self.columns, header=False).encode())
        else:
            self.storage.write_bytes("metrics.csv", csv_rows(self.records, self.columns).encode())
        self.written = True
        if record.get("gfl_gm") is not None:
            self.storage.write_bytes("curves.png", plot_curves(self.records))


def read_records(storage: RunStorage) -> list[dict]:
    """The rounds' records in a run directory's metrics.jsonl, as far as it was written ([] without one).

    A process killed while appending leaves a last line without its newline: a round that no checkpoint
    covers (a resumed run drops it like every round after its checkpoint), left out here too.
    """
    if not storage.exists("metrics.jsonl"):
        return []
    text = storage.read_bytes("metrics.jsonl").decode()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def csv_columns(records: list[dict]) -> list[str]:
    """Every key of ``records``, in the order they first appear."""
    columns: list[str] = []
    for r in records:
        columns.extend(k for k in r if k not in columns)
    return columns


def csv_rows(records: list[dict], columns: list[str], header: bool = True) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    if header:
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
