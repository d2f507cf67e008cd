"""The experiment config's schema: one pydantic dataclass per section, strict types with their ranges as
field constraints, and the choices of each string field (``OneOf``); ``config_schema`` in ``loading`` is
the same as a JSON Schema."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool, StrictStr
from pydantic.dataclasses import dataclass

from ..specs.datasets import DATASET_PLUGINS, DATASETS, USER_DATASETS
from ..specs.losses import LOSSES, MetaBSMConfig
from ..specs.methods import HEADS, hyper_hidden
from ..specs.models import ARCHS, INITS, MODEL_PLUGINS
from ..specs.rules import RULES
from .values import (
    CLOSED,
    Fraction,
    Int,
    NonNegativeFloat,
    NonNegativeInt,
    OneOf,
    PositiveFloat,
    PositiveInt,
    number,
    section,
)

# --- the config's own choices (a plug-in's names are its spec's: fedrod_ray.specs) ------------------------

STEPS = ("eager", "compiled")  # train.step (fedrod_ray.client_update.step)
# train.momentum_buffers: what a client's SGD momentum buffers do between the rounds it trains in, which the
# paper does not say. "reset": a new optimiser per local update, buffers from zero (the usual FedAvg reading,
# and every version before this switch); "keep": the client keeps the buffers of the parameters it trains, and
# its next local update continues them (only the weights come from the server).
MOMENTUM_BUFFERS = ("reset", "keep")
PARTITIONS = ("dirichlet", "iid", "natural")  # natural: the clients the data itself names
MODES = ("auto", "local", "ray")
# privacy.sampling: how a private run picks a round's clients, as its accountant assumes (docs/privacy.md).
# poisson: each client joins with probability train.client_fraction, independently; fixed: exactly
# round(client_fraction * clients) of them, drawn without replacement.
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")  # privacy.accountant: Renyi DP, or privacy loss distributions (Poisson only)
# privacy.mechanism: the server noises the sum (central), or each participant of Flower's SecAgg+ noises its own
# share in the integers before masking (distributed_dgauss: the distributed discrete Gaussian)
MECHANISMS = ("central", "distributed_dgauss")
# rounds.mode (docs/rounds.md): sync waits for every sampled client; deadline over-selects and drops the clients
# that miss the deadline; fedbuff is buffered asynchronous aggregation (a server step every K arrivals).
ROUND_MODES = ("sync", "deadline", "fedbuff")
SPEEDS = ("lognormal", "pareto", "constant", "trace")  # rounds.speeds: the clients' speeds (fedrod_ray.timing.clock)
STALENESS = ("sqrt", "constant")  # rounds.staleness: a FedBuff update's weight, 1/sqrt(1 + s) or 1


# --- the experiment ---------------------------------------------------------------------------------------


@dataclass(config=CLOSED)
class DataConfig:
    # A built-in set, the user's own (folder, arrays: under data.path) or one a package registers.
    dataset: Annotated[StrictStr, OneOf(DATASETS + USER_DATASETS, DATASET_PLUGINS)] = "mnist"
    data_dir: StrictStr | None = None  # else $FEDROD_DATA_DIR, else the user cache dir
    # folder: a directory of train/<class>/*.png|jpg, test/<class>/... (natural: clients/<id>/<class>/..., and
    # optionally clients/<id>/test/<class>/... instead of test/); arrays: an .npz of x_train, y_train, x_test,
    # y_test (optional class_names, client_train, client_test)
    path: StrictStr | None = None
    download: StrictBool = True
    num_clients: PositiveInt = 100  # training clients
    new_clients: NonNegativeInt = 0  # extra held-out clients that never train (zero-shot evaluation)
    partition: Annotated[StrictStr, OneOf(PARTITIONS)] = "dirichlet"
    alpha: PositiveFloat = 0.1
    # The paper's split gives each client what its Dirichlet draws give it; > 0 tops small clients up to
    # this many examples (earlier versions: 10), which changes Dir(0.1) splits and never Dir(0.3) FMNIST's.
    min_per_client: NonNegativeInt = 0
    # Inputs as (x / 255 - mean) / std with the dataset's per-channel statistics (false: x / 255). The paper
    # says "inputs normalised" for CIFAR and nothing for (F)MNIST.
    normalize: StrictBool = True
    imbalance_ratio: PositiveFloat = 1.0  # >1: exponentially long-tailed global data before partitioning
    synthetic_train_per_class: PositiveInt = 600
    synthetic_test_per_class: PositiveInt = 100


@dataclass(config=CLOSED)
class ModelConfig:
    # auto: from the dataset; a built-in, a registered plug-in's name, or package.module:factory, a callable
    # that takes the input shape (C, H, W) and returns an nn.Module mapping N x C x H x W to N x d features
    arch: Annotated[StrictStr, OneOf(("auto",) + ARCHS, MODEL_PLUGINS)] = "auto"
    hyper_hidden: PositiveInt | None = None  # train.head=hyper only; None: the paper's (32 for CIFAR-10, else 16)
    init: Annotated[StrictStr, OneOf(INITS)] = "normal"  # initial weights (see INITS)


@dataclass(config=CLOSED)
class TrainConfig:
    # The personalization method: Fed-RoD's own (none: one head, linear: phi_m, hyper: H(a_m; nu)), or a
    # personalized-FL baseline (see `fedrod-ray list`)
    head: Annotated[StrictStr, OneOf(tuple(HEADS))] = "linear"
    head_params: dict[StrictStr, Any] = field(default_factory=dict)  # the method's hyperparameters, e.g. {lam: 0.1}
    balanced_loss: Annotated[StrictStr, OneOf(tuple(LOSSES))] = "bsm"  # the generic head's loss
    gamma: NonNegativeFloat | None = None  # the losses with a gamma only (Meta-BSM: gamma_m's initial value); None: 1.0
    meta_bsm: Annotated[MetaBSMConfig, BeforeValidator(section)] = field(default_factory=MetaBSMConfig)
    generic_rule: Annotated[StrictStr, OneOf(tuple(RULES))] = "fedavg"
    rule_params: dict[StrictStr, Any] = field(default_factory=dict)  # the rule's hyperparameters, e.g. {mu: 0.01}
    rounds: PositiveInt = 100
    client_fraction: Fraction = 0.2
    local_epochs: PositiveInt = 5
    batch_size: PositiveInt = 40
    lr: PositiveFloat = 0.01
    lr_decay: PositiveFloat = 0.99  # multiplied into lr once per round
    momentum: NonNegativeFloat = 0.9
    momentum_buffers: Annotated[StrictStr, OneOf(MOMENTUM_BUFFERS)] = "reset"  # see MOMENTUM_BUFFERS
    weight_decay: NonNegativeFloat = 1e-5
    augment: StrictBool | None = None  # None: the dataset's default (on for CIFAR)
    # How a mini-batch's losses run (fedrod_ray.client_update.step): compiled is torch.compile, slower on CPU
    step: Annotated[StrictStr, OneOf(STEPS)] = "eager"


@dataclass(config=CLOSED)
class EvalConfig:
    eval_every: PositiveInt = 1
    batch_size: PositiveInt = 1000
    # Between exact evaluations: every round, the P-FL estimate (the *_est metrics) of the GM and of each
    # client's PM on a fixed, seeded, class-stratified sample of this many test images; 0: none.
    estimate_size: NonNegativeInt = 0
    # At the last round's evaluation: k epochs of fine-tuning on each held-out new client's own data, starting
    # from the global model (hyper: with its zero-shot head), then its P-FL (pfl_new_after); 0: none.
    finetune_epochs: NonNegativeInt = 0
    finetune_train: StrictBool = False  # fine-tune every training client that way too (pfl_ft: the FT baseline)
    # P-FL over a sample of this many training clients, fixed by the seed, with 95% intervals (pfl_*_ci), for
    # federations too large to evaluate every client's PM; 0: every client (exact)
    clients: NonNegativeInt = 0
    # false: no evaluation after the last round unless eval_every falls on it (a sweep trial, a benchmark)
    at_end: StrictBool = True


@dataclass(config=CLOSED)
class RuntimeConfig:
    # auto: ray where Ray is (inside a Ray job, with RAY_ADDRESS set, or with an address), else local
    mode: Annotated[StrictStr, OneOf(MODES)] = "auto"  # local: in-process
    address: StrictStr | None = None  # ray only: None starts a private local Ray, "auto" joins a running cluster
    # In-process: None (auto) chosen for the load average when the run starts (fedrod_ray.drivers.threads), 0
    # torch's default (a thread per core); Ray: an actor's CPUs unless set
    torch_threads: NonNegativeInt | None = None
    device: StrictStr = "cpu"  # in-process only; Ray actors use a GPU when their resources hold one
    # in-process only: 0 trains a round's clients one after another; k > 0 trains up to k of them at once in
    # one batched computation (fedrod_ray.client_update.batched; for a GPU: on CPU it is slower)
    batched_clients: NonNegativeInt = 0
    clients_per_actor: NonNegativeInt = 0  # 0: sized from the cluster's resources
    client_resources: dict[StrictStr, NonNegativeFloat] = field(default_factory=lambda: {"num_cpus": 1.0})
    max_restarts: NonNegativeInt = 3
    # ray only: how often the driver starts the coordinator actor again, from the last checkpoint, when it dies
    # mid-run (killed, its process lost); 0: the run stops, saying how to --resume it
    coordinator_restarts: NonNegativeInt = 3
    min_clients_per_round: PositiveInt = 1
    max_failed_fraction: Annotated[float, Field(strict=True, ge=0, le=1), BeforeValidator(number)] = 0.5
    checkpoint_every: PositiveInt = 1
    # Client states kept in memory between rounds, the most recently used; the others are read from the client
    # store on disk (the checkpoint's client files) when needed. 0: none, only the round's own clients are.
    client_cache: NonNegativeInt = 1000
    # data.dataset=sites only: how long a round whose sampled clients are all at sites with no live node waits for
    # one to come back before the run stops; 0: it stops at once
    site_wait_s: NonNegativeFloat = 0.0
    progress_seconds: NonNegativeFloat = 30.0  # not on a terminal: a progress line inside a round at most this often


@dataclass(config=CLOSED)
class AdaptiveClipConfig:
    """Adaptive clipping (Andrew et al., 2021), ``privacy.adaptive_clip``: after every round the clip norm C
    moves geometrically towards the ``target_quantile`` of the clients' update norms, read from a noised count
    of the updates it did not clip: C <- C exp(-learning_rate (b~ - target_quantile))."""

    target_quantile: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(number)] = 0.5
    learning_rate: PositiveFloat = 0.2  # eta_C, the paper's geometric step
    # sigma_b, the standard deviation of the count's noise; None: the paper's, expected clients per round / 20
    count_noise: PositiveFloat | None = None


@dataclass(config=CLOSED)
class PrivacyConfig:
    """Client-level differential privacy, central model (DP-FedAvg, McMahan et al., 2018; docs/privacy.md):
    each update to the shared weights clipped on its client, Gaussian noise on their sum on the server."""

    enabled: StrictBool = False
    noise_multiplier: NonNegativeFloat | None = None  # sigma: noise std over the clip norm; None: from target_epsilon
    # The budget at privacy.delta. Without noise_multiplier, sigma is derived from it, the sampling rate and
    # train.rounds before the run starts; with one, the run stops before the round that would exceed it.
    target_epsilon: PositiveFloat | None = None
    delta: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(number)] = 1e-5
    clip_norm: PositiveFloat = 1.0  # S: the L2 norm each client's update is clipped to (adaptive: the first)
    sampling: Annotated[StrictStr, OneOf(SAMPLINGS)] = "poisson"  # see SAMPLINGS
    adaptive_clip: AdaptiveClipConfig | None = None  # None: the clip norm stays S
    # false: the records and logs say nothing of which clients a round sampled (no failed_ids, unavailable_ids,
    # virtual clock; "a sampled client" for an id), as the accountant's amplification by sampling assumes.
    # true: they do, and the run's log says that the epsilon then does not hold against their readers
    disclose_sampling: StrictBool = False
    # None: the noise and the client sampling come from the OS's CSPRNG (not reproducible). An integer: both
    # seeded (the noise by (noise_seed, round), the sampling by (seed, round)), reproducible, for experiments
    # only: not private against anyone who knows the seeds, which config.yaml holds.
    noise_seed: NonNegativeInt | None = None
    accountant: Annotated[StrictStr, OneOf(ACCOUNTANTS)] = "rdp"
    mechanism: Annotated[StrictStr, OneOf(MECHANISMS)] = "central"  # see MECHANISMS
    # distributed_dgauss only: the bits per coordinate of the integer ring the participants' shares are summed in
    # (the modulus 2^bits); None: 16
    bits: Annotated[int, Field(strict=True, ge=8, le=30)] | None = None
    # distributed_dgauss only (required): the fewest participants whose noise a round's sum holds (SecAgg+'s
    # reconstruction threshold at most); each adds 1 / min_participants of the noise's variance
    min_participants: PositiveInt | None = None
    # distributed_dgauss only: the most participants in a sum (their noise sets the grid); None: min_participants
    max_participants: PositiveInt | None = None


@dataclass(config=CLOSED)
class RoundsConfig:
    """How a round runs, timed on a virtual clock (docs/rounds.md): each client's local update takes its
    examples x train.local_epochs over its speed (examples per second), plus the model's trip at
    ``bandwidth``; the records count that simulated time (``virtual_time``) while the computation runs as
    fast as it can. Each mode's settings are errors in the others."""

    mode: Annotated[StrictStr, OneOf(ROUND_MODES)] = "sync"  # see ROUND_MODES
    speeds: Annotated[StrictStr, OneOf(SPEEDS)] = "lognormal"  # each client's speed, fixed by the seed (or a trace)
    speed: PositiveFloat = 100.0  # examples/s: lognormal's median, pareto's fastest, constant's (not trace)
    sigma: PositiveFloat = 1.0  # lognormal only: the standard deviation of log(speed)
    shape: PositiveFloat = 1.5  # pareto only: the tail index of the slowdown speed / speed_m (heavier when smaller)
    trace: StrictStr | None = None  # trace only: a text file of speeds (examples/s), one a line, cycled over clients
    bandwidth: PositiveFloat | None = None  # MB/s each way for the model's trip; None: communication is free
    deadline: PositiveFloat | None = None  # deadline only (required): virtual seconds a round waits for clients
    over_selection: NonNegativeFloat = 0.3  # deadline only: samples ceil((1 + this) * clients per round)
    buffer_size: PositiveInt = 10  # fedbuff only: K, the arrivals per server step
    concurrency: PositiveInt | None = None  # fedbuff only: clients in flight; None: train.client_fraction's count
    staleness: Annotated[StrictStr, OneOf(STALENESS)] = "sqrt"  # fedbuff only: an update's weight (STALENESS)
    server_lr: PositiveFloat = 1.0  # fedbuff only: the server step's learning rate


