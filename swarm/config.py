"""The typed definition of a collaborative run, and its TOML form.

``RunConfig`` is what an organizer writes (in Python or ``run.toml``) and what the coordinator hands to
every peer that joins (``to_spec``: the same config minus admission secrets). Every field is validated;
a bad file gets a ``ConfigError`` naming the field and the allowed values.

Example::

    from swarm import RunConfig
    config = RunConfig(run_id="my-run", admission={"policy": "token", "join_token": "s3cret"})
    config.to_toml("run.toml")
    assert RunConfig.from_toml("run.toml") == config
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocols.errors import ConfigError, ProtocolError
from protocols.keys import PublicKey

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEMO_RUN_ID = "demo"


class _Section(BaseModel):
    """Base of every section of a run config: unknown keys are refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_peer_id(value: str, field: str) -> str:
    try:
        PublicKey.from_peer_id(value)
    except ProtocolError as e:
        raise ValueError(f"{field}: {e}") from None
    return value


class AdmissionConfig(_Section):
    """Who may join the run."""

    policy: Literal["open", "allowlist", "token"] = Field(
        "open", description="open: anyone; allowlist: only the listed peer IDs; token: anyone with join_token"
    )
    allowlist: list[str] = Field(
        default_factory=list, description="peer IDs admitted under policy 'allowlist'"
    )
    join_token: str | None = Field(None, repr=False, description="shared secret for policy 'token'")

    @field_validator("allowlist")
    @classmethod
    def _peer_ids(cls, values: list[str]) -> list[str]:
        return [_check_peer_id(v, "allowlist") for v in values]

    @model_validator(mode="after")
    def _policy_needs_its_field(self) -> AdmissionConfig:
        if self.policy == "allowlist" and not self.allowlist:
            raise ValueError("policy 'allowlist' needs a non-empty allowlist")
        if self.policy == "token" and not self.join_token:
            raise ValueError("policy 'token' needs join_token")
        return self


class MembershipConfig(_Section):
    """How peers prove they are alive, and how long admission lasts."""

    heartbeat_interval_s: float = Field(
        5.0, ge=0.1, le=300, description="seconds between a peer's heartbeats"
    )
    offline_after_s: float = Field(
        15.0, ge=0.3, le=3600, description="silence after which a peer shows offline"
    )
    certificate_ttl_s: float = Field(
        3600.0, ge=10, le=7 * 86400, description="lifetime of a peer certificate"
    )
    challenge_ttl_s: float = Field(60.0, ge=1, le=600, description="how long a join challenge stays valid")

    @model_validator(mode="after")
    def _offline_after_heartbeats(self) -> MembershipConfig:
        if self.offline_after_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("offline_after_s must exceed two heartbeat intervals")
        return self


class OptimizerConfig(_Section):
    """The optimizer every peer applies, identically, to the averaged gradient."""

    name: Literal["adamw", "adam", "sgd", "lamb", "lars"] = Field(
        "adamw", description="optimizer algorithm; lamb and lars adapt each layer's step for large batches"
    )
    lr: float = Field(1e-3, gt=0, le=10, description="peak learning rate")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam and LAMB betas")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD and LARS momentum")
    weight_decay: float = Field(
        0.01, ge=0, le=1, description="decoupled weight decay (adamw, lamb, lars) or L2 (adam, sgd)"
    )
    eps: float = Field(1e-6, gt=0, le=1, description="LAMB's term added to the root of the second moment")
    max_trust_ratio: float = Field(
        10.0, gt=0, le=1e4, description="LAMB and LARS clamp each layer's trust ratio to [0, this]"
    )
    trust_coefficient: float = Field(
        0.001, gt=0, le=1, description="LARS: eta in eta * ||w|| / (||g|| + weight_decay * ||w||)"
    )
    grad_clip_norm: float | None = Field(
        1.0, gt=0, description="clip the averaged gradient to this norm; none: off"
    )
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="learning rate schedule")
    warmup_steps: int = Field(10, ge=0, le=10**7, description="linear warmup from 0 to lr")
    total_steps: int = Field(
        1000, ge=1, le=10**9, description="steps over which cosine/linear decay to min_lr"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr")

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class OuterOptimizerConfig(_Section):
    """DiLoCo's outer optimizer: Nesterov SGD on the averaged pseudo-gradient (``training.sync = "diloco"``).

    The defaults are the DiLoCo paper's (arXiv:2311.08105). Its momentum is part of the state every peer
    holds bit for bit, and a late joiner downloads it with the synced parameters.
    """

    lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="outer momentum")
    nesterov: bool = Field(True, description="Nesterov momentum (needs momentum > 0)")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterOptimizerConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        return self


