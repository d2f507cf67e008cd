"""The paper's tables as data: each table's rows, row label -> the config overrides (dotted keys) that
make its method. ``fedrod-ray reproduce --table`` runs one of them (repro_spec.py builds the reproduction,
reproduce.py runs it); the results pages cite these rows (PFL: the personalized-FL baselines' values)."""

from __future__ import annotations

from typing import Any

FINETUNE_EPOCHS = 5  # FT: "a few epochs" of ERM on the client's own data, from the global model (--finetune-epochs)
IMBALANCE_RATIOS = (10, 100)


def _method(head: str, loss: str, rule: str = "fedavg", **head_params) -> dict[str, Any]:
    # Every row names all three axes and sets the rule's and the method's parameters (the defaults, unless
    # given), so a row is the same method whatever the base config says.
    return {"train.head": head, "train.balanced_loss": loss, "train.generic_rule": rule, "train.rule_params": {},
            "train.head_params": head_params}


# pFedMe's and Per-FedAvg's updates are their own formulas of plain gradient steps.
PLAIN_STEPS = {"train.momentum": 0, "train.weight_decay": 0}
# The personalized-FL baselines (FEDROD.md's second block of Table 1, the paper's order), with the values of
# the parameters the paper selected from a list, selected the same way (tune/pfl_*.yaml sweeps, docs/results).
PFL = {
    "MTL": _method("mtl", "ce", lam=0.1),
    "LG-FedAvg": _method("lg_fedavg", "ce"),
    "FedPer": _method("fedper", "ce"),
    "Per-FedAvg": {**_method("perfedavg", "ce", beta=0.01), **PLAIN_STEPS},
    "pFedMe": {**_method("pfedme", "ce", lam=30.0), **PLAIN_STEPS},
    "Ditto": _method("ditto", "ce", lam=1.0),
    "FedFOMO": _method("fedfomo", "ce"),
    "FedRep": _method("fedrep", "ce"),
}


# Methods built for new clients (issue 50; FEDROD.md, "Methods that personalize new clients"), beside the paper's
# rows, in the main table and the new-clients table, with the values their sweeps chose at seed 1 (the tables run
# seed 0; tune/pfl_fedbabu.yaml, pfl_pfedhn.yaml at 0a5d1e9 and pfl_pefll.yaml at 88fd0bd, run by
# deploy/reproduce_local.py: docs/results.md, "Methods built for new clients"): FedBABU's PM fine-tunes for tau_f
# epochs; pFedHN's and PeFLL's server learning rate and embedding size; PeFLL's descriptors standardized (descriptor_scaling).
FEDBABU_FINETUNE_EPOCHS = 2
NEWCOMERS = {
    "FedBABU": _method("fedbabu", "ce", finetune_epochs=FEDBABU_FINETUNE_EPOCHS),
    "pFedHN": _method("pfedhn", "ce", server_lr=1e-3, embed_dim=13),
    "PeFLL": _method("pefll", "ce", server_lr=5e-4, embed_dim=26, descriptor_scaling="standardize"),
}

# Today's strongest personalized-FL methods (issue 62; FEDROD.md, "Today's strongest P-FL methods"), beside the
# paper's rows in the main table, at their official scripts' values until their sweeps (tune/pfl_gpfl.yaml,
# pfl_fedcp.yaml, pfl_fedala.yaml, pfl_feddbe.yaml) choose: GPFL's lambda and mu, FedCP's lambda, FedALA's eta_W
# and s (p = 1, our bias-free head), FedDBE's m and kappa (the DBE repository's FMNIST script).
LEADERS = {
    "GPFL": _method("gpfl", "ce", lam=0.01, mu=0.1),
    "FedCP": _method("fedcp", "ce", lam=5.0),
    "FedALA": _method("fedala", "ce", eta=1.0, rand_percent=80.0, layer_idx=1),
    "FedDBE": _method("feddbe", "ce", momentum=1.0, kl_weight=50.0),
}

