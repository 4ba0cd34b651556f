"""``SimConfig``: the settings of a ``swarm-sim`` rehearsal, and the run it trains (``build_run``).

Both sim drivers (``sim`` for data-parallel peers, ``pipeline_sim`` for pipeline stages) read it; the
flags of ``swarm-sim`` are derived from its fields.

Example::

    from lab.simconfig import SimConfig, build_run
    run = build_run(SimConfig(peers=3, steps=8, model_size="tiny"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lab.localswarm import FAST_MEMBERSHIP
from lab.wanlab import LinkSpec
from protocols.errors import SwarmError
from swarm.config import RunConfig

PRESETS = {
    "demo": {},  # the built-in demo model
    "small": {"d_model": 128, "n_layer": 2, "n_head": 4, "seq_len": 128},
    "tiny": {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 32},
}


class SimConfig(BaseModel):
    """A local rehearsal of a run; the flags of ``swarm-sim`` come from these fields."""

    model_config = ConfigDict(extra="forbid")

    peers: int = Field(3, ge=1, le=64, description="volunteer processes to start")
    gpu_peers: int = Field(
        0, ge=0, le=64, description="how many of the peers join with --gpu (the others with --cpu)"
    )
    steps: int = Field(20, ge=1, le=100_000, description="global training steps to run")
    churn: bool = Field(False, description="kill a peer outright and restart it during the run")
    fresh_interpreters: bool = Field(
        False,
        description="start the coordinator and each peer as a fresh interpreter, as on volunteers' machines "
        "(each with its own hash seed), instead of forking them from the sim's fork server (faster, "
        "less memory)",
    )
    join_over: float = Field(
        0.0, ge=0, le=3600,
        description="start the peers one after another, evenly over this many seconds (0: all join paused "
        "and start training together)",
    )  # fmt: skip
    json_path: Path | None = Field(
        None, description="write the results as JSON here", json_schema_extra={"cli_flag": "--json"}
    )
    model_size: Literal["demo", "small", "tiny"] = Field(
        "demo", description="demo: the built-in GPT; small/tiny: faster"
    )
    target_batch_size: int = Field(32, ge=1, le=100_000, description="samples per global step")
    micro_batch_size: int = Field(4, ge=1, le=4096, description="samples per local forward/backward")
    sync: Literal["every_step", "diloco"] = Field(
        "every_step",
        description="every_step: average gradients every step; diloco: --inner-steps local steps per "
        "averaged outer step (--steps counts outer steps)",
    )
    inner_steps: int = Field(50, ge=1, le=100_000, description="diloco: local optimizer steps per outer step")
    outer_overlap: bool = Field(
        False, description="diloco: average in the background and apply each outer step one step late"
    )
    window_stretch: float = Field(
        2.0, ge=1.0, le=100.0,
        description="diloco: a done peer trains on while slower ones finish, up to this many times "
        "--inner-steps; 1: every window is exactly --inner-steps (the same samples in every run); a run "
        "whose validators replay windows (fp32, not topk, no overlap, sender checks on) uses 1",
    )  # fmt: skip
    compression: Literal["fp16", "none", "int8", "topk"] = Field(
        "fp16", description="wire encoding of what peers average (topk: sparse, with error feedback)"
    )
    outer_lr: float | None = Field(
        None, gt=0, le=10, description="diloco: outer learning rate (default: the run's, see docs/diloco.md)"
    )
    outer_momentum: float | None = Field(
        None, ge=0, lt=1, description="diloco: outer Nesterov momentum, 0 for plain SGD (default: the run's)"
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="the run's forward/backward precision (fp16 needs every peer on a GPU)"
    )
    activation_checkpointing: bool = Field(
        False, description="every peer joins with --activation-checkpointing"
    )
    lr: float = Field(
        1e-3, gt=0, le=1, description="peak learning rate (2e-3 made the demo model spike right after warmup)"
    )
    timeout_s: float = Field(900.0, ge=10, le=86_400, description="give up after this many seconds")
    keep: bool = Field(
        False,
        description="keep the logs, checkpoints and data dirs afterwards (a failed run always keeps them)",
        json_schema_extra={"cli_flag": "--keep-logs"},
    )
    stages: int = Field(0, ge=0, le=8, description="pipeline stages (SWARM); 0: data-parallel peers only")
    peers_per_stage: int = Field(2, ge=1, le=8, description="stage servers per pipeline stage")
    trainers: int = Field(2, ge=1, le=8, description="pipeline trainers that stream micro-batches")
    kill_stage_peer_at: int | None = Field(
        None, ge=0, description="kill one server of the last pipeline stage outright at this step"
    )
    replace_into_stage: int | None = Field(
        None, ge=0, le=7,
        description="the stage the killed server's replacement joins (default: the killed server's stage); "
        "another stage leaves the killed one short, so the swarm must rebalance",
    )  # fmt: skip
    stage_verify_probability: float | None = Field(
        None, ge=0, le=1, description="pipeline.verify_probability: share of micro-batches a trainer checks "
        "at a second replica (default: the run's, 0.05)",
    )  # fmt: skip
    byzantine: int = Field(0, ge=0, le=15, description="how many peers play the attacker named by --attack")
    attack: str | None = Field(
        None,
        max_length=256,
        description="the attack the --byzantine peers mount (with --stages: a comma-separated list, K peers each)",
    )
    protocol_attack: str | None = Field(
        None, max_length=256,
        description="protocol attacks (comma-separated, or 'all') that a stock hivemind.DHT with no "
        "certificate mounts on the run's DHT and state servers every second",
    )  # fmt: skip
    aggregator: str | None = Field(
        None, max_length=64, description="aggregation rule for the run (default: the run's, centered_clip)"
    )
    verify_probability: float = Field(
        0.5, ge=0, le=1, description="chance that a part of a round is recomputed by a drawn validator"
    )
    sender_check_probability: float = Field(
        0.25, ge=0, le=1,
        description="chance that a validator also recomputes a drawn sender's contribution from its public "
        "batch seeds (every_step, and diloco windows with a fresh inner optimizer); with the sim's "
        "verify_probability about one replayed step (or window) in eight, five times the run's defaults",
    )  # fmt: skip
    replay_outliers: bool = Field(
        True,
        description="validators also replay a sender whose input to a checked chunk stands out from the "
        "others' (training.replay_outliers)",
    )
    min_group_size: int | None = Field(
        None, ge=1, le=4096,
        description="training.min_group_size (default: max(2f + 1, peers - f) with --byzantine f: every "
        "group holds an honest majority; a rehearsal with fewer than 3f + 1 peers that bans its attackers "
        "then stalls, and needs peers - f here; with --max-group-size: 2f + 1, or the run's 1)",
    )  # fmt: skip
    max_group_size: int | None = Field(
        None, ge=2, le=1024,
        description="training.max_group_size (default: the run's, 64); set it to rehearse more peers than "
        "one group holds",
    )  # fmt: skip
    relay_fanout: int | None = Field(
        None, ge=1, le=64,
        description="training.relay_fanout (default: the run's, 4): members each member passes the step's "
        "combined result on to; 1 relays it down a chain",
    )  # fmt: skip
    wan: str | None = Field(
        None,
        max_length=64,
        description="run the coordinator and each peer in its own network namespace on a link capped by the "
        "kernel, e.g. up=20mbit,down=100mbit (needs root; see lab/wanlab.py)",
    )
    nat: int = Field(
        0, ge=0, le=16, description="how many peers (the last ones) sit behind NAT; implies the lab"
    )

    @field_validator("wan")
    @classmethod
    def _link_spec(cls, wan: str | None) -> str | None:
        if wan is not None:
            try:
                LinkSpec.parse(wan)
            except SwarmError as e:
                raise ValueError(str(e)) from None
        return wan

    @field_validator("gpu_peers")
    @classmethod
    def _gpu_peers_are_peers(cls, gpu_peers: int, info: ValidationInfo) -> int:
        peers = info.data.get("peers")
        if peers is not None and gpu_peers > peers:
            raise ValueError(f"{gpu_peers} is more than --peers ({peers})")
        return gpu_peers

    @field_validator("protocol_attack")
    @classmethod
    def _known_protocol_attacks(cls, names: str | None) -> str | None:
        from swarm.byzantine.protocol_attacks import protocol_attack_names

        unknown = [
            n for n in (names or "").split(",") if n and n != "all" and n not in protocol_attack_names()
        ]
        if unknown:
            raise ValueError(
                f"unknown protocol attack {unknown[0]!r}; known: {', '.join(protocol_attack_names())}"
            )
        return names

    @field_validator("attack")
    @classmethod
    def _known_attack(cls, attack: str | None) -> str | None:
        from swarm.byzantine.attacks import attack_names

        for name in attack.split(",") if attack is not None else []:  # several only with --stages
            if name not in attack_names():
                raise ValueError(f"unknown attack {name!r}; known: {', '.join(attack_names())}")
        return attack

    @model_validator(mode="after")
    def _lab_fits(self) -> SimConfig:
        if self.nat > self.peers:
            raise ValueError(f"--nat {self.nat} is more than --peers ({self.peers})")
        if (self.max_group_size or 4096) < (self.min_group_size or 1):
            raise ValueError(
                f"--min-group-size {self.min_group_size} is more than --max-group-size {self.max_group_size}"
            )
        if self.join_over and self.stages:
            raise ValueError("--join-over rehearses data-parallel peers; it does not apply with --stages yet")
        if self.replace_into_stage is not None and (
            self.kill_stage_peer_at is None or self.replace_into_stage >= self.stages
        ):
            raise ValueError(
                f"--replace-into-stage {self.replace_into_stage} needs --kill-stage-peer-at and a stage "
                f"below --stages {self.stages}"
            )
        if self.stages and (self.wan or self.nat):
            raise ValueError(
                "--wan and --nat rehearse data-parallel peers; they do not apply with --stages yet"
            )
        return self

    @model_validator(mode="after")
    def _attackers_are_a_minority(self) -> SimConfig:
        if self.byzantine and self.attack is None:
            raise ValueError("--byzantine needs --attack NAME")
        if self.attack is not None and "," in self.attack and not self.stages:
            raise ValueError(f"--attack {self.attack}: a list of attacks is for a pipeline run (--stages)")
        if 2 * self.byzantine >= self.peers:
            raise ValueError(f"--byzantine {self.byzantine} must be fewer than half of --peers {self.peers}")
        return self


def samples_per_step(config: SimConfig) -> int:
    """Samples in one completed step of the run: the target batch, or in diloco mode every peer's full
    window of inner steps (an outer step in which a slower peer brought fewer counts as full)."""
    if config.sync == "diloco":
        return config.peers * config.inner_steps * config.micro_batch_size
    return config.target_batch_size


def parse_outer_optimizer(text: str) -> tuple[float, float]:
    """``"1:0"`` -> (outer lr 1, outer momentum 0); the momentum may be left out (0). ValueError if not."""
    lr, _, momentum = text.partition(":")
    return float(lr), float(momentum or 0)


def min_group_size(config: SimConfig) -> int:
    """The rehearsal's ``training.min_group_size``: --min-group-size, else every peer in every round (one
    may be missing while churn restarts it), else with --max-group-size the run's own default; with
    attackers, every group must hold an honest majority (2f + 1 peers at least), and the honest peers
    alone must reach the minimum: bans never lower it (see TrainingPeer._round). With fewer than 3f + 1
    peers both cannot hold: --min-group-size chooses."""
    if config.min_group_size is not None:
        return config.min_group_size
    floor = 2 * config.byzantine + 1 if config.byzantine else 1
    if config.max_group_size is not None:
        return min(floor, config.max_group_size)
    return max(floor, config.peers - config.byzantine - (1 if config.churn else 0))


def build_run(config: SimConfig) -> RunConfig:
    steps = config.steps
    # The inner learning-rate schedule of diloco counts inner steps.
    optimizer_steps = steps * config.inner_steps if config.sync == "diloco" else steps
    outer = {}
    if config.outer_lr is not None:
        outer["lr"] = config.outer_lr
    if config.outer_momentum is not None:
        outer.update(momentum=config.outer_momentum, nesterov=config.outer_momentum > 0)
    return RunConfig(
        run_id="swarm-sim",
        **({"outer_optimizer": outer} if outer else {}),
        description="A local rehearsal of the demo run.",
        model={"name": "gpt", "config": PRESETS[config.model_size]},
        dataset={"name": "stdlib", "config": {}},
        optimizer={"lr": config.lr, "warmup_steps": min(5, optimizer_steps), "total_steps": optimizer_steps},
        training={
            "target_batch_size": config.target_batch_size, "micro_batch_size": config.micro_batch_size,
            "precision": config.precision, "sync": config.sync, "inner_steps": config.inner_steps,
            "outer_overlap": config.outer_overlap, "window_stretch": config.window_stretch,
            "compression": config.compression,
            "max_steps": steps, "matchmaking_time_s": 1.5, "progress_interval_s": 0.3,
            "min_group_size": min_group_size(config),
            **({"max_group_size": config.max_group_size} if config.max_group_size else {}),
            **({"relay_fanout": config.relay_fanout} if config.relay_fanout else {}),
            "verify_probability": config.verify_probability,
            "sender_check_probability": config.sender_check_probability,
            "replay_outliers": config.replay_outliers,
            **({"aggregator": config.aggregator} if config.aggregator else {}),
            "validation_every_steps": max(1, steps // 4), "checkpoint_every_steps": max(1, steps // 2),
        },
        membership=FAST_MEMBERSHIP,
    )  # fmt: skip