def _lax_bool(value: Any) -> bool:
    """``value`` as the bool field it is meant for would read it (false if it reads none: that field's own
    validation names the bad value)."""
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False


# The outer optimizer of a topk or outer_overlap run that names none (RunConfig._plain_outer_defaults).
PLAIN_OUTER_OPTIMIZER = {"lr": 1.0, "momentum": 0.0, "nesterov": False}


class TrainingConfig(_Section):
    """How peers accumulate, average and checkpoint."""

    target_batch_size: int = Field(
        256, ge=1, le=10**8, description="samples per global step, across all peers"
    )
    micro_batch_size: int = Field(8, ge=1, le=65536, description="samples per local forward/backward")
    seed: int = Field(0, ge=0, lt=2**63, description="seed of the initial weights, the same on every peer")
    compression: Literal["fp16", "none", "int8", "topk"] = Field(
        "fp16",
        description="encoding of tensors on the wire: fp16, none (fp32), int8 (one scale per chunk) or topk "
        "(sparse: the largest topk_density of each block of 4096 values, int8); see swarm/averaging/compression.py",
    )
    topk_density: float = Field(
        0.01,
        gt=0,
        le=1,
        description="topk: the share of each block's values a sender keeps (largest magnitude)",
    )
    topk_feedback_decay: float = Field(
        0.95,
        ge=0,
        le=1,
        description="topk: what the wire left out of a peer's last contribution is scaled by this before its "
        "next pseudo-gradient is added (error feedback with decay, SparseLoCo's beta; 1: no decay)",
    )
    aggregator: str = Field(
        "centered_clip",
        min_length=1,
        max_length=64,
        description="rule each reducer applies to its part: centered_clip, trimmed_mean, coordinate_median, mean",
    )
    aggregator_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of the aggregator (e.g. tau, iterations, bucket_size); see docs/robustness.md",
    )
    verify_probability: float = Field(
        0.25, ge=0, le=1, description="chance that a part of a round is recomputed by a drawn validator"
    )
    sender_check_probability: float = Field(
        0.1,
        ge=0,
        le=1,
        description="chance that a validator also recomputes one drawn sender's contribution to the chunk it "
        "checked from the public batch seeds (swarm.training.sendercheck): every_step, and diloco windows "
        "with a fresh inner optimizer in fp32, a dense codec and no outer_overlap; 0 for a run whose "
        "peers train on their own data",
    )
    replay_outliers: bool = Field(
        True,
        description="with sender checks on, a validator also replays (at most once a round) a sender whose "
        "input to the chunk it checked stands out from the others' by its cosine with their coordinate "
        "median, its norm or its signed weight (swarm.averaging.scores), drawn or not",
    )
    sender_check_tolerance: float | None = Field(
        None,
        ge=0,
        le=1,
        description="largest relative L2 distance between a sender's chunk and its recomputation that is "
        "not a lie: rounding of other device kinds (the same kind recomputes it bit for bit); default "
        "0.01 in fp32, 0.05 in bf16",
    )
    max_group_size: int = Field(64, ge=1, le=1024, description="peers in one averaging group")
    min_group_size: int = Field(1, ge=1, le=1024, description="a round needs this many peers; fewer wait")
    relay_fanout: int = Field(
        4, ge=1, le=64,
        description="beyond one group: members each member passes the step's combined result on to "
        "(a tree; docs/scale.md)",
    )  # fmt: skip
    matchmaking_time_s: float = Field(
        2.0, ge=0.1, le=300, description="how long peers gather before averaging"
    )
    averaging_timeout_s: float = Field(30.0, ge=1, le=3600, description="deadline of one all-reduce round")
    sender_timeout_s: float = Field(5.0, ge=0.1, le=600, description="drop a groupmate silent for this long")
    progress_interval_s: float = Field(0.5, ge=0.05, le=60, description="how often peers publish progress")
    max_steps: int | None = Field(None, ge=1, description="stop training after this many global steps")
    checkpoint_every_steps: int = Field(50, ge=1, le=10**7, description="coordinator checkpoint period")
    # Peers that outnumber the honest reporters for a while (two Sybils beside one honest peer) move the
    # verified step, and so credit, no faster than this. Every step is a round of matchmaking and
    # all-reduce over the network; this project's tiny test runs reach about 2.3 steps/s on 2 CPU cores.
    max_verified_steps_per_s: float = Field(
        10.0, ge=0.001, le=1000,
        description="fastest the coordinator's verified step (and so credit) advances; set near the run's pace",
    )  # fmt: skip
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="how many checkpoints the coordinator keeps")
    validation_every_steps: int = Field(
        10, ge=1, le=10**7, description="peers report validation loss this often"
    )
    validation_batches: int = Field(4, ge=1, le=1000, description="fixed validation batches per evaluation")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="forward/backward compute dtype (autocast; fp16 adds loss scaling and needs a GPU); "
        "weights, optimizer state and the averaged gradient stay fp32",
    )
    sync: Literal["every_step", "diloco"] = Field(
        "every_step",
        description="every_step: average the gradient of every global step; diloco: each peer takes "
        "inner_steps local optimizer steps, then peers average the pseudo-gradient (an outer step)",
    )
    inner_steps: int = Field(
        50, ge=1, le=10**6, description="diloco: local optimizer steps (one micro-batch each) per outer step"
    )
    outer_overlap: bool = Field(
        False,
        description="diloco: average an outer step's pseudo-gradient in the background while the next inner "
        "steps compute, and apply it one outer step late",
    )
    inner_optimizer_state: Literal["keep", "reset"] | None = Field(
        None,
        description="diloco: keep the inner optimizer's state from window to window, or start every window "
        "with a fresh one, so that a window is a function of public facts that validators can replay; "
        "default: reset where the run checks senders (fp32, a dense codec, no outer_overlap), else keep",
    )
    window_stretch: float = Field(
        2.0,
        ge=1.0,
        le=100.0,
        description="diloco: a peer whose window is done trains on while slower peers finish theirs, up to "
        "this many times inner_steps; 1: every window is exactly inner_steps (the same samples in every run "
        "of a comparison, whatever the peers' speeds); a run whose validators replay windows uses 1",
    )

    @property
    def round_s(self) -> float:
        """The longest one round takes at the run's window: a matchmaking window plus the all-reduce's
        deadline. A peer whose rounds failed for longer is stalled. (A search whose window widened after
        failed searches, ``Averager.matchmaking_window_s``, may take up to ``averaging_timeout_s`` itself:
        a peer waiting that long counts as stalled the sooner, which only lets it look for a catch-up.)"""
        return self.matchmaking_time_s + self.averaging_timeout_s


