"""The CLI's driver: it calls a federation's round step and owns the run directory's files.

``Federation.step`` only computes; what is written, and when, is decided here: ``config.yaml`` at the
start, the metrics files after every round, a checkpoint every ``runtime.checkpoint_every`` rounds
and after the last (saved while the next round trains), and ``final/`` at the end. The same loop drives
the in-process runtime and the coordinator actor (``fedrod_ray.ray_runtime``); a Tune trainable calls ``step`` and ``snapshot`` itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch

from .checkpoint import BackgroundSaves, CheckpointWriter
from .config import ExperimentConfig, dump_config
from .executors.batched import in_process_executor
from .federation import Federation
from .final import write_final
from .metric_schema import ESTIMATES, label, percent, values_line
from .results import MetricsLog
from .setup import make_host, prepare
from .state import Snapshot
from .storage import RunStorage
from .tracking import final_metrics, open_trackers


def checkpoint_due(cfg: ExperimentConfig, round_idx: int, rounds: int) -> bool:
    return (round_idx + 1) % cfg.runtime.checkpoint_every == 0 or round_idx + 1 == rounds


def last_evaluation(records: list[dict]) -> dict:
    evaluated = [r for r in records if "gfl_gm" in r]
    return evaluated[-1] if evaluated else {}


def drive(step: Callable[[int], dict], checkpoint: Callable[[], None], saved: Callable[[], None],
          finish: Callable[[dict], None], cfg: ExperimentConfig, storage: RunStorage, start_round: int,
          rounds: int, log: Callable[[str], None] = print) -> list[dict]:
    """Run rounds ``start_round`` .. ``rounds - 1`` (``Federation.rounds``: ``train.rounds``, or fewer where a
    privacy budget runs out first); returns every round's record (earlier runs' too, when resumed).

    ``checkpoint()`` starts saving the federation's snapshot of the moment, which may go on while the next
    round trains (``checkpoint.BackgroundSaves``); ``saved()`` waits for the save in flight, raising its
    error; ``finish(metrics)`` writes ``final/``, with the last evaluation's metrics.
    """
    storage.write_bytes("config.yaml", dump_config(cfg).encode())
    metrics = MetricsLog.resume(storage, start_round)
    trackers = open_trackers(cfg, storage, start_round)
    try:
        for r in range(start_round, rounds):
            record = step(r)
            metrics.append(record)
            for tracker in trackers:
                tracker.log_round(record)
            log(format_record(record, rounds))
            if checkpoint_due(cfg, r, rounds):
                checkpoint()
    except BaseException:
        # Interrupted or failed: the save in flight still commits, so that a resume starts from it. If it
        # fails too, that is said, and the first error goes on up.
        try:
            saved()
        except Exception as failed:  # noqa: BLE001 - reported here, the run's own error is the one raised
            log(f"the checkpoint save in flight failed too: {failed}")
        raise
    saved()
    finish(last_evaluation(metrics.records))
    for tracker in trackers:
        tracker.finish(final_metrics(last_evaluation(metrics.records)), storage)
    return metrics.records


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


def run_local(cfg: ExperimentConfig, storage: RunStorage, snapshot: Snapshot | None = None,
              log: Callable[[str], None] = print,
              progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Train in this process (``runtime.mode: local``), the clients one after another or, with
    ``runtime.batched_clients``, several at once in one batched pass."""
    if cfg.runtime.torch_threads:
        torch.set_num_threads(cfg.runtime.torch_threads)
    setup = prepare(cfg)
    executor = in_process_executor(make_host(setup, cfg.runtime.device), cfg.runtime.batched_clients)
    fed = Federation(setup, executor, log, progress)
    if snapshot is not None:
        fed.restore(snapshot)
    writer, saves = CheckpointWriter(storage), BackgroundSaves()
    return drive(fed.step, lambda: saves.save(writer, fed.snapshot()), saves.wait,
                 lambda m: write_final(storage, setup, fed.snapshot(), m), cfg, storage, fed.next_round, fed.rounds,
                 log)


SUMMARY_METRICS = ("gfl_gm", "pfl_gm", "pfl_pm")


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


def format_record(rec: dict, rounds: int) -> str:
    line = (f"[round {rec['round']:>3}/{rounds}] {rec['seconds']:6.1f}s  lr {rec['lr']:.4g}  "
            f"clients {rec['clients_done']}/{rec['clients']} (failed {rec['clients_failed']})  "
            f"{label('train_loss')} {rec['train_loss']:.3f}")
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
    if "clients_dropped" in rec:
        line += f"  |  {label('virtual_time')} {rec['virtual_time']:.1f}s  {label('clients_dropped')} {rec['clients_dropped']}"
    if "staleness" in rec:
        line += f"  |  {label('virtual_time')} {rec['virtual_time']:.1f}s  {label('staleness')} {rec['staleness']:.2f}"
    return line
