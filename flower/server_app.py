"""The ServerApp: fedrod-ray's run (``lifecycle.run.Run``: rounds, metrics, checkpoints, ``final/``) whose
clients train on the SuperNodes (``executor.FlowerExecutor``).

Its run config (``flwr run ... --run-config``): ``config``, the fedrod-ray config file on the server's machine;
``run-dir``, the run directory, which ``fedrod-ray serve`` serves from once it has a ``final/`` and from whose
newest checkpoint a restarted ServerApp resumes; ``min-nodes``, the SuperNodes to wait for before the first
round; ``timeout``, the seconds a SuperNode has to answer a message; ``secure-aggregation`` and the
``secagg-*`` settings, SecAgg+ of the shared part (``secure``). The server reads the config's test set and the
clients' class counts (the partition), never their training images.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedrod_ray.config import ConfigError, check_resume, load_config
from fedrod_ray.drivers.console import format_record
from fedrod_ray.federation_state.checkpoint import latest_checkpoint_name, load_checkpoint
from fedrod_ray.federation_state.setup import Setup, prepare
from fedrod_ray.lifecycle.run import Run
from fedrod_ray.objectives import meta_per_class
from fedrod_ray.outputs.lock import exclusive_run_dir
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.personalization import build_method
from fedrod_ray.round_loop.federation import Federation

from .executor import FlowerExecutor
from .secure import SecureFederation, settings_from

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
    if model.variant == "linear" or build_method(t.head, t.head_params).personal_keys(model):
        # The PM's global reading and final/ read phi_m; a split model's GM is the mean of its personal layers.
        raise ConfigError(f"train.head: {t.head}'s server side reads the clients' personal parts (the PM's "
                          "global reading, its generic model or final/'s heads), which on Flower stay on the "
                          "SuperNodes")


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
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
        setup = prepare(cfg)
        check_flower(setup)
        executor = FlowerExecutor(grid, cfg, float(rc["timeout"]), context=context)
        federation = (Federation(setup, executor) if secagg is None else
                      SecureFederation(setup, executor, secagg))
        executor.wait_for_nodes(int(rc["min-nodes"]), float(rc["timeout"]))
        run = Run(federation, storage, snapshot)
        run.train(lambda record: print(format_record(record, run.rounds), flush=True))
