"""A site's Ray actor (docs/sites.md): placed on the site's nodes by their label, it reads its clients' data
there, one client at a time, keeps their state in the site's store (``site_store``), and evaluates their P-FL
there; the server sends the round's message and the version of each client's state it committed, and gets
back the clients' uploads, their new states' versions and hashes, and sums of P-FL.

Like a ``ClientActor`` it is created bare, reports its site's clients (``index``), and is then handed its
clients and the server's test set (``attach``); a restarted actor is attached again.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import ray
import torch

from ..client_update.local import ClientData, RoundInput, class_distribution
from ..config import config_from_dict
from ..data.sites import SiteIndex, client_counts, index_site, read_client, read_own_test, site_clients
from ..data.transforms import normalize
from ..models.metrics import TestSet, class_correct, features_and_logits, pfl_accuracy
from . import faults
from .actors import ActorNotReady
from .client import ClientContext, ClientFailure, ClientHost, ClientState
from .site_store import SiteStore

SITE_LABEL = "fedrod.site"  # the Ray node label that names a node's site
PFL_KEYS = ("pfl_gm", "pfl_pm", "pfl_pm_global")


def store_uri(cfg, site: int) -> str:
    """Where site ``site`` (its index in ``cfg.sites``) keeps its clients' state: ``store``, else
    <path>/.fedrod/<run name>."""
    s = cfg.sites[site]
    return s.store if s.store is not None else str(Path(s.path).expanduser() / ".fedrod" / cfg.name)


class SiteHost(ClientHost):
    """A ``ClientHost`` whose clients' examples are read at the site when needed, the ``capacity`` most recently
    used clients' kept in memory."""

    def __init__(self, cfg, context: ClientContext, sources: dict[int, Path], classes: tuple[str, ...],
                 capacity: int):
        super().__init__(cfg, context)
        self.sources, self.classes, self.capacity = sources, classes, capacity
        self._data: OrderedDict[int, ClientData] = OrderedDict()

    def data(self, client_id: int) -> ClientData:
        if client_id not in self.sources:
            raise KeyError(f"client {client_id} is not hosted here")
        data = self._data.get(client_id)
        if data is None:
            arrays = read_client(self.sources[client_id], self.classes)
            data = ClientData(torch.from_numpy(arrays.x), torch.from_numpy(arrays.y),
                              torch.as_tensor(self.context.counts[client_id], dtype=torch.long))
            self._data[client_id] = data
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)
        self._data.move_to_end(client_id)
        return data