class PipelineConfig(_Section):
    """SWARM pipeline parallelism: the model split into stages, each served by several unreliable peers.

    With ``stages = 1`` (the default) the run is data-parallel and nothing here applies.
    """

    stages: int = Field(1, ge=1, le=64, description="stages the model is split into (1: no pipeline)")
    layer_split: list[int] | None = Field(
        None,
        description="transformer blocks per stage, first to last (default: as even as possible); "
        "the first stage also holds the embedding and the last the head",
    )
    request_timeout_s: float = Field(
        10.0, ge=0.1, le=600, description="a trainer gives up on one forward or backward call after this long"
    )
    forward_state_ttl_s: float = Field(
        60.0, ge=1, le=3600, description="a server drops a micro-batch's forward state after this long"
    )
    max_inflight_microbatches: int = Field(
        2, ge=1, le=64, description="micro-batches one trainer keeps in flight at once"
    )
    max_attempts: int = Field(
        20, ge=1, le=1000, description="tries of one micro-batch before its trainer pauses it and waits"
    )
    failed_server_cooldown_s: float = Field(
        5.0, ge=0, le=3600, description="a trainer avoids a server that failed it for this long"
    )
    announce_interval_s: float = Field(
        0.5, ge=0.05, le=60, description="how often stage servers and trainers announce themselves"
    )
    rebalance_interval_s: float = Field(
        30.0, ge=1, le=86400, description="how often a stage server considers moving to the bottleneck stage"
    )
    rebalance_margin: float = Field(
        0.2, ge=0, le=10, description="a move must raise the bottleneck's throughput by this fraction"
    )
    ban_after_bad_requests: int = Field(
        20, ge=1, le=10**6, description="a server bans a caller after this many malformed requests"
    )
    max_grad_output_norm: float = Field(
        1000.0, gt=0, le=1e12,
        description="a server refuses a trainer's gradient for one micro-batch with a larger L2 norm "
        "(about 1 at initialization for the built-in gpt; the bound stops scaled-up gradients)",
    )  # fmt: skip
    verify_probability: float = Field(
        0.05, ge=0, le=1,
        description="share of micro-batches a trainer repeats at a second replica of one stage to check "
        "its answer (each check costs one stage's forward and backward again: about p/stages of the compute)",
    )  # fmt: skip
    kept_states: int = Field(
        2, ge=0, le=8,
        description="past steps whose state a stage replica keeps (one copy of the stage's state in host "
        "memory each) so that the coordinator can judge evidence of a step the stage has moved past",
    )  # fmt: skip
    verify_tolerance: float = Field(
        0.0, ge=0, le=1e3,
        description="largest difference two replicas' answers may show (0: bit-equal, for one device kind; "
        "raise it for replicas on mixed device kinds)",
    )  # fmt: skip

    @field_validator("layer_split")
    @classmethod
    def _split_matches_stages(cls, split: list[int] | None, info: ValidationInfo) -> list[int] | None:
        stages = info.data.get("stages")
        if split is None or stages is None:
            return split
        if len(split) != stages:
            raise ValueError(f"lists {len(split)} stages but pipeline.stages is {stages}")
        if any(n < 0 for n in split):
            raise ValueError("entries must be non-negative block counts")
        if any(n == 0 for n in split[1:-1]):
            raise ValueError("every middle stage needs at least one block")
        return split


