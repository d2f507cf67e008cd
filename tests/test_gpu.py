"""The fractional-GPU path: clients on a quarter of a GPU each, their tensors on CUDA, the result close
to the CPU run's. Skipped, saying why, where there is no CUDA device (CI runs on CPU only)."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.config import config_from_dict
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.federation import Federation
from fedrod_ray.setup import make_host, prepare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the fractional-GPU path needs one"),
]


def short_config(*overrides: str):
    return config_from_dict({
        "seed": 0,
        "data": {"dataset": "synthetic", "num_clients": 8, "new_clients": 1, "alpha": 0.3,
                 "synthetic_train_per_class": 40, "synthetic_test_per_class": 20},
        "train": {"head": "hyper", "rounds": 3, "client_fraction": 0.5, "local_epochs": 2, "batch_size": 20},
        "runtime": {"torch_threads": 1},
    }, list(overrides))


def test_clients_on_a_quarter_gpu_each_match_the_cpu_run(ray_session, one_torch_thread):
    ray = ray_session
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the session's Ray sees no GPU")
    setup = prepare(short_config("runtime.client_resources={num_cpus: 1, num_gpus: 0.25}"))
    layout = plan_layout(setup.cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
    assert layout.actor_resources["num_gpus"] == 0.25
    executor = RayExecutor(setup, layout)
    try:
        infos = [ray.get(actor.ready.remote()) for actor in executor.actors]
        assert {info["device"] for info in infos} == {"cuda"}
        # The model an actor trains really lives on the GPU.
        devices = ray.get(executor.actors[0].__ray_call__.remote(
            lambda self: {str(p.device.type) for p in self.host.model.parameters()}))
        assert devices == {"cuda"}
        gpu = Federation(setup, executor, log=lambda s: None)
        gpu_records = [gpu.step(r) for r in range(3)]
    finally:
        executor.close()

    cpu_setup = prepare(short_config())
    cpu = Federation(cpu_setup, InProcessExecutor(make_host(cpu_setup)), log=lambda s: None)
    cpu_records = [cpu.step(r) for r in range(3)]
    # Different kernels, so not bitwise: the weights agree closely and the metrics nearly.
    for k, v in cpu.global_shared.items():
        torch.testing.assert_close(gpu.global_shared[k], v, atol=1e-3, rtol=1e-3)
    for a, b in zip(gpu_records, cpu_records, strict=True):
        assert a["clients_done"] == b["clients_done"] and a["clients_failed"] == 0
        for key in ("gfl_gm", "pfl_gm", "pfl_pm"):
            assert abs(a[key] - b[key]) <= 0.05, (key, a[key], b[key])