class SiteActorImpl:
    def __init__(self, cfg_dict: dict, site: int):
        self.cfg = config_from_dict(cfg_dict)
        self.site = site
        self.where = f"sites.{site}.path"
        resources = self.cfg.runtime.client_resources
        torch.set_num_threads(self.cfg.runtime.torch_threads or max(1, int(resources.get("num_cpus", 1))))
        # As a ClientActor: a GPU share puts the site's clients on the GPU.
        use_gpu = resources.get("num_gpus", 0) > 0 and bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.device = "cuda" if use_gpu else "cpu"
        self.host: SiteHost | None = None
        self.store: SiteStore | None = None
        self.names: dict[int, str] = {}
        self.fault = faults.from_env()  # None but in the tests that kill an actor mid-call

    def index(self, classes: tuple[str, ...]) -> SiteIndex:
        """What the site holds (``data.sites.index_site``): its clients' names and sizes, nothing of their data."""
        return index_site(self.cfg.sites[self.site].path, classes, self.where)

    def attach(self, ids: dict[str, int], classes: tuple[str, ...], meta: dict, test_x: np.ndarray,
               test_y: np.ndarray) -> None:
        """Host the site's clients ``ids`` (name -> id): their class counts are read here, and P-FL is measured on
        their own test sets if they have them, else on the server's test set (normalised ``test_x``, ``test_y``)."""
        cfg, site = self.cfg, self.cfg.sites[self.site]
        where = site_clients(site.path, self.where)
        sources = {cid: where[name] for name, cid in ids.items()}
        counts = {cid: client_counts(source, classes) for cid, source in sources.items()}
        own = {cid: read_own_test(source, classes) for cid, source in sources.items()}
        if any(test is not None for test in own.values()):
            cids = sorted(own)
            x = normalize(torch.from_numpy(np.concatenate([own[c][0] for c in cids])), meta["mean"], meta["std"])
            test = TestSet(x, torch.from_numpy(np.concatenate([own[c][1] for c in cids])), len(classes),
                           torch.from_numpy(np.concatenate([np.full(len(own[c][1]), c) for c in cids])))
        else:
            with warnings.catch_warnings():
                # The object store's arrays are read-only; nothing here writes to them.
                warnings.simplefilter("ignore", UserWarning)
                test = TestSet(torch.from_numpy(test_x), torch.from_numpy(test_y), len(classes))
        del own
        shape = tuple(meta["image_shape"])
        context = ClientContext(torch.empty((0, *shape), dtype=torch.uint8), torch.empty(0, dtype=torch.long), {},
                                counts, test, tuple(meta["mean"]), tuple(meta["std"]), meta["augment"],
                                device=self.device)
        self.host = SiteHost(cfg, context, sources, classes, site.data_cache)
        self.gm_model = copy.deepcopy(self.host.model)  # the GM and the PMs' global reading
        self.store = SiteStore(store_uri(cfg, self.site), cfg.runtime.client_cache)
        self.names = {cid: name for name, cid in ids.items()}
        self._pms: dict[int, tuple[tuple[int, str | None], tuple]] = {}  # PM counts by the state they came from

    def ready(self) -> dict:
        return {"attached": self.host is not None, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def check(self, committed: dict[str, tuple[int, str]]) -> list[str]:
        """What of the server's ``committed`` states (name -> (version, sha256)) the site's store does not hold."""
        self._host()
        return self.store.check(committed)

    def prune(self, floor: dict[str, int]) -> int:
        """Delete the site's client states older than ``floor`` (name -> oldest version still needed)."""
        self._host()
        return self.store.prune(floor)

    def _host(self) -> SiteHost:
        if self.host is None:
            raise ActorNotReady("this site actor restarted and has no clients yet")
        return self.host

    def train(self, client_id: int, version: int, digest: str | None, message: RoundInput, round_idx: int):
        """Train client ``client_id`` from its state of ``version`` (sha256 ``digest``), keep the new state in the
        site's store: (the result for the server, the new state's version as the server keeps it, its sha256),
        or the client's failure."""
        host = self._host()
        if self.fault is not None:
            self.fault.reached("train", [client_id], round_idx)
        try:
            state = self.store.load(self.names[client_id], version, digest)
        except Exception as e:  # noqa: BLE001 - reported as the client's failure, never fatal to the round
            return ClientFailure.from_exception(client_id, e)
        keep_local = host.rule.starts_from_local_model or host.method.starts_from_local_model
        out = host.train(client_id, state.for_training(keep_local), message, round_idx)
        if isinstance(out, ClientFailure):
            return out
        result, new = out
        try:
            new_digest = self.store.save(self.names[client_id], new)
        except Exception as e:  # noqa: BLE001 - a state that could not be kept is a failed client
            return ClientFailure.from_exception(client_id, e)
        # What the client keeps stays here: the server gets the upload and the state's version.
        return (dataclasses.replace(result, objectives={}, momentum={}),
                ClientState(rounds_trained=new.rounds_trained), new_digest)

    def evaluate(self, jobs: list[tuple[int, int, str | None]], global_shared: dict, method_state: dict,
                 rounds_done: int) -> dict:
        """P-FL of clients ``jobs`` ((id, version, sha256) each) after ``rounds_done`` rounds, as sums over them:
        {"pfl_gm" | "pfl_pm" | "pfl_pm_global": (sum, clients)} and "failed": {id: error} (as
        ``round_loop.evaluation.Evaluation`` computes each client's, with the GM ``global_shared`` and the
        method's server state ``method_state``)."""
        host = self._host()
        if self.fault is not None:
            self.fault.reached("evaluate", [cid for cid, _, _ in jobs])
        method, model, test, cfg = host.method, self.gm_model, host.context.test, self.cfg
        model.load_partial(global_shared)
        z, logits = features_and_logits(model, test, cfg.eval.batch_size)
        preds = logits.argmax(1)
        correct, total = class_correct(preds, test.y, test.num_classes)
        sums = {key: [0.0, 0] for key in PFL_KEYS}
        failed: dict[int, str] = {}
        for cid, version, digest in sorted(jobs):
            counts = torch.as_tensor(host.context.counts[cid], dtype=torch.long)
            dist = counts.to(torch.float64) / counts.sum().clamp_min(1).to(torch.float64)
            weights = torch.ones_like(dist) if test.clients is not None else dist
            if test.clients is not None:
                rows = test.rows(cid)
                gm = class_correct(preds[rows], test.y[rows], test.num_classes)
            else:
                gm = correct, total
            values: dict[str, float] = {"pfl_gm": _pfl(gm, weights)}
            try:
                state = self.store.load(self.names[cid], version, digest)
                if method.pm_from_global:
                    state = method.pm_job(state, global_shared, rounds_done, method_state, cid)
                reading = self._reading(model, state.personal, counts, z, logits, gm, test, cid)
                if state.local_model is None and state.personal is None:
                    pm = reading  # never trained: its PM is the global reading
                elif not method.pm_from_global and self._pms.get(cid, (None,))[0] == (version, digest):
                    pm = self._pms[cid][1]  # a PM changes only when its client trains
                else:
                    evaluated = host.evaluate([(cid, state)])
                    if cid in evaluated.failed:
                        raise RuntimeError(evaluated.failed[cid])
                    pm = evaluated.correct[cid], evaluated.total[cid]
                    self._pms[cid] = (version, digest), pm
            except Exception as e:  # noqa: BLE001 - one broken client must not stop the evaluation
                failed[cid] = f"{type(e).__name__}: {e}"
                values_done = values
            else:
                values_done = {**values, "pfl_pm": _pfl(pm, weights)}
                if method.global_reading is not None:
                    values_done["pfl_pm_global"] = _pfl(reading, weights)
            for key, value in values_done.items():
                sums[key][0] += value
                sums[key][1] += 1
        return {"sums": {key: tuple(v) for key, v in sums.items()}, "failed": failed}

    @torch.inference_mode()
    def _reading(self, model, personal, counts, z, logits, gm, test: TestSet, cid: int):
        """Per-class counts of the client's PM in the global reading (``Evaluation._global_reading_pms``): the
        global model with the client's own head on its features; the GM's counts ``gm`` where there is none."""
        method = self._host().method
        if model.variant == "linear":
            if personal is None:
                return gm
            head = personal.get("personal_head.weight")
            shape = model.personal_head.weight.shape
            if head is None or head.shape != shape:
                raise ValueError(f"its personal head is not a {tuple(shape)} personal_head.weight")
        phi = method.reading_heads(model, [personal], class_distribution(counts[None]), self._host().initial)
        if method.global_reading is None or phi is None:
            return gm
        if method.reading_replaces_head:
            logits = torch.zeros_like(logits)
        y = test.y
        if test.clients is None:
            preds = (logits + torch.einsum("nd,mcd->mnc", z, phi)).argmax(-1)[0]
            onehot = torch.nn.functional.one_hot(y, test.num_classes).to(torch.float64)
            return (preds == y).to(torch.float64) @ onehot, gm[1]
        rows = test.rows(cid)
        return class_correct((logits[rows] + z[rows] @ phi[0].T).argmax(-1), y[rows], test.num_classes)[0], gm[1]


def _pfl(counts: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor) -> float:
    correct, total = counts
    return float(pfl_accuracy(correct[None], total[None], weights[None])[0])


SiteActor = ray.remote(SiteActorImpl)
