"""A SuperNode's own policy: what its organization lets it answer, read from its node config (``flower-supernode
--node-config``, set by whoever runs the node, never by the server) and enforced on the node before it sends
anything. A message outside it is refused with ``PolicyRefusal``, whose text Flower carries back to the
ServerApp (the error reply's reason), so the server logs why.

Pure (no torch, of Flower only SecAgg+'s key names): ``client_app`` applies it to each message and to each
SecAgg+ stage."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

SECURE = "secure-aggregation"  # the same key as the run config's (``secure.SECURE``)
METHODS, MIN_NODES, EVALUATE, ANSWER_ASKS = "allowed-methods", "min-nodes", "evaluate", "answer-asks"
# What else a node config may hold: a deployed node's folders (``node.node_paths``), and what Flower's
# simulation engine gives a simulated node.
PLACES = ("data-path", "state-path", "partition-id", "num-partitions")
EVALUATE_MODES = ("clients", "none")
# SecAgg+ itself needs two nodes (Flower's workflow refuses fewer): the default minimum.
DEFAULT_MIN_NODES = 2


class PolicyRefusal(PermissionError):
    """A message this SuperNode's policy does not allow; its text names the node config key that refuses it."""

    def __init__(self, reason: str):
        super().__init__(f"refused by this SuperNode's policy: {reason}")


