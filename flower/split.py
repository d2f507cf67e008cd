"""``python -m fedrod_ray_flower.split CONFIG OUT --nodes K``: a federation simulated from one dataset, each
SuperNode's share of a fedrod-ray config's clients (clients i, i + K, i + 2K, ... to node i) written to
OUT/node<i> for its node config's ``data-path``. Real participants write their own (``node.NodeData``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedrod_ray.config import load_config
from fedrod_ray.federation_state.setup import prepare

from .node import NodeData


def split(config: str, out: str | Path, nodes: int) -> list[Path]:
    setup = prepare(load_config(config))
    paths = []
    for i in range(nodes):
        path = Path(out) / f"node{i}"
        NodeData.from_setup(setup, setup.all_client_ids[i::nodes]).save(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fedrod_ray_flower.split", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("--nodes", type=int, required=True)
    args = p.parse_args(argv)
    for path in split(args.config, args.out, args.nodes):
        print(path)


if __name__ == "__main__":
    main()
