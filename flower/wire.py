"""What the ServerApp and the ClientApps send each other, as Flower records: fedrod-ray's round message
(``RoundInput``), a client's result (``LocalResult`` without what the client keeps) or failure, and
evaluation counts. Tensors travel as Flower ``ArrayRecord``s (their bytes as they are: nothing is cast)."""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common import FitIns, Parameters
from safetensors.torch import load, save

from fedrod_ray import __version__
from fedrod_ray.client_update.local import LocalResult, RoundInput
from fedrod_ray.clients.client import ClientFailure, EvalCounts
from fedrod_ray.server_math.aggregate import StateDict


def arrays(state: StateDict) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})


def tensors(record: ArrayRecord) -> StateDict:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


# The sender's fedrod-ray version, beside every header: a run's results (bitwise equal to the in-process run's)
# hold only where the server and every SuperNode run the same code.
VERSION = "fedrod_ray_version"


class VersionMismatch(RuntimeError):
    """A message from a fedrod-ray of another version than this process's."""


def put_header(content: RecordDict, **values) -> None:
    """JSON-encoded values under ``header`` (Flower's ConfigRecord takes no None nor nested lists), with this
    process's fedrod-ray version."""
    content["header"] = ConfigRecord({"json": json.dumps(values), VERSION: __version__})


def header(content: RecordDict) -> dict:
    return json.loads(content["header"]["json"])


def check_version(record) -> None:
    """Refuse a header (or SecAgg+'s instructions' config, ``fit_ins``) ``record`` sent by another version of
    fedrod-ray, naming both."""
    sent = record.get(VERSION)
    if sent != __version__:
        raise VersionMismatch(f"the server runs fedrod-ray {sent or '(a version that sends none)'}, this SuperNode "
                              f"{__version__}: a run needs the same version on every machine")


def put_round_input(content: RecordDict, message: RoundInput, ids: list[int]) -> None:
    """The round's message as clients ``ids`` of one node read it: the global weights, the rule's broadcast
    and the method's messages to these clients."""
    content["weights"] = arrays(message.weights)
    content["broadcast"] = arrays(message.broadcast)
    for cid in ids:
        if cid in message.per_client:
            content[f"per_client_{cid}"] = arrays(message.per_client[cid])


def round_input(content: RecordDict, ids: list[int], clip_norm: float | None) -> RoundInput:
    per_client = {cid: tensors(content[f"per_client_{cid}"]) for cid in ids if f"per_client_{cid}" in content}
    return RoundInput(tensors(content["weights"]), tensors(content["broadcast"]), per_client, clip_norm)


def put_result(content: RecordDict, cid: int, result: LocalResult | ClientFailure) -> None:
    """Client ``cid``'s result for the server: its shared weights, its rule's and its method's uploads and its
    losses; never what it keeps (``objectives``, ``momentum``, its personal part)."""
    if isinstance(result, ClientFailure):
        content[f"client_{cid}"] = ConfigRecord({"json": json.dumps(
            {"error": result.error, "traceback": result.traceback})})
        return
    content[f"shared_{cid}"] = arrays(result.shared)
    content[f"upload_{cid}"] = arrays(result.upload)
    content[f"method_upload_{cid}"] = arrays(result.method_upload)
    content[f"client_{cid}"] = ConfigRecord({"json": json.dumps(
        {"num_samples": result.num_samples, "loss": result.loss, "personal_loss": result.personal_loss,
         "steps": result.steps, "seconds": result.seconds, "clipped": result.clipped})})


def result(content: RecordDict, cid: int) -> LocalResult | ClientFailure:
    key = f"client_{cid}"
    if key not in content:
        return ClientFailure(cid, "MissingResult: the SuperNode's reply has no result for this client", "")
    values = json.loads(content[key]["json"])
    if "error" in values:
        return ClientFailure(cid, values["error"], values["traceback"])
    return LocalResult(shared=tensors(content[f"shared_{cid}"]), upload=tensors(content[f"upload_{cid}"]),
                       method_upload=tensors(content[f"method_upload_{cid}"]), **values)


def put_counts(content: RecordDict, counts: EvalCounts) -> None:
    content["correct"] = arrays({str(c): v for c, v in counts.correct.items()})
    content["total"] = arrays({str(c): v for c, v in counts.total.items()})
    content["failed"] = ConfigRecord({"json": json.dumps({str(c): e for c, e in counts.failed.items()})})


def counts(content: RecordDict) -> EvalCounts:
    return EvalCounts({int(c): v for c, v in tensors(content["correct"]).items()},
                      {int(c): v for c, v in tensors(content["total"]).items()},
                      {int(c): e for c, e in json.loads(content["failed"]["json"]).items()})


def put_answer(content: RecordDict, cid: int, answer: StateDict | ClientFailure) -> None:
    """Client ``cid``'s answer to the method's question (``ClientHost.answer``), or its failure."""
    if isinstance(answer, ClientFailure):
        put_result(content, cid, answer)
    else:
        content[f"answer_{cid}"] = arrays(answer)


def answer(content: RecordDict, cid: int) -> StateDict | ClientFailure:
    if f"answer_{cid}" in content:
        return tensors(content[f"answer_{cid}"])
    out = result(content, cid)
    return out if isinstance(out, ClientFailure) else ClientFailure(cid, "MissingResult: no answer", "")


def fit_ins(values: dict, message: RoundInput, ids: list[int]) -> FitIns:
    """A round's message to one node in the instructions Flower's SecAgg+ workflow forwards (``FitIns``): the
    header ``values`` and the round's message as clients ``ids`` read it, one safetensors blob."""
    tensors = {f"weights/{k}": v for k, v in message.weights.items()}
    tensors.update({f"broadcast/{k}": v for k, v in message.broadcast.items()})
    for cid in ids:
        tensors.update({f"per_client/{cid}/{k}": v for k, v in message.per_client.get(cid, {}).items()})
    blob = save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})
    return FitIns(Parameters(tensors=[blob], tensor_type="safetensors"),
                  {"json": json.dumps(values), VERSION: __version__})


def from_fit_ins(ins: FitIns) -> tuple[dict, RoundInput]:
    """The header and the round's message of ``fit_ins``."""
    values = json.loads(ins.config["json"])
    message = RoundInput({}, {}, {}, values.get("clip_norm"))
    common = {"weights": message.weights, "broadcast": message.broadcast}
    for key, v in load(ins.parameters.tensors[0]).items():
        part, name = key.split("/", 1)
        if part == "per_client":
            cid, name = name.split("/", 1)
            message.per_client.setdefault(int(cid), {})[name] = v
        else:
            common[part][name] = v
    return values, message