def _bool(config: Mapping, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise TypeError(f"node config {key}: must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class NodePolicy:
    """``secure``: the node's clients' updates leave it only inside SecAgg+ (nothing of one client in the clear:
    no plain round, no per-client evaluation, no answer to a method's ``ask``). ``heads`` / ``rules``: the
    ``train.head`` and ``train.generic_rule`` names it runs (None: any). ``min_nodes``: the fewest nodes of a
    SecAgg+ aggregate it joins. ``evaluate``: ``clients`` (each client's test counts) or ``none``.
    ``answer_asks``: whether it answers a method's question about one client (PeFLL's descriptor)."""

    secure: bool = False
    heads: frozenset[str] | None = None
    rules: frozenset[str] | None = None
    min_nodes: int = DEFAULT_MIN_NODES
    evaluate: str = "clients"
    answer_asks: bool = True

    @classmethod
    def from_node_config(cls, config: Mapping, heads: Iterable[str], rules: Iterable[str]) -> NodePolicy:
        """The policy a node config states, every value checked (ValueError or TypeError naming the key);
        ``heads`` and ``rules``: the registered names ``allowed-methods`` may list."""
        unknown = sorted(set(config) - {SECURE, METHODS, MIN_NODES, EVALUATE, ANSWER_ASKS, *PLACES})
        if unknown:
            raise ValueError(f"node config {unknown[0]}: not a setting of fedrod-ray's SuperNode (its settings: "
                             f"{', '.join((*PLACES, SECURE, METHODS, MIN_NODES, EVALUATE, ANSWER_ASKS))})")
        secure = _bool(config, SECURE, False)
        allowed_heads, allowed_rules = _methods(config, frozenset(heads), frozenset(rules))
        min_nodes = config.get(MIN_NODES, DEFAULT_MIN_NODES)
        if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < DEFAULT_MIN_NODES:
            raise ValueError(f"node config {MIN_NODES}: must be an integer of at least {DEFAULT_MIN_NODES} (SecAgg+ "
                             f"needs two nodes), got {min_nodes!r}")
        evaluate = config.get(EVALUATE, "none" if secure else "clients")
        if evaluate not in EVALUATE_MODES:
            raise ValueError(f"node config {EVALUATE}: must be one of {', '.join(EVALUATE_MODES)}, got {evaluate!r}")
        if secure and evaluate == "clients":
            raise ValueError(f"node config {EVALUATE}: 'clients' sends each client's test counts in the clear, "
                             f"which {SECURE}=true forbids: set it to 'none'")
        answer_asks = _bool(config, ANSWER_ASKS, not secure)
        if secure and answer_asks:
            raise ValueError(f"node config {ANSWER_ASKS}: a method's question is answered per client in the "
                             f"clear, which {SECURE}=true forbids: set it to false")
        return cls(secure, allowed_heads, allowed_rules, min_nodes, evaluate, answer_asks)

    def check_method(self, head: str, rule: str) -> None:
        """Refuse a run whose ``train.head`` or ``train.generic_rule`` the node does not allow."""
        for kind, name, allowed in (("train.head", head, self.heads), ("train.generic_rule", rule, self.rules)):
            if allowed is not None and name not in allowed:
                raise PolicyRefusal(f"the run's {kind} {name!r} is not in node config {METHODS} "
                                    f"({', '.join(sorted(allowed))})")

    def check_plain_train(self) -> None:
        """Refuse a round that would send the clients' updates in the clear (not SecAgg+)."""
        if self.secure:
            raise PolicyRefusal(f"node config {SECURE}=true: this SuperNode sends its clients' updates only "
                                "within SecAgg+, and this round is not one")

    def check_evaluate(self, action: str) -> None:
        """Refuse a per-client evaluation (``action``: evaluate, finetune or zero_shot) unless ``evaluate`` is
        ``clients``."""
        if self.evaluate != "clients":
            raise PolicyRefusal(f"node config {EVALUATE}={self.evaluate}"
                                f"{f' ({SECURE}=true)' if self.secure else ''}: this SuperNode sends no "
                                f"client's test counts ({action})")

    def check_ask(self) -> None:
        """Refuse a method's question about one client (``ask``) unless ``answer-asks`` is true."""
        if not self.answer_asks:
            raise PolicyRefusal(f"node config {ANSWER_ASKS}=false{f' ({SECURE}=true)' if self.secure else ''}: "
                                "this SuperNode answers no method's question about one client in the clear")


def _methods(config: Mapping, heads: frozenset[str], rules: frozenset[str]
             ) -> tuple[frozenset[str] | None, frozenset[str] | None]:
    """``allowed-methods``: the heads it names (None: it names none, any head) and the rules (likewise)."""
    if METHODS not in config:
        return None, None
    value = config[METHODS]
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else []
    if not names or not all(names):
        raise ValueError(f"node config {METHODS}: a comma-separated list of train.head and train.generic_rule "
                         f"names, got {value!r}")
    for name in names:
        if name not in heads | rules:
            raise ValueError(f"node config {METHODS}: {name!r} is neither a train.head ({', '.join(sorted(heads))}) "
                             f"nor a train.generic_rule ({', '.join(sorted(rules))})")
    chosen = set(names)
    return frozenset(chosen & heads) or None, frozenset(chosen & rules) or None


def check_secagg_stage(stage: str, configs: Mapping, min_nodes: int, share_num: int,
                       neighbours: Iterable[int]) -> None:
    """Refuse a SecAgg+ stage whose inputs this node's policy does not accept, before the node answers it.

    ``configs``: the stage's config record from the server (``secaggplus_constants.Key``); ``share_num`` and
    ``neighbours``: what the node kept from its earlier stages (the share number the server stated at setup,
    the node ids whose public keys it received, itself included). A node sees only its SecAgg+ neighbours, so
    it counts what it can: the aggregate's size the server states at setup, and at each later stage the
    neighbours taking part (at least ``min_nodes``, or all ``share_num`` where the server made the
    neighbourhoods smaller). At unmask, a neighbour listed both as active (the node sends the share of its
    private mask) and as dead (the share of its secret key) would have both revealed: its own vector in the
    clear. Flower 1.42 does not check it."""
    if stage == Stage.SETUP:
        if configs.get(Key.SAMPLE_NUMBER, 0) < min_nodes:
            raise PolicyRefusal(f"this SecAgg+ round aggregates {configs.get(Key.SAMPLE_NUMBER)} nodes, fewer than "
                                f"node config {MIN_NODES}={min_nodes}")
        return
    visible = min(min_nodes, share_num)
    if stage == Stage.SHARE_KEYS:
        keys = [k for k in configs if k != Key.STAGE]  # one per neighbour, by node id
        if len(keys) < visible:
            raise PolicyRefusal(f"SecAgg+ gave this node {len(keys)} neighbours (itself included), fewer than "
                                f"node config {MIN_NODES}={min_nodes}")
    elif stage == Stage.UNMASK:
        active, dead = set(configs[Key.ACTIVE_NODE_ID_LIST]), set(configs[Key.DEAD_NODE_ID_LIST])
        if active & dead:
            raise PolicyRefusal(f"SecAgg+'s unmask stage lists nodes {sorted(active & dead)} as both active and "
                                "dropped: both their secrets would be revealed")
        strangers = (active | dead) - set(neighbours)
        if strangers:
            raise PolicyRefusal(f"SecAgg+'s unmask stage names nodes {sorted(strangers)}, which are not this "
                                "node's neighbours")
        if len(active) < visible:
            raise PolicyRefusal(f"SecAgg+'s unmask stage has {len(active)} active neighbours (this node included), "
                                f"fewer than node config {MIN_NODES}={min_nodes}")
