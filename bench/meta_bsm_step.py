"""What Meta-BSM costs: one client update with ``train.balanced_loss: meta_bsm`` against ``bsm``.

Times ``fedrod_ray.client_update.local.local_update`` (its own wall time, ``LocalResult.seconds``) of Fed-RoD
(linear) for one client of 600 examples, 1 local epoch, batch 40 (15 steps), 1 torch thread, for
  * MNIST-shaped data (mnist_cnn, 1x28x28; real MNIST when found, client 0 of an IID split over 100 clients),
  * CIFAR-10-shaped data (cifar_cnn, 3x32x32 random uint8 images, 10 classes, no augmentation),
each with a meta set of 10 examples per class (100 rows, used whole in every step). One warm-up update,
then ``--repeats`` timed pairs, bsm and meta_bsm alternating so that both see the same load; the table gives
the medians and the median of the pairs' ratios.

    FEDROD_DATA_DIR=../shared/data python bench/meta_bsm_step.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import machine_note, md_table, median, mnist_data_section

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import ClientData, RoundInput, UpdateContext, local_update
from fedrod_ray.config import TrainConfig, config_from_dict
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.models import build_model
from fedrod_ray.objectives import model_parts

N, META_PER_CLASS = 600, 10
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def mnist_data(data_dir: str | None):
    cfg = config_from_dict({"data": mnist_data_section(data_dir) | {"num_clients": 100, "partition": "iid"},
                            "train": {"balanced_loss": "meta_bsm"}})
    setup = prepare(cfg)
    host = make_host(setup)
    return "mnist_cnn", host.data(0), host.meta_set, setup.dataset.mean, setup.dataset.std


def random_data(n: int, shape: tuple[int, ...], seed: int) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 10
    return ClientData(torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8), y,
                      torch.bincount(y, minlength=10))


def updater(arch: str, data: ClientData, meta: ClientData, mean, std, loss: str):
    """A function that runs one local update with ``loss`` and returns its wall time."""
    cfg = TrainConfig(balanced_loss=loss, local_epochs=1)
    model = build_model(arch, 10, tuple(data.x.shape[1:]), "linear", seed=0, parts=model_parts(cfg))
    shared = {k: v.clone() for k, v in model.state_dict().items() if k in model.shared_keys()}

    def run() -> float:
        result, _, _ = local_update(model, RoundInput(shared), data,
                                    UpdateContext(cfg, build_rule("fedavg"), 0, 0, 0, mean, std, False, meta_set=meta))
        return result.seconds

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_note())
    arch, data, meta, mean, std = mnist_data(args.data_dir)
    data = ClientData(data.x[:N].contiguous(), data.y[:N].contiguous(), torch.bincount(data.y[:N], minlength=10))
    shapes = [("MNIST 1x28x28 (mnist_cnn)", arch, data, meta, mean, std),
              ("CIFAR-10-shaped 3x32x32 (cifar_cnn)", "cifar_cnn", random_data(N, (3, 32, 32), 1),
               random_data(10 * META_PER_CLASS, (3, 32, 32), 2), CIFAR_MEAN, CIFAR_STD)]
    rows = []
    for name, arch, data, meta, mean, std in shapes:
        bsm, meta_bsm = (updater(arch, data, meta, mean, std, loss) for loss in ("bsm", "meta_bsm"))
        bsm(), meta_bsm()  # warm-up
        pairs = [(bsm(), meta_bsm()) for _ in range(args.repeats)]
        rows.append([name, f"{median([a for a, _ in pairs]):.3f}", f"{median([b for _, b in pairs]):.3f}",
                     f"{median([b / a for a, b in pairs]):.2f}x"])
    print(f"\nOne update of {N} examples, 1 epoch, batch 40, 1 thread; medians of {args.repeats} pairs:\n")
    print(md_table("shape|bsm (s)|meta_bsm (s)|meta_bsm / bsm", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
