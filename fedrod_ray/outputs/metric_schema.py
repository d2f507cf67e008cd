"""Every field of a round's record (metrics.jsonl / metrics.csv), once: its key, how the console and the
tables name it, and what it measures (docs/method.md, "Evaluation"). The console lines, the metrics files'
documentation, the curves, Tune's reports and the sweep and reproduction tables take their names from here.

Accuracies are fractions in the records and percentages wherever they are shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

EVERY_ROUND = "every round"
EVALUATION = "evaluation rounds"
LAST_EVALUATION = "last evaluation"
ESTIMATED = "every round, with `eval.estimate_size`"
SAMPLED = "evaluation rounds, with `eval.clients` (P-FL over a sample of the training clients)"
PRIVATE = "every round, with `privacy.enabled`"
DEADLINE = "every round, with `rounds.mode: deadline`"
FEDBUFF = "every server step, with `rounds.mode: fedbuff`"
RESTARTED = "rounds trained again by a restarted Ray coordinator (`runtime.coordinator_restarts`)"
AT_SITES = "every round, with `data.dataset: sites`"
SKIPPED = "rounds that Flower's SecAgg+ declined (`secagg-min-sampled-nodes`)"
AT_SITES_EVALUATION = "evaluation rounds, with `data.dataset: sites`"
# A field that says which clients a round sampled, left out of a private run's records (outputs.sampling_secrecy).
NOT_PRIVATE = "; not with `privacy.enabled` (unless `privacy.disclose_sampling`): it names sampled clients"


@dataclass(frozen=True)
class Metric:
    key: str
    # EVERY_ROUND, EVALUATION (every eval.eval_every and the last), SAMPLED, LAST_EVALUATION (fine-tuning) or
    # ESTIMATED
    when: str
    description: str
    label: str = ""  # as the console prints it ("" for a field it does not print)
    title: str = ""  # as tables, plots and legends name it
    accuracy: bool = False


METRICS = (
    Metric("round", EVERY_ROUND, "the round, counted from 1: after round 3, three rounds are done"),
    Metric("name", EVERY_ROUND, "the experiment's `name`"),
    Metric("lr", EVERY_ROUND, "this round's learning rate"),
    Metric("clients", EVERY_ROUND, "clients sampled this round"),
    Metric("clients_done", EVERY_ROUND, "sampled clients that finished their local training"),
    Metric("clients_failed", EVERY_ROUND, "sampled clients that failed"),
    Metric("failed_ids", EVERY_ROUND, "the failed clients' ids" + NOT_PRIVATE),
    Metric("train_loss", EVERY_ROUND, "mean balanced loss of the local steps, weighted by sample count",
           label="loss"),
    Metric("personal_loss", EVERY_ROUND,
           "the same for the personalized loss; empty without a personalized head"),
    Metric("train_seconds", EVERY_ROUND, "local training and aggregation, in seconds"),
    Metric("virtual_time", EVERY_ROUND, "the virtual clock after this round: the simulated seconds the rounds so "
           "far took on the clients' devices (`rounds`, docs/rounds.md)" + NOT_PRIVATE, label="virtual", title="virtual time (s)"),
    Metric("round_virtual_seconds", EVERY_ROUND, "this round's simulated seconds: sync, the slowest sampled "
           "client's update; deadline, the deadline (or the last client, if all made it); fedbuff, the time "
           "since the last server step" + NOT_PRIVATE),
    Metric("gfl_gm", EVALUATION, "G-FL: the generic model's (GM) accuracy on the balanced test set",
           label="G-FL", title="G-FL (GM)", accuracy=True),
    Metric("pfl_gm", EVALUATION, "P-FL of the GM: each training client's test accuracy re-weighted by its "
           "own class distribution (natural clients with test sets of their own: its plain accuracy on them), "
           "averaged over the training clients",
           label="P-FL GM", title="P-FL (GM)", accuracy=True),
    Metric("pfl_pm", EVALUATION, "P-FL of the personalized models (PM), each client's own last local model "
           "(the paper's main text; over the clients whose PM could be evaluated)",
           label="P-FL PM", title="P-FL (PM)", accuracy=True),
    Metric("pfl_pm_global", EVALUATION, "P-FL of the PMs read as the global model with the client's own head "
           "(the paper's appendix; what the HTTP service serves)",
           label="PM global", title="P-FL (PM, global)", accuracy=True),
    Metric("pfl_gm_new", EVALUATION, "the GM's P-FL on the held-out new clients (with `data.new_clients`)",
           label="new GM", title="P-FL (GM), new clients", accuracy=True),
    Metric("pfl_new_before", EVALUATION, "the new clients' PM P-FL before any local training: the method's "
           "zero-shot model (the global model; hyper: with the zero-shot head H(a; ν̄); the GM for a method "
           "with no global reading)",
           label="new before", title="new clients, before", accuracy=True),
    Metric("pfl_new_after", LAST_EVALUATION, "the same after each new client's adaptation (fine-tuning) "
           "for `eval.finetune_epochs` on its own data",
           label="new after", title="new clients, after", accuracy=True),
    Metric("pfl_ft", LAST_EVALUATION, "P-FL of the global model fine-tuned on each training client's own data "
           "(the FT baseline, with `eval.finetune_train`)",
           label="FT", title="P-FL (FT)", accuracy=True),
    Metric("pfl_gm_ci", SAMPLED, "half the width of the 95% confidence interval of `pfl_gm` over every "
           "training client, from the sample's spread (finite population correction)"),
    Metric("pfl_pm_ci", SAMPLED, "the same for `pfl_pm`"),
    Metric("pfl_pm_global_ci", SAMPLED, "the same for `pfl_pm_global`"),
    Metric("pm_eval_failed", EVALUATION, "clients whose PM could not be evaluated"),
    Metric("finetune_failed", LAST_EVALUATION, "clients that could not be fine-tuned"),
    Metric("seconds", EVERY_ROUND, "the whole round with evaluation, in seconds"),
)
# Not the paper's metrics: a cheap estimate of three of them, for the rounds between exact evaluations
# (what a sweep's scheduler decides on). Their own keys, so that no table takes one for the exact figure.
ESTIMATE_METRICS = (
    Metric("gfl_gm_est", ESTIMATED, "ESTIMATE of `gfl_gm`: the GM's accuracy on a fixed, seeded, "
           "class-stratified sample of `eval.estimate_size` test images, plus (exact − sample) of the last "
           "exact evaluation (equal to the exact figure on an evaluated round)", label="G-FL est",
           title="G-FL (GM), estimate", accuracy=True),
    Metric("pfl_gm_est", ESTIMATED, "ESTIMATE of `pfl_gm` on the same sample, corrected the same way", label="P-FL GM est",
           title="P-FL (GM), estimate", accuracy=True),
    Metric("pfl_pm_est", ESTIMATED, "ESTIMATE of `pfl_pm` on the same sample (a client's PM on the sample's "
           "images of its classes), corrected the same way", label="P-FL PM est", title="P-FL (PM), estimate", accuracy=True),
)
# Client-level differential privacy (``privacy.enabled``; docs/privacy.md).
PRIVACY_METRICS = (
    Metric("dp_epsilon", PRIVATE, "client-level DP: the epsilon spent after this round, at `privacy.delta`, by "
           "the accountant (`privacy.accountant`)", label="ε", title="ε"),
    Metric("dp_clip_norm", PRIVATE, "the clip norm S of this round's updates (with `privacy.adaptive_clip`, where "
           "the last rounds' noised count of unclipped updates moved it)", label="S", title="clip norm"),
)
# How rounds ran (``rounds.mode``; docs/rounds.md).
ROUND_MODE_METRICS = (
    Metric("clients_dropped", DEADLINE, "sampled clients that would have missed the deadline: their work is "
           "discarded and their state unchanged", label="dropped", title="clients dropped"),
    Metric("staleness", FEDBUFF, "the mean staleness of the buffered updates: server steps between the model a "
           "client was sent and the one its update is applied to", label="staleness", title="mean staleness"),
)
# A run at sites (``data.dataset: sites``; docs/sites.md).
SITE_METRICS = (
    Metric("clients_unavailable", AT_SITES, "sampled clients at sites with no live node (or whose site went "
           "away while they trained): not failures; their state is as it was", label="unavailable",
           title="clients unavailable"),
    Metric("unavailable_ids", AT_SITES, "the unavailable clients' ids" + NOT_PRIVATE),
    Metric("gfl_at", AT_SITES_EVALUATION, "where G-FL was computed: on the server, on its test set"),
    Metric("pfl_at", AT_SITES_EVALUATION, "where P-FL was computed: at the sites, on the clients' own test sets "
           "or on the server's test set re-weighted there by each client's class distribution"),
    Metric("pm_eval_unavailable", AT_SITES_EVALUATION, "clients at sites that were away: not in the P-FL means"),
)
# What happened to the run (docs/ray.md).
RUN_METRICS = (
    Metric("round_skipped", SKIPPED, "why the round was not aggregated: its sampled clients sit on fewer "
           "SuperNodes than run config `secagg-min-sampled-nodes` (docs/flower.md); the global model and every "
           "client are as they were"),
    Metric("coordinator_restart", RESTARTED, "the coordinator actor died in this round or after it, before the "
           "round's checkpoint, and the driver started it again from the last checkpoint: that restart's number "
           "in this invocation (1 for the first); the round's figures are those of the restarted coordinator's "
           "training"),
)
ALL_METRICS = (*METRICS, *ESTIMATE_METRICS, *PRIVACY_METRICS, *ROUND_MODE_METRICS, *SITE_METRICS, *RUN_METRICS)
BY_KEY = {m.key: m for m in ALL_METRICS}
# The accuracies, in the order every table and report lists them: the exact ones only.
ACCURACIES = tuple(m.key for m in METRICS if m.accuracy)
ESTIMATES = tuple(m.key for m in ESTIMATE_METRICS)
# What an evaluation adds to a round's record (and final/meta.json keeps of the last one).
EVALUATED = tuple(m.key for m in METRICS if m.when != EVERY_ROUND)


def label(key: str) -> str:
    return BY_KEY[key].label


def title(key: str) -> str:
    return BY_KEY[key].title


def percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


def values_line(record: dict, keys: Iterable[str]) -> str:
    """The accuracies of ``keys`` that ``record`` has, labelled, in %. A label drops the first word of the
    label before it, which the reader still has in mind: ``P-FL GM 60.00  PM 70.00``."""
    parts, previous = [], ""
    for key in keys:
        if key in record:
            words = label(key).split(" ")
            shown = " ".join(words[1:]) if len(words) > 1 and words[0] == previous.split(" ")[0] else label(key)
            parts.append(f"{shown} {percent(record[key])}")
            previous = label(key)
    return "  ".join(parts)


def markdown_table() -> str:
    """docs/runs.md's table of the metrics files' columns (tests/test_metric_schema.py keeps them equal)."""
    lines = ["| column | in the record | console | tables, plots | what it is |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{m.key}` | {m.when} | {m.label} | {m.title} | {m.description} |"
              for m in ALL_METRICS]
    return "\n".join(lines) + "\n"
