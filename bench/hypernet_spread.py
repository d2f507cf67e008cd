"""How far apart the clients' generated models start, for the two methods whose server generates every weight.

pFedHN's and PeFLL's hypernetwork H makes client m's model from an input of its own: pFedHN's learned
embedding v_m (N(0, 1) at the start), PeFLL's descriptor v_m = the mean of the embedding network E over a
batch of the client's examples. Personalization needs H's models to differ between clients; at the start
they differ only as much as H's inputs do. For each row of the main table (tune/tables.py's settings on
``configs/fmnist_paper.yaml``, seed 0, Dir(``--alpha``), before any training), over the 100 training
clients: the inputs' spread (the mean over coordinates of their standard deviation across clients, over
the mean within-vector standard deviation) and the models' (the mean over clients of ||w_m - mean w|| over
the mean ||w_m||). PeFLL's inputs are taken three ways: plain (``train.head_params.standardize`` off, the
paper's batch mean), as the official code rescales those, (v - m) / s with m and s the first descriptor's
mean and standard deviation over its coordinates (docs/method.md: we do not), and as the table's row makes
them (``standardize`` on), each standardized over its own coordinates.

    FEDROD_DATA_DIR=../shared/data python bench/hypernet_spread.py     # about 10 s on one core
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import md_table
from fedrod_ray_tune.repro_spec import build_spec

from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.personalization.pefll import DESCRIBE, DESCRIPTOR, psi
from fedrod_ray.personalization.pfedhn import EMBEDDINGS, generate
from fedrod_ray.round_loop.federation import Federation

BASE = Path(__file__).resolve().parent.parent / "configs" / "fmnist_paper.yaml"


def spread(rows: torch.Tensor) -> float:
    """The mean over clients of ||r_m - mean r|| over the mean ||r_m|| (one client a row)."""
    return ((rows - rows.mean(0)).norm(dim=1).mean() / rows.norm(dim=1).mean()).item()


def input_spread(v: torch.Tensor) -> float:
    """The inputs' standard deviation across clients (mean over coordinates) over their own (mean over clients)."""
    return (v.std(0).mean() / v.std(1).mean()).item()


def federation(label: str, alpha: float, **head_params) -> Federation:
    """The row's federation before training, ``head_params`` over the row's ``train.head_params``."""
    cfg = build_spec("main", BASE, [0], rows=[label], overrides={"data.alpha": alpha}).row_config(label, 0)
    cfg.train.head_params = {**cfg.train.head_params, **head_params}
    setup = prepare(cfg)
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)


@torch.no_grad()
def models(fed: Federation, inputs: torch.Tensor) -> torch.Tensor:
    """H's model of each input, flattened: one client a row."""
    state, net = fed.method_state, fed.method.net
    return torch.stack([torch.cat([t.flatten() for t in generate(net, state, v).values()]) for v in inputs])


def descriptors(fed: Federation) -> torch.Tensor:
    """Every training client's descriptor under the initial psi, as a round-0 exchange gets it: one a row."""
    ids = range(fed.setup.num_clients)
    answers = fed.executor.ask(0, DESCRIBE, psi(fed.method_state), {m: {} for m in ids})
    return torch.stack([answers[m][DESCRIPTOR] for m in ids])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpha", type=float, default=0.3)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = []
    fed = federation("pFedHN", args.alpha)
    v = fed.method_state[EMBEDDINGS]
    out.append(["pFedHN", "learned embedding (N(0, 1))", v.shape[1], input_spread(v), spread(models(fed, v))])
    fed = federation("PeFLL", args.alpha, descriptor_scaling="none")
    v = descriptors(fed)
    out.append(["PeFLL", "descriptor (ours: the batch mean)", v.shape[1], input_spread(v), spread(models(fed, v))])
    m, s = v[0].mean().item(), v[0].std().item()
    v = (v - m) / s
    out.append(["PeFLL", "descriptor rescaled as the official code (`descriptor_scaling: official`)", v.shape[1], input_spread(v),
                spread(models(fed, v))])
    fed = federation("PeFLL", args.alpha, descriptor_scaling="standardize")
    v = descriptors(fed)
    out.append(["PeFLL", "descriptor standardized (`descriptor_scaling: standardize`)", v.shape[1], input_spread(v),
                spread(models(fed, v))])
    print(f"Dir({args.alpha}), seed 0, before training, {fed.setup.num_clients} clients; the official rescaling's "
          f"m = {m:.4f}, s = {s:.4f} (1/s = {1 / s:.1f})")
    print(md_table("method | H's input | size | inputs' spread | models' spread",
                   [[r[0], r[1], r[2], f"{r[3]:.4f}", f"{r[4]:.5f}"] for r in out],
                   right=[False, False, True, True, True]))


if __name__ == "__main__":
    main()
