"""The ServerApp: fedrod-ray's run (``lifecycle.run.Run``: rounds, metrics, checkpoints, ``final/``) whose
clients train on the SuperNodes (``executor.FlowerExecutor``).

Its run config (``flwr run ... --run-config``): ``config``, the fedrod-ray config file on the server's machine;
``run-dir``, the run directory, which ``fedrod-ray serve`` serves from once it has a ``final/`` and from whose
newest checkpoint a restarted ServerApp resumes; ``min-nodes``, the SuperNodes to wait for before the first
round; ``timeout``, the seconds a SuperNode has to answer a message; ``secure-aggregation`` and the
``secagg-*`` settings, SecAgg+ of the shared part (``secure``); on Flower's simulation engine only,
``sim-data-path`` and ``sim-state-path``, where the simulated SuperNodes' data and states are
(``node.node_paths``). The server reads the config's test set and the clients' class counts (the partition),
never their training images.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid

from fedrod_ray.config import ConfigError, check_resume, load_config
from fedrod_ray.drivers.console import format_record
from fedrod_ray.federation_state.checkpoint import latest_checkpoint_name, load_checkpoint
from fedrod_ray.federation_state.setup import Setup
from fedrod_ray.lifecycle.run import Run
from fedrod_ray.objectives import meta_per_class
from fedrod_ray.outputs.lock import exclusive_run_dir
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.personalization import build_method
from fedrod_ray.round_loop.federation import Federation

from .executor import RUNTIME
from .node import SIM_DATA, SIM_STATE
from .secure import check_secure, settings_from

app = ServerApp()


def check_flower(setup: Setup) -> None:
    """What the Flower runtime does not do, as ConfigErrors naming the field."""
    cfg, t = setup.cfg, setup.cfg.train
    if cfg.rounds.mode == "fedbuff":
        raise ConfigError("rounds.mode: fedbuff is not supported on Flower (its clients arrive one at a time); "
                          "use sync or deadline")
    if meta_per_class(t):
        raise ConfigError(f"train.balanced_loss: {t.balanced_loss} learns against a meta set of the clients' "
                          "training data that the server holds; on Flower that data stays on the SuperNodes")
    model = setup.build_model()
    method = build_method(t.head, t.head_params)
    if method.pm_from_global and method.starts_from_local_model:
        # FedALA's PM blends the latest global weights into the client's own last model with its own weights W.
        raise ConfigError(f"train.head: {t.head}'s PM is made at evaluation from the latest global weights and the "
                          "client's own last model and state, which the server would send together; on Flower "
                          "those stay on the SuperNodes")
    if model.variant == "linear" or method.personal_keys(model):
        # The PM's global reading and final/ read phi_m; a split model's GM is the mean of its personal layers;
        # GPFL's, FedCP's and FedDBE's PM is made on the server from the latest global weights and the client's
        # readout.
        raise ConfigError(f"train.head: {t.head}'s server side reads the clients' personal parts (the PM's "
                          "global reading, its generic model, the PM it makes from the latest global weights or "
                          "final/'s heads), which on Flower stay on the SuperNodes")


def check_simulation(run_config: Mapping, simulation: bool) -> None:
    """``sim-data-path`` and ``sim-state-path`` are set on Flower's simulation engine (whose grid is in memory)
    and nowhere else: a deployed SuperNode's node config names its own paths. The states stay out of the run
    directory, which holds nothing personal."""
    given = [key for key in (SIM_DATA, SIM_STATE) if run_config.get(key, "")]
    if not simulation:
        if given:
            raise ConfigError(f"run config {given[0]}: has no effect on Flower's deployment engine (each "
                              "SuperNode's node config names its data-path and state-path)")
        return
    for key in (SIM_DATA, SIM_STATE):
        if key not in given:
            raise ConfigError(f"run config {key}: Flower's simulation engine needs {SIM_DATA} (the folder "
                              f"python -m fedrod_ray_flower.split wrote) and {SIM_STATE} (where the simulated "
                              "SuperNodes keep their clients' states)")
    state, run_dir = Path(str(run_config[SIM_STATE])).resolve(), Path(str(run_config["run-dir"])).resolve()
    if state == run_dir or run_dir in state.parents:
        raise ConfigError(f"run config {SIM_STATE}: must be outside run-dir ({run_dir}), which holds nothing "
                          "personal")


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    check_simulation(rc, isinstance(grid, InMemoryGrid))
    secagg = settings_from(rc)
    storage = RunStorage(str(rc["run-dir"]))
    # One writer per run directory, as for `fedrod-ray train`: a second ServerApp on it stops at once.
    with exclusive_run_dir(storage):
        cfg, snapshot = load_config(str(rc["config"])), None
        if latest_checkpoint_name(storage) is not None:
            snapshot = load_checkpoint(storage)
            check_resume(snapshot.config, cfg, snapshot.rounds_done)
            print(f"resuming {storage.uri} after round {snapshot.rounds_done}", flush=True)
        cfg.run_dir = storage.uri
        setup = RUNTIME.prepare(cfg)
        check_flower(setup)
        if secagg is not None:
            check_secure(setup)
        setup, executor = RUNTIME.start(setup, grid=grid, timeout=float(rc["timeout"]), context=context,
                                        secagg=secagg)
        federation = Federation(setup, executor)
        executor.wait_for_nodes(int(rc["min-nodes"]), float(rc["timeout"]))
        run = Run(federation, storage, snapshot)
        run.train(lambda record: print(format_record(record, run.rounds), flush=True))
