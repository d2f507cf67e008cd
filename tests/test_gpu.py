"""Client updates on CUDA: the fractional-GPU path (Ray actors on a quarter of a GPU each) and the in-process
runtime's host on the GPU, each round close to the CPU round from the same state. Skipped, saying why, where
there is no CUDA device (CI runs on CPU only)."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.config import config_from_dict
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: these runs train on one"),
]


def short_config(*overrides: str):
    return config_from_dict({
        "seed": 0,
        "data": {"dataset": "synthetic", "num_clients": 8, "new_clients": 1, "alpha": 0.3,
                 "synthetic_train_per_class": 40, "synthetic_test_per_class": 20},
        "train": {"head": "hyper", "rounds": 3, "client_fraction": 0.5, "local_epochs": 2, "batch_size": 20},
        "runtime": {"torch_threads": 1},
    }, list(overrides))


def one_prediction(setup) -> dict[str, float]:
    """The most that one changed test prediction can move each metric: a prediction of class c weighs 1/n
    in G-FL and a_mc / n_c in client m's P-FL, which P-FL averages over the M training clients (for the GM,
    one prediction counts for every client; for the PMs, for one)."""
    m = setup.num_clients
    per_class = torch.bincount(setup.test.y, minlength=setup.test.num_classes).to(torch.float64)
    a = setup.class_dists[:m]
    return {"gfl_gm": 1 / len(setup.test.y), "pfl_gm": float((a.mean(0) / per_class).max()),
            "pfl_pm": float((a / per_class).max()) / m}


def test_clients_on_a_quarter_gpu_each_match_the_cpu_run(ray_session, one_torch_thread):
    """Each GPU round against a CPU round from the same state: float32 both, so they differ by rounding
    only.

    Why each round from the GPU run's state rather than two whole runs: a CPU rehearsal of this run (the
    in-process run against itself with two threads, or with every starting weight moved by 1e-7 or 1e-6 of
    itself) shows differences of 1e-7 staying under 1e-6 of a tensor's largest weight for three rounds, but
    1e-6 ones growing to 3e-4 after two rounds and 1e-2 after three, once a ReLU or max-pool decision
    flips: whole runs agree closely or not at all, by luck. Over one round from the same state they stay
    at a few 1e-6 at most, so 1e-5 of the largest weight is a bound a correct device path meets with
    margin, and which data, weights or heads on the wrong device or in the wrong order break by orders of
    magnitude. Such small differences move a test prediction only if its logits tie within about 1e-6: the
    metrics may differ by one prediction (``one_prediction``: under a point here), never more.
    """
    ray = ray_session
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the session's Ray sees no GPU")
    setup = prepare(short_config("runtime.client_resources={num_cpus: 1, num_gpus: 0.25}"))
    layout = plan_layout(setup.cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
    assert layout.actor_resources["num_gpus"] == 0.25
    cpu_setup = prepare(short_config())
    cpu = Federation(cpu_setup, InProcessExecutor(make_host(cpu_setup)), log=lambda s: None)
    tolerance = one_prediction(cpu_setup)
    assert max(tolerance.values()) < 0.01
    executor = RayExecutor(setup, layout)
    try:
        infos = [ray.get(actor.ready.remote()) for actor in executor.actors]
        assert {info["device"] for info in infos} == {"cuda"}
        # The model an actor trains really lives on the GPU.
        devices = ray.get(executor.actors[0].__ray_call__.remote(
            lambda self: {str(p.device.type) for p in self.host.model.parameters()}))
        assert devices == {"cuda"}

        def full_fp32(actor) -> tuple[bool, bool]:
            """No TF32 on the actor (cuDNN's convolutions use it by default on Ampere and later, rounding
            their inputs to 10-bit mantissas): the GPU computes in float32 as the CPU does. Defined in the
            test so that Ray sends it by value: an actor cannot import this module. It imports torch itself:
            cloudpickle cannot send torch's module global by value ("cannot pickle 'CudnnModule'", seen on an
            H200)."""
            import torch

            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32

        assert ray.get([actor.__ray_call__.remote(full_fp32) for actor in executor.actors]) == [(False, False)] * len(
            executor.actors)
        gpu = Federation(setup, executor, log=lambda s: None)
        for r in range(3):
            cpu.restore(gpu.snapshot())
            a, b = gpu.step(r), cpu.step(r)
            assert a["clients_done"] == b["clients_done"] == a["clients"] and a["clients_failed"] == 0
            for k, v in cpu.global_shared.items():
                torch.testing.assert_close(gpu.global_shared[k], v, rtol=1e-5, atol=1e-5 * float(v.abs().max()),
                                           msg=lambda m, k=k, r=r: f"round {r + 1}, {k}: {m}")
            for key, most in tolerance.items():
                assert abs(a[key] - b[key]) <= most + 1e-12, (r + 1, key, a[key], b[key], most)
    finally:
        executor.close()


# The in-process runtime with its client host on CUDA (runtime.device=cuda, what deploy/reproduce_local.py runs
# on a GPU machine): each method whose PM or server model lives outside the shared weights, and the rules with
# state of their own.
IN_PROCESS_METHODS = {
    "linear": (), "hyper": (), "ditto": ("train.balanced_loss=ce",), "fedrep": ("train.balanced_loss=ce",),
    "fedbabu": ("train.balanced_loss=ce",), "pfedhn": ("train.balanced_loss=ce",),
    "pefll": ("train.balanced_loss=ce",), "scaffold": ("train.generic_rule=scaffold",),
    # FedALA's weight learning and FedDBE's initial period and feature bias (at kappa 1: 50 diverges on tiny runs).
    "fedala": ("train.balanced_loss=ce",), "feddbe": ("train.balanced_loss=ce", "train.head_params={kl_weight: 1}"),
}


@pytest.fixture
def no_tf32():
    """No TF32 in this process (cuDNN's convolutions use it by default on Ampere and later): the GPU computes
    in float32 as the CPU does."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("method", IN_PROCESS_METHODS)
def test_an_in_process_round_on_cuda_matches_the_cpu_round(method, one_torch_thread, no_tf32):
    """Each round of the in-process runtime with its clients on CUDA against a CPU round from the same state
    (as the Ray test above, and with the same bounds): the shared weights and the method's server state (a
    hypernetwork, embeddings, optimiser moments) within 1e-5 of each tensor's largest value plus 1e-5 of the
    value, but for a few entries of PeFLL's Adam-trained server (below); the metrics within one test prediction."""
    overrides = IN_PROCESS_METHODS[method]
    if method != "scaffold":
        overrides = (f"train.head={method}", *overrides)
    setup = prepare(short_config(*overrides, "runtime.device=cuda"))
    host = make_host(setup, setup.cfg.runtime.device)
    assert {p.device.type for p in host.model.parameters()} == {"cuda"}
    gpu = Federation(setup, InProcessExecutor(host), log=lambda s: None)
    cpu_setup = prepare(short_config(*overrides))
    cpu = Federation(cpu_setup, InProcessExecutor(make_host(cpu_setup)), log=lambda s: None)
    tolerance = one_prediction(cpu_setup)
    # Two Adam steps' most apart: each at most lr (1 - beta1) / sqrt(1 - beta2) with PyTorch's betas.
    adam_most = 2 * setup.cfg.train.head_params["server_lr"] * 0.1 / 0.001 ** 0.5 if method == "pefll" else 0.0
    for r in range(2):
        cpu.restore(gpu.snapshot())
        a, b = gpu.step(r), cpu.step(r)
        assert a["clients_done"] == b["clients_done"] == a["clients"] and a["clients_failed"] == 0
        for name, ours, theirs in (("shared", gpu.global_shared, cpu.global_shared),
                                   ("method", gpu.method_state, cpu.method_state),
                                   ("server", gpu.server_state, cpu.server_state)):
            assert set(ours) == set(theirs), name
            for k, v in theirs.items():
                if not torch.is_floating_point(v):
                    assert torch.equal(ours[k].cpu(), v), (name, k)
                    continue
                diff = (ours[k].cpu() - v).abs()
                off = diff > 1e-5 * (v.abs().max() + v.abs())
                # Adam (PeFLL's server) divides each entry's first moment by the root of its second: for an entry
                # whose gradient is rounding noise both are noise, and its step anything an Adam step can be.
                assert int(off.sum()) <= 1e-4 * v.numel(), (r + 1, name, k, int(off.sum()), float(diff.max()))
                if off.any():
                    assert name == "method" and float(diff[off].max()) <= adam_most, (r + 1, k, float(diff.max()))
        for key, most in tolerance.items():
            assert abs(a[key] - b[key]) <= most + 1e-12, (r + 1, key, a[key], b[key], most)