FEDAVG = _method("none", "ce")
FEDAVG_BRM = _method("none", "bsm")
LINEAR = _method("linear", "bsm")
HYPER = _method("hyper", "bsm")
FINETUNE = {"eval.finetune_epochs": FINETUNE_EPOCHS}

MAIN = {
    "FedAvg": FEDAVG,
    "FedProx": _method("none", "ce", "fedprox"),
    "SCAFFOLD": _method("none", "ce", "scaffold"),
    "FedDyn": _method("none", "ce", "feddyn"),
    "local-only": _method("none", "ce", "local"),
    "Fed-RoD (linear)": LINEAR,
    "Fed-RoD (hyper)": HYPER,
    "Fed-RoD (hyper) + FedDyn": _method("hyper", "bsm", "feddyn"),
    "Fed-RoD (Meta-BSM)": _method("linear", "meta_bsm"),
    **PFL,
    **NEWCOMERS,
    **LEADERS,
}
# Client-level DP's privacy-utility table (docs/privacy.md; base configs/fmnist_dp.yaml): each method without DP
# (epsilon = inf) and at target epsilons at delta = 1e-5, sigma derived from each over the run's rounds, Poisson
# sampling at rate train.client_fraction and a fixed clip norm.
DP_EPSILONS = (8, 4, 1)
# The noise on the mean is sigma S / E per coordinate and round; at epsilon 1 (sigma 4.28) S = 2, about the first
# rounds' median update norm, makes it 0.086, as large as the weights, and Fed-RoD (hyper) stays near 25% G-FL over
# its first 6 rounds; S = 0.5 (0.021) reaches 52% (docs/privacy.md).
DP_CLIP_NORM = 0.5


def _private(epsilon: float) -> dict[str, Any]:
    return {"privacy.enabled": True, "privacy.target_epsilon": epsilon, "privacy.delta": 1e-5,
            "privacy.clip_norm": DP_CLIP_NORM, "privacy.sampling": "poisson"}


TABLES: dict[str, dict[str, dict[str, Any]]] = {
    "main": MAIN,
    "ablation": {
        "FedAvg": FEDAVG,
        "FedAvg (BRM)": FEDAVG_BRM,
        "FedAvg (BRM, FT)": {**FEDAVG_BRM, **FINETUNE, "eval.finetune_train": True},
        "Fed-RoD (linear)": LINEAR,
        "Fed-RoD (hyper)": HYPER,
    },
    # The generic head's loss inside Fed-RoD (linear).
    "losses": {name: {**LINEAR, "train.balanced_loss": loss}
               for name, loss in (("CE", "ce"), ("IR", "reweight"), ("LDAM", "ldam"), ("CDT", "cdt"), ("BSM", "bsm"))},
    # Held-out clients (data.new_clients, from the base or --set) before and after fine-tuning.
    "new-clients": {
        "FedAvg": {**FEDAVG, **FINETUNE},
        "FedDyn": {**_method("none", "ce", "feddyn"), **FINETUNE},
        "Fed-RoD (linear)": {**LINEAR, **FINETUNE},
        "Fed-RoD (hyper)": {**HYPER, **FINETUNE},
        **{label: {**overrides, **FINETUNE} for label, overrides in NEWCOMERS.items()},
    },
    # By epsilon, the two methods side by side: trials run in this order, so an unfinished table has pairs.
    "privacy": {f"{label}, ε = {eps}": overrides if eps == "∞" else {**overrides, **_private(eps)}
                for eps in ("∞", *DP_EPSILONS) for label, overrides in (("FedAvg", FEDAVG), ("Fed-RoD (hyper)", HYPER))},
    # The main rows with long-tailed global training data.
    "imbalanced": {f"{label}, IM {ratio}": {**overrides, "data.imbalance_ratio": ratio}
                   for ratio in IMBALANCE_RATIOS for label, overrides in MAIN.items()
                   if label not in PFL and label not in NEWCOMERS and label not in LEADERS},
}
