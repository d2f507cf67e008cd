"""Write a small image-folder dataset in fedrod-ray's layout (``data.dataset: folder``):

    OUT/clients/<client>/<class>/*.png   each client's training images (data.partition: natural)
    OUT/test/<class>/*.png               the global test set

Each class is a random smooth pattern; an image is its class's pattern plus noise, so a small ConvNet
learns it in a few rounds. Each client holds a few classes in skewed amounts, as real clients do.

    python -m fedrod_example.data OUT [--clients 6] [--classes 4] [--size 12] [--per-client 30] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def write_folder(out: str | Path, clients: int = 6, classes: int = 4, size: int = 12, per_client: int = 30,
                 test_per_class: int = 10, seed: int = 0, mode: str = "L", natural: bool = True) -> Path:
    """Write the dataset under ``out`` and return it; ``natural=False`` writes train/<class>/ instead of
    clients/."""
    rng = np.random.default_rng(seed)
    channels = 3 if mode == "RGB" else 1
    coarse = rng.normal(size=(classes, 3, 3, channels))
    # Nearest-neighbour upsampling of a 3 x 3 grid: a blocky pattern per class.
    reps = -(-size // 3)
    protos = coarse.repeat(reps, axis=1).repeat(reps, axis=2)[:, :size, :size]
    names = [f"class_{chr(ord('a') + c)}" for c in range(classes)]
    root = Path(out)

    def save(folder: Path, c: int, n: int, start: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            x = protos[c] + 0.6 * rng.normal(size=protos[c].shape)
            pixels = np.clip(127.5 + 50 * x, 0, 255).astype(np.uint8)
            Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode=mode).save(folder / f"{start + i:05d}.png")

    for k in range(clients):
        # Two to three classes per client, in Dirichlet(0.5) proportions.
        own = rng.choice(classes, size=min(classes, 2 + k % 2), replace=False)
        counts = np.maximum(1, np.round(rng.dirichlet(np.full(len(own), 0.5)) * per_client).astype(int))
        base = root / "clients" / f"client_{k:02d}" if natural else root / "train"
        for c, n in zip(own, counts):
            save(base / names[c], int(c), int(n), start=k * per_client)
    for c in range(classes):
        save(root / "test" / names[c], c, test_per_class, start=0)
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fedrod_example.data", description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--size", type=int, default=12)
    p.add_argument("--per-client", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rgb", action="store_true", help="RGB images (default: grey)")
    a = p.parse_args(argv)
    root = write_folder(a.out, a.clients, a.classes, a.size, a.per_client, seed=a.seed, mode="RGB" if a.rgb else "L")
    print(f"wrote {root}")


if __name__ == "__main__":
    main()
