"""What a training run prints on the console: a line per round, the progress inside a round, and the
summary at the end. The drivers (``runner``, ``ray_runtime``) and the CLI print them; a ``run.Run`` prints
nothing, wherever it lives (a coordinator actor, a Tune trial)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..models import resolve_arch
from ..outputs.metric_schema import ESTIMATES, label, percent, values_line

SUMMARY_METRICS = ("gfl_gm", "pfl_gm", "pfl_pm")


def format_record(rec: dict, rounds: int) -> str:
    """A round's line: its time, learning rate, clients, loss and whatever it evaluated or estimated."""
    line = (f"[round {rec['round']:>3}/{rounds}] {rec['seconds']:6.1f}s  lr {rec['lr']:.4g}  "
            f"clients {rec['clients_done']}/{rec['clients']} (failed {rec['clients_failed']}"
            + (f", {label('clients_unavailable')} {rec['clients_unavailable']}" if rec.get("clients_unavailable") else "")
            + f")  {label('train_loss')} {rec['train_loss']:.3f}")
    if "gfl_gm" in rec:
        # The two readings of the PM together, and the new clients' GM -> PM -> fine-tuned PM as one story.
        line += (f"  |  {values_line(rec, ('gfl_gm', 'pfl_gm', 'pfl_pm'))}"
                 f" (global {percent(rec['pfl_pm_global'])})")
        if "pfl_new_before" in rec:
            line += f"  {values_line(rec, ('pfl_gm_new',))} PM {percent(rec['pfl_new_before'])}"
        if "pfl_new_after" in rec:
            line += f" -> {percent(rec['pfl_new_after'])} fine-tuned"
        if "pfl_ft" in rec:
            line += f"  {values_line(rec, ('pfl_ft',))}"
    if "pfl_pm_est" in rec:
        line += f"  |  {values_line(rec, ESTIMATES)}"
    if "dp_epsilon" in rec:
        line += f"  |  {label('dp_epsilon')} {rec['dp_epsilon']:.3f}"
    # Off the sync default, the virtual clock and what the mode did (docs/rounds.md).
    for key, spec in (("clients_dropped", "d"), ("staleness", ".2f")):
        if key in rec:
            line += f"  |  {label('virtual_time')} {rec['virtual_time']:.1f}s  {label(key)} {rec[key]:{spec}}"
    if "coordinator_restart" in rec:
        line += f"  |  trained again (coordinator restart {rec['coordinator_restart']})"
    return line


def format_model(arch: str, image_shape: tuple[int, int, int]) -> str | None:
    """The line naming the network ``model.arch: auto`` chose for the data's images; None for any other."""
    if arch != "auto":
        return None
    return f"model.arch: auto -> {resolve_arch(arch, image_shape)} (for {' x '.join(map(str, image_shape))} images)"


def format_summary(records: list[dict], seconds: float, run_dir: str) -> str:
    """What a finished run prints: the final and best accuracies and where the files are."""
    evaluated = [r for r in records if "gfl_gm" in r]
    lines = [f"done: {len(records)} rounds ({seconds:.1f} s in this invocation)"]
    if evaluated:
        last = evaluated[-1]
        lines.append(f"  final (round {last['round']}): " + "  ".join(
            f"{label(k)} {percent(last[k])}" for k in SUMMARY_METRICS))
        best = [(k, max(evaluated, key=lambda r, k=k: r[k])) for k in SUMMARY_METRICS]
        lines.append("  best: " + "  ".join(f"{label(k)} {percent(r[k])} (round {r['round']})" for k, r in best))
    lines.append(f"  run directory {run_dir}: metrics.jsonl, metrics.csv, curves.png, checkpoints/, final/")
    return "\n".join(lines)


class RoundProgress:
    """Progress inside a round. On a terminal, one line rewritten in place as clients finish; elsewhere
    (a log file, a Ray job's output) a plain line at most every ``every`` seconds, so that short rounds
    print none. ``log`` wraps a printer so that its lines never land on a half-written progress line."""

    def __init__(self, rounds: int, every: float, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.rounds, self.every, self.clock = rounds, every, clock
        self.shown = False
        self.last: tuple[int, int] | None = None
        self.round_start = self.last_line = clock()

    def update(self, round_number: int, finished: int, sampled: int) -> None:
        if (round_number, finished) == self.last:
            return
        if self.last is None or self.last[0] != round_number:
            self.round_start = self.last_line = self.clock()
        self.last = (round_number, finished)
        text = f"[round {round_number:>3}/{self.rounds}] clients {finished}/{sampled}"
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self.shown = True
        elif finished and self.clock() - self.last_line >= self.every:
            self.stream.write(f"{text} done ({self.clock() - self.round_start:.0f} s)\n")
            self.last_line = self.clock()
        self.stream.flush()

    def log(self, printer: Callable[[str], None]) -> Callable[[str], None]:
        def write(line: str) -> None:
            if self.shown:
                self.stream.write("\r\x1b[K")
                self.shown = False
            printer(line)

        return write
