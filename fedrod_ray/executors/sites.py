"""The executor of a run at sites (``data.dataset: sites``, docs/sites.md): each site's clients on that site's
actors (``clients.site_actor``), placed on its nodes by their label ``fedrod.site=<name>``.

It starts the actors, learns each site's clients from them (``SiteActor.index``), and from then on runs the
round's calls like the Ray executor it extends, each client on its home actor at its site: a training call
carries the version and sha256 of the client's committed state instead of the state, and brings back the
upload with the new state's version and hash, which the executor keeps (``kept_states``) for the server's
checkpoint. P-FL is computed at the sites (``pfl_sums``), which send back sums.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from ..client_update.local import RoundInput
from ..clients import faults
from ..clients.client import ClientFailure, ClientUnavailable
from ..clients.site_actor import PFL_KEYS, SITE_LABEL, SiteActor
from ..clients.site_store import SiteStateError
from ..federation_state.setup import Setup
from ..federation_state.site_setup import SiteSetup
from .base import Job, PflSums
from .ray import RESTART_TIMEOUT_S, Layout, RayExecutor

SITE_POLL_S = 1.0  # how often a round that waits for a site (runtime.site_wait_s) looks again
# Snapshots whose state versions the sites keep: the checkpoints kept (``checkpoint.KEEP``, 2) are among the last
# three snapshots (one more: a save in flight, which may not commit).
KEPT_SNAPSHOTS = 3


def live_sites() -> set[str]:
    """The sites that have a live node now."""
    return {node.get("Labels", {}).get(SITE_LABEL) for node in ray.nodes() if node["Alive"]} - {None}


def site_cpus(name: str) -> float:
    """The CPUs of the live nodes labelled ``fedrod.site=<name>``."""
    return sum(node["Resources"].get("CPU", 0.0) for node in ray.nodes()
               if node["Alive"] and node.get("Labels", {}).get(SITE_LABEL) == name)


class SitesExecutor(RayExecutor):
    """The executor protocol over the sites' actors, and what the server keeps of the sites' states."""

    evaluates_at_clients = True
    clients_may_be_away = True

    # size: starting the sites' actors and laying their clients out is one ordered sequence of Ray calls
    def __init__(self, server: Setup, log: Callable[[str], None] = print):
        """``server``: the server's setup (``setup.prepare_server``); ``self.setup`` becomes the whole one
        (``SiteSetup``) once the sites have reported their clients."""
        cfg, ds = server.cfg, server.dataset
        self.log = log
        req = cfg.runtime.client_resources
        unit = max(req.get("num_cpus", 1.0), 1.0)
        classes = tuple(ds.class_names)
        meta = {"image_shape": list(ds.image_shape), "mean": list(ds.mean), "std": list(ds.std),
                "augment": server.augment}
        base = {"num_cpus": req.get("num_cpus", 1.0), "num_gpus": req.get("num_gpus", 0.0),
                "resources": {k: v for k, v in req.items() if k not in ("num_cpus", "num_gpus")},
                "max_restarts": cfg.runtime.max_restarts, "max_task_retries": 0}
        fault = faults.runtime_env()
        if fault is not None:  # only in the tests that kill an actor mid-call
            base["runtime_env"] = fault
        started: list[list] = []
        self.cfg_dict, self.site_options, self.wait_s = cfg.to_dict(), [], cfg.runtime.site_wait_s
        for i, site in enumerate(cfg.sites):
            cpus = site_cpus(site.name)
            if cpus < unit:
                raise RuntimeError(f"sites.{i}: no live Ray node labelled {SITE_LABEL}={site.name} has "
                                   f"{unit:g} CPU for a client (start the site's nodes with `ray start --labels "
                                   f"{SITE_LABEL}={site.name}`)")
            options = {**base, "label_selector": {SITE_LABEL: site.name}}
            self.site_options.append(options)
            started.append([SiteActor.options(**options).remote(cfg.to_dict(), i)
                            for _ in range(math.floor(cpus / unit + 1e-9))])
        indexes = ray.get([actors[0].index.remote(classes) for actors in started])
        self.setup = SiteSetup.of(server, indexes)
        # Each site's clients in contiguous blocks over its actors (no more actors than clients); a client
        # always trains on its home actor.
        self.actors, self.site_actors, self.home = [], [], {}
        self._attach_args: list[list] = []
        test = [ray.put(server.test.x.numpy()), ray.put(server.test.y.numpy())]
        per_site = []
        for site, actors in zip(self.setup.sites, started):
            for extra in actors[len(site.ids):]:
                ray.kill(extra)
            actors = actors[:len(site.ids)]
            per = math.ceil(len(site.ids) / len(actors))
            per_site.append(per)
            self.site_actors.append(list(range(len(self.actors), len(self.actors) + len(actors))))
            for k, actor in enumerate(actors):
                ids = site.ids[k * per:(k + 1) * per]
                self.home.update({cid: len(self.actors) for cid in ids})
                self._attach_args.append([{site.client_name(cid): cid for cid in ids}, classes, meta, *test])
                self.actors.append(actor)
        self.layout = Layout(len(self.actors), max(per_site), len(self.actors), dict(req))
        self.site_index = {cid: i for i, site in enumerate(self.setup.sites) for cid in site.ids}
        self.gone: set[int] = set()  # the sites seen without a live node (their actors stopped)
        self.snapshots: list[dict[int, int]] = []  # the last snapshots' rounds per client (``_prune``)
        self.pruning: list[ray.ObjectRef] = []  # the sites' prunes in flight
        self.sizes = self.setup.sizes
        self.dead: set[int] = set()
        self.calls_done = [0] * len(self.actors)
        self.lost_calls = []
        # The sha256 of every state version the sites reported, by (client, version): the committed ones are
        # those the server's client store names (its rounds_trained).
        self.digests: dict[tuple[int, int], str] = {}
        ray.get([self._attach(a) for a in range(len(self.actors))])

    def _attach(self, a: int) -> ray.ObjectRef:
        return self.actors[a].attach.remote(*self._attach_args[a])

    def _version(self, cid: int, version: int) -> tuple[int, int, str | None]:
        return cid, version, self.digests.get((cid, version))

    def available(self) -> set[int]:
        """The sites (their index) that have a live node now. A site seen without one has its actors stopped;
        one that has nodes again gets fresh actors, attached to its clients, whose state its store kept (so does
        a present site's actor that Ray gave up)."""
        live = live_sites()
        for i, site in enumerate(self.setup.sites):
            actors = self.site_actors[i]
            if site.name not in live:
                if i not in self.gone:
                    self.gone.add(i)
                    for a in actors:
                        ray.kill(self.actors[a], no_restart=True)
                    self.log(f"site {site.name}: no live node; its clients are unavailable until it comes back")
                continue
            fresh = actors if i in self.gone else [a for a in actors if a in self.dead]
            for a in fresh:
                self.actors[a] = SiteActor.options(**self.site_options[i]).remote(self.cfg_dict, i)
                self.dead.discard(a)
            ray.get([self._attach(a) for a in fresh])
            if i in self.gone:
                self.gone.discard(i)
                self.log(f"site {site.name} is back: its clients rejoin")
        return {i for i in range(len(self.setup.sites)) if i not in self.gone}

    def _wait_for(self, cids: list[int]) -> set[int]:
        """The available sites, after waiting up to runtime.site_wait_s for one of ``cids``' sites to be."""
        deadline = time.monotonic() + self.wait_s
        available = self.available()
        while cids and not {self.site_index[c] for c in cids} & available and time.monotonic() < deadline:
            time.sleep(SITE_POLL_S)
            available = self.available()
        return available

    def _away(self, cid: int) -> ClientUnavailable:
        return ClientUnavailable(cid, f"site {self.setup.sites[self.site_index[cid]].name} has no live node")

    revive_poll_s = SITE_POLL_S

    def _may_come_back(self, a: int) -> bool:
        """An actor whose site has no live node is not waited for (``RayExecutor._revive``): its site is away
        (``available``), which its clients' calls report."""
        name = next(self.setup.sites[i].name for i, actors in enumerate(self.site_actors) if a in actors)
        return name in live_sites()

    def train(self, round_idx: int, jobs: list[Job], message: RoundInput):
        message_ref = ray.put(message)

        def submit(actor, slot):
            cid, version, digest = self._version(jobs[slot][0], jobs[slot][1].rounds_trained)
            return actor.train.remote(cid, version, digest, message_ref, round_idx)

        available = self._wait_for([cid for cid, _ in jobs])
        slots = []
        for slot, (cid, _) in enumerate(jobs):
            if self.site_index[cid] in available:
                slots.append(slot)
            else:
                yield slot, self._away(cid)
        for slot, value in self._run("train", slots, lambda slot: [jobs[slot][0]], submit, retry_lost=False):
            cid = jobs[slot][0]
            if isinstance(value, Exception) and self.setup.sites[self.site_index[cid]].name not in live_sites():
                value = self._away(cid)  # lost with its site's nodes
            elif isinstance(value, Exception):
                kind = " (actor died)" if isinstance(value, RayActorError) else ""
                value = ClientFailure.from_exception(cid, value, kind, details=str(value))
            elif not isinstance(value, ClientFailure):
                result, state, digest = value
                self.digests[(cid, state.rounds_trained)] = digest
                value = result, state
            yield slot, value

    def evaluate(self, jobs, estimate=False):
        raise NotImplementedError("with sites, P-FL is computed at the sites (pfl_sums)")

    def finetune(self, jobs, message, epochs, round_idx):
        raise NotImplementedError("fine-tuning is not supported with sites")

    def pfl_sums(self, global_shared: dict, method_state: dict, rounds_done: int,
                 versions: dict[int, int]) -> PflSums:
        """Each site's P-FL sums of its clients, whose committed state has ``versions`` (client -> rounds trained),
        added up in the order of the actors; the clients that failed, and those at sites that are away."""
        available = self.available()
        unavailable = [cid for cid in sorted(versions) if self.site_index[cid] not in available]
        by_home: dict[int, list] = {}
        for cid in sorted(versions):
            if self.site_index[cid] in available:
                by_home.setdefault(self.home[cid], []).append(self._version(cid, versions[cid]))
        chunks = [by_home[a] for a in sorted(by_home)]
        ref, state_ref = ray.put(global_shared), ray.put(method_state)
        values: dict[int, dict] = {}
        failed: dict[int, str] = {}
        for chunk, value in self._run("evaluate", chunks, lambda chunk: [cid for cid, _, _ in chunk],
                                      lambda actor, chunk: actor.evaluate.remote(chunk, ref, state_ref, rounds_done),
                                      retry_lost=True):
            if isinstance(value, Exception) and self.setup.sites[self.site_index[chunk[0][0]]].name not in live_sites():
                unavailable += [cid for cid, _, _ in chunk]
            elif isinstance(value, Exception):
                failed.update({cid: f"{type(value).__name__}: {value}" for cid, _, _ in chunk})
            else:
                values[self.home[chunk[0][0]]] = value
        sums = {key: [0.0, 0] for key in PFL_KEYS}
        for a in sorted(values):
            for key, (total, count) in values[a]["sums"].items():
                sums[key][0] += total
                sums[key][1] += count
            failed.update(values[a]["failed"])
        return PflSums({key: tuple(value) for key, value in sums.items()}, failed, sorted(unavailable), self.pfl_at)

    @property
    def pfl_at(self) -> str:
        """Where P-FL is computed: each site's own test sets, or the server's re-weighted there."""
        own = {s.index.own_tests for s in self.setup.sites}
        where = {frozenset({True}): "own test sets", frozenset({False}): "the server's test set, re-weighted"}
        return "sites: " + where.get(frozenset(own), "own test sets at some, the server's test set at others")

    def kept_states(self, rounds: dict[int, int]) -> dict[str, dict]:
        """What a checkpoint records of each site's state, with the server's committed ``rounds`` (client ->
        rounds trained): every client's state version and sha256 by name, and a hash of them all."""
        out = {}
        for site in self.setup.sites:
            clients = {site.client_name(cid): [rounds[cid], self.digests[(cid, rounds[cid])]]
                       for cid in site.ids if rounds.get(cid, 0)}
            text = json.dumps(clients, sort_keys=True, separators=(",", ":")).encode()
            out[site.name] = {"clients": clients, "hash": hashlib.sha256(text).hexdigest()}
        self._prune(rounds)
        return out

    def _prune(self, rounds: dict[int, int]) -> None:
        """Have each present site delete its clients' state versions older than the last KEPT_SNAPSHOTS
        snapshots name (in the background: nothing waits for it)."""
        self.snapshots = [*self.snapshots[-(KEPT_SNAPSHOTS - 1):], dict(rounds)]
        if len(self.snapshots) < KEPT_SNAPSHOTS:
            return
        available = self.available()
        for i, site in enumerate(self.setup.sites):
            floor = {site.client_name(cid): min(s.get(cid, 0) for s in self.snapshots) for cid in site.ids}
            floor = {name: v for name, v in floor.items() if v > 1}
            if floor and i in available:
                self.pruning.append(self.actors[self.site_actors[i][0]].prune.remote(floor))
        self.pruning = ray.wait(self.pruning, num_returns=len(self.pruning), timeout=0)[1]

    def close(self) -> None:
        """Let the prunes in flight finish (a site that went away meanwhile is not waited for), then stop."""
        if self.pruning:
            ray.wait(self.pruning, num_returns=len(self.pruning), timeout=RESTART_TIMEOUT_S)
        super().close()

    def restore(self, kept: dict[str, dict], rounds: dict[int, int]) -> None:
        """Take a checkpoint's ``kept_states`` (the server's ``rounds`` with it), after every site has checked
        that its store holds each of its clients' states as named; a site that does not is refused."""
        problems = []
        self.digests = {}
        for i, site in enumerate(self.setup.sites):
            recorded = kept.get(site.name, {"clients": {}})["clients"]
            ids = {site.client_name(cid): cid for cid in site.ids}
            for name, (version, digest) in recorded.items():
                if name not in ids:
                    problems.append(f"site {site.name} no longer holds client {name}, which the checkpoint names")
                    continue
                self.digests[(ids[name], version)] = digest
            missing = [site.client_name(cid) for cid in site.ids
                       if rounds.get(cid, 0) and site.client_name(cid) not in recorded]
            if missing:
                problems.append(f"the checkpoint names no state of site {site.name}'s client(s) {missing[:5]}")
            first = self.site_actors[i][0]
            committed = {name: tuple(v) for name, v in recorded.items() if name in ids}
            problems += ray.get(self.actors[first].check.remote(committed))
        self.snapshots = [dict(rounds)]  # the checkpoint resumed from counts as the first snapshot kept
        if problems:
            raise SiteStateError("the sites' stores do not hold the states this checkpoint committed:\n  "
                                 + "\n  ".join(problems))