# Experiment trackers a run can log to (fedrod_ray.outputs.tracking; `pip install -e ".[tracking]"`).
LOGGERS = ("tensorboard", "mlflow")


@dataclass(config=CLOSED)
class SiteConfig:
    """A site (``sites``, with ``data.dataset: sites``; docs/sites.md): Ray nodes started with the label
    fedrod.site=<name>, the data that lives there, and the store that keeps its clients' state there."""

    # the site: its nodes carry the Ray label fedrod.site=<name> (letters, digits, ".", "_", "-")
    name: Annotated[StrictStr, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    # The site's clients as its nodes see them: clients/<client>/<class>/*.png|jpg (optionally
    # clients/<client>/test/<class>/..., every client's own test set) or clients/<client>.npz (x_train, y_train,
    # optionally x_test, y_test)
    path: StrictStr
    # Where the site keeps its clients' state (a path its nodes share, or an s3:// / gs:// URI); None:
    # <path>/.fedrod/<name of the run>
    store: StrictStr | None = None
    data_cache: PositiveInt = 8  # clients' data each of the site's actors keeps in memory, the most recently used


@dataclass(config=CLOSED)
class TrackingConfig:
    # Each round's metrics, the config as hyperparameters, the final metrics (MLflow: and final/ as an
    # artifact): tensorboard into <run_dir>/tensorboard, mlflow into mlflow_uri. Empty: no tracking.
    loggers: list[StrictStr] = field(default_factory=list)
    mlflow_uri: StrictStr | None = None  # an MLflow tracking URI; None: a local store, <run_dir>/mlruns


@dataclass(config=CLOSED)
class ExperimentConfig:
    """A fedrod-ray experiment: ``fedrod-ray train --config FILE``. Every key may be left out (its default)."""

    name: StrictStr = "fedrod"
    seed: Int = 0
    run_dir: StrictStr | None = None  # default runs/<name>
    data: Annotated[DataConfig, BeforeValidator(section)] = field(default_factory=DataConfig)
    model: Annotated[ModelConfig, BeforeValidator(section)] = field(default_factory=ModelConfig)
    train: Annotated[TrainConfig, BeforeValidator(section)] = field(default_factory=TrainConfig)
    eval: Annotated[EvalConfig, BeforeValidator(section)] = field(default_factory=EvalConfig)
    runtime: Annotated[RuntimeConfig, BeforeValidator(section)] = field(default_factory=RuntimeConfig)
    tracking: Annotated[TrackingConfig, BeforeValidator(section)] = field(default_factory=TrackingConfig)
    privacy: Annotated[PrivacyConfig, BeforeValidator(section)] = field(default_factory=PrivacyConfig)
    rounds: Annotated[RoundsConfig, BeforeValidator(section)] = field(default_factory=RoundsConfig)
    # data.dataset=sites only: where the clients live (docs/sites.md); empty: the data is read by the driver
    sites: list[SiteConfig] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def hyper_hidden(self) -> int:
        """The hypernetwork's hidden width: as set, else the paper's for the dataset."""
        return self.model.hyper_hidden if self.model.hyper_hidden is not None else hyper_hidden(self.data.dataset)