class ComponentSpec(_Section):
    """A named component from a registry plus its config dict: nothing executable crosses the network."""

    name: str = Field(min_length=1, max_length=64, description="registered name")
    config: dict[str, Any] = Field(default_factory=dict, description="keyword config for the component")


class RunConfig(_Section):
    """A collaborative run: what is trained, on what data, and who may take part."""

    run_id: str = Field(
        pattern=RUN_ID_PATTERN, description="unique name of the run; every signature is bound to it"
    )
    description: str = Field("", max_length=1000, description="free text shown to volunteers")
    coordinator_key: str | None = Field(
        None, description="peer ID of the coordinator's key; peers that read this config pin it"
    )
    model: ComponentSpec = Field(
        default_factory=lambda: ComponentSpec(name="gpt"), description="architecture from the model registry"
    )
    dataset: ComponentSpec = Field(
        default_factory=lambda: ComponentSpec(name="stdlib"), description="dataset from the dataset registry"
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="optimizer and schedule")
    outer_optimizer: OuterOptimizerConfig = Field(
        default_factory=OuterOptimizerConfig, description="diloco's outer optimizer (training.sync = diloco)"
    )
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="accumulation and averaging")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="who may join")
    membership: MembershipConfig = Field(
        default_factory=MembershipConfig, description="liveness and admission"
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="pipeline stages (SWARM); 1 stage: data-parallel"
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_outer_defaults(cls, data: Any) -> Any:
        """In a topk or an outer_overlap run the outer optimizer's defaults are plain SGD at lr 1. topk
        (SparseLoCo): the decaying error feedback already carries momentum, and the DiLoCo defaults
        (Nesterov, momentum 0.9) on top of undecayed feedback diverged on the small model. outer_overlap:
        momentum 0.9 on pseudo-gradients that land one window late overshoots, 1.45x every_step's loss
        after 8 windows of H = 100 against 1.12x with plain SGD (docs/diloco.md, "Recipes"). Fields the
        config names win."""
        if not isinstance(data, dict):
            return data
        training = data.get("training")
        compression = training.get("compression") if isinstance(training, dict) else None
        overlap = _lax_bool(training.get("outer_overlap")) if isinstance(training, dict) else False
        if isinstance(training, TrainingConfig):
            compression, overlap = training.compression, training.outer_overlap
        named = data.get("outer_optimizer", {})
        if (compression != "topk" and not overlap) or not isinstance(named, dict):
            return data
        return {**data, "outer_optimizer": {**PLAIN_OUTER_OPTIMIZER, **named}}

    @model_validator(mode="after")
    def _compression_fits_the_sync(self) -> RunConfig:
        compression = self.training.compression
        if compression == "topk" and self.training.sync != "diloco":
            raise ValueError(
                "training.compression 'topk' needs training.sync 'diloco' (its error feedback lives in the "
                "diloco trainer; every_step would lose what the wire leaves out)"
            )
        if compression in ("int8", "topk") and self.pipeline.stages > 1:
            raise ValueError(
                f"training.compression {compression!r} applies to data-parallel averaging; pipeline stages "
                "average with fp16 or none"
            )
        return self

    @model_validator(mode="after")
    def _sender_checks_can_replay(self) -> RunConfig:
        """A run whose validators replay senders' contributions (``training.sender_check_probability``)
        must train what anyone can replay: no dropout (it draws from each process's own random state),
        and not fp16, whose loss scale is each peer's own and which the coordinator's CPU cannot run."""
        training = self.training
        if not sender_checks_on(self):
            return self
        why = "; or set training.sender_check_probability = 0"
        if training.precision == "fp16":
            raise ValueError(
                "training.precision 'fp16' cannot be replayed by the coordinator's CPU (and its loss scale is "
                f"each peer's own); validators replay senders' contributions: use bf16 or fp32{why}"
            )
        for key, value in self.model.config.items():
            if is_dropout_key(key) and isinstance(value, int | float) and value:
                raise ValueError(
                    f"model.config.{key} = {value}: dropout draws from each process's own random state, so "
                    f"validators could not replay a sender's contribution from its public seeds; set it to 0{why}"
                )
        return self

    @field_validator("coordinator_key")
    @classmethod
    def _coordinator_key(cls, value: str | None) -> str | None:
        return None if value is None else _check_peer_id(value, "coordinator_key")

    @classmethod
    def demo(cls) -> RunConfig:
        """The built-in demo run: a small byte-level GPT on the Python standard library's source."""
        return cls(
            run_id=DEMO_RUN_ID,
            description="A small GPT-style byte-level LM trained on the Python standard library's source text.",
        )

    @classmethod
    def parse(cls, data: dict[str, Any], *, source: str = "run config") -> RunConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"{source}: " + _describe(e)) from None

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise ConfigError(f"cannot read run config {path}: {e.strerror or e}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        return cls.parse(data, source=str(path))

    def to_toml(self, path: str | Path) -> None:
        # TOML has no null: a None anywhere means "the default", which is what leaving the key out says.
        Path(path).write_text(tomli_w.dumps(_drop_none(self.model_dump(mode="json"))))

    def to_spec(self) -> dict[str, Any]:
        """The part of the config sent to every peer: everything but admission secrets."""
        return self.model_dump(mode="json", exclude={"admission"}, exclude_none=True)


def sender_checks_on(run: RunConfig) -> bool:
    """Whether validators replay drawn senders' contributions (``swarm.training.sendercheck``): data-parallel
    training with both probabilities above 0 (pipeline stages check replicas instead), every step, or
    diloco whose windows anyone can replay (``replayable_windows``)."""
    training = run.training
    if run.pipeline.stages != 1 or training.sender_check_probability <= 0 or training.verify_probability <= 0:
        return False
    return training.sync == "every_step" or replayable_windows(training)


def replayable_windows(training: TrainingConfig) -> bool:
    """Whether a diloco window is a function of public facts alone (the synced state at the outer step, the
    run's dataset, the peer's batch seeds), so that validators can replay it."""
    return training.sync == "diloco" and window_replay_obstacle(training) is None


def window_replay_obstacle(training: TrainingConfig) -> str | None:
    """Why a diloco window is not a function of public facts alone that a replay tells from a lie, or None."""
    if training.sender_check_probability <= 0 or training.verify_probability <= 0:
        return "the run draws no validators (sender_check_probability or verify_probability is 0)"
    obstacle = _window_obstacle(training)
    if obstacle is None and not resets_inner_state(training):
        return "inner_optimizer_state 'keep' carries each peer's own optimizer state into its windows"
    return obstacle


def _window_obstacle(training: TrainingConfig) -> str | None:
    if training.compression == "topk":
        return "topk's error feedback is each peer's own"
    if training.outer_overlap:
        return "with outer_overlap a window starts from the end of the peer's own last one"
    if training.precision != "fp32":
        # Adam's first steps from a fresh state move each weight by about lr times the sign of its
        # gradient, so a rounding flip of a small gradient's sign grows over the window: 0.18 relative
        # L2 after 50 bf16 steps between one split of a micro-batch and another (tolerance 0.05).
        return f"{training.precision} rounding grows over a window's inner steps past what a replay can tell from a lie"
    return None


def resets_inner_state(training: TrainingConfig) -> bool:
    """Whether a diloco window starts with a fresh inner optimizer: the run's ``inner_optimizer_state``;
    by default where the run checks senders and the window could be replayed (dense, fp32, no overlap)."""
    if training.inner_optimizer_state is not None:
        return training.inner_optimizer_state == "reset"
    return (
        training.sender_check_probability > 0
        and training.verify_probability > 0
        and _window_obstacle(training) is None
    )


def window_stretch(training: TrainingConfig) -> float:
    """How far past ``inner_steps`` a diloco peer trains while slower ones finish: the run's
    ``window_stretch``, but 1 where validators replay windows (``replayable_windows``), so that a sender
    cannot claim a window longer than the run's and make its replay as long as it likes."""
    return 1.0 if replayable_windows(training) else training.window_stretch


def sender_tolerance(training: TrainingConfig) -> float:
    """The largest relative distance of a sender's chunk from its replay that is not a lie: the run's
    ``sender_check_tolerance``, else 0.01 in fp32 and 0.05 in bf16 (other device kinds round there)."""
    if training.sender_check_tolerance is not None:
        return training.sender_check_tolerance
    return 0.01 if training.precision == "fp32" else 0.05


def is_dropout_key(key: str) -> bool:
    """Whether a model config field named ``key`` is a dropout rate (``dropout``, ``resid_pdrop``...)."""
    return key.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate"))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "config"
        got = item.get("input")
        shown = "" if isinstance(got, (dict, list)) or item["type"] == "missing" else f" (got {got!r})"
        parts.append(f"{field}: {item['msg']}{shown}")
    return "; ".join(parts)
