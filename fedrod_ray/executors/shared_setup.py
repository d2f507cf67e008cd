"""A prepared ``Setup`` held once in Ray's object store, for a Ray run.

``share`` puts each of the setup's arrays (the dataset, its partition, the normalised test set) into the
object store once and keeps the rest, small, by value: the driver hands that, object references and not
data, to the coordinator, which maps the arrays (``SharedSetup.setup``: numpy arrays come out of the store
zero-copy, as read-only views shared by every process on the node), and the Ray executor hands the same
references to its client actors. So the data is held once per node, whatever the number of processes.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import ray
import torch

from ..config import ExperimentConfig
from ..data import ImageDataset
from ..data.partition import Partition
from ..federation_state.setup import Setup
from ..models.metrics import TestSet

# The setup's arrays, by the part that holds them; a None one is not shared.
DATASET_ARRAYS = ("train_x", "train_y", "test_x", "test_y", "train_clients", "test_clients")
PARTITION_ARRAYS = ("client_indices", "counts", "meta_indices", "test_clients", "test_counts")
TEST_ARRAYS = ("x", "y", "clients")


@dataclass(frozen=True)
class SharedSetup:
    """A Setup whose arrays are in the object store: ``refs`` maps "dataset.train_x", "partition.counts",
    "test.x" and the like to their object; ``dataset`` and ``partition`` are the rest, their arrays None."""

    cfg: ExperimentConfig
    dataset: ImageDataset
    partition: Partition
    augment: bool
    refs: dict[str, ray.ObjectRef]
    tensors: frozenset[str]  # the refs whose arrays were (and are given back as) torch tensors

    def setup(self) -> Setup:
        """The Setup, its arrays mapped from the object store: read-only, never to be written to."""
        arrays = dict(zip(self.refs, ray.get(list(self.refs.values()))))
        with warnings.catch_warnings():
            # torch warns that the store's arrays are read-only; nothing writes to them.
            warnings.simplefilter("ignore", UserWarning)
            arrays = {k: torch.from_numpy(v) if k in self.tensors else v for k, v in arrays.items()}

        def part(name: str, fields: tuple[str, ...]) -> dict:
            return {f: arrays.get(f"{name}.{f}") for f in fields}

        dataset = dataclasses.replace(self.dataset, **part("dataset", DATASET_ARRAYS))
        partition = dataclasses.replace(self.partition, **part("partition", PARTITION_ARRAYS))
        test = TestSet(num_classes=dataset.num_classes, **part("test", TEST_ARRAYS))
        return Setup(self.cfg, dataset, partition, test, self.augment)


def share(setup: Setup) -> SharedSetup:
    """Put ``setup``'s arrays into the object store, each once (this process owns them: keep the result for
    as long as anything uses them)."""
    refs, tensors = {}, set()
    for name, fields in (("dataset", DATASET_ARRAYS), ("partition", PARTITION_ARRAYS), ("test", TEST_ARRAYS)):
        for f in fields:
            value = getattr(getattr(setup, name), f)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                tensors.add(f"{name}.{f}")
                value = value.numpy()
            refs[f"{name}.{f}"] = ray.put(value)
    dataset = dataclasses.replace(setup.dataset, **dict.fromkeys(DATASET_ARRAYS))
    partition = dataclasses.replace(setup.partition, **dict.fromkeys(PARTITION_ARRAYS))
    return SharedSetup(setup.cfg, dataset, partition, setup.augment, refs, frozenset(tensors))
