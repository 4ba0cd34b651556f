"""Settings of a volunteer peer; the flags of ``swarm-peer join`` are derived from these fields."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from swarm.session import SessionConfig


class PeerConfig(SessionConfig):
    """How to take part in a run: how to join it (``SessionConfig``) and how to compute in it."""

    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="where to compute; auto picks a usable GPU, else the CPU",
        json_schema_extra={"cli_aliases": {"--gpu": "gpu", "--cpu": "cpu"}},
    )
    stage: int | None = Field(
        None, ge=0, le=63, description="pipeline stage to host (default: the one most short of throughput)"
    )
    data_port: int = Field(
        0, ge=0, le=65535, description="TCP port for averaging data from groupmates (0: any free port)"
    )
    public_host: str | None = Field(
        None, max_length=253, description="address groupmates dial for averaging data (default: detected)"
    )
    max_cpu_threads: int | None = Field(
        None, ge=1, le=1024, description="CPU threads torch may use (default: all)"
    )
    max_gpu_memory: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="GiB of GPU memory torch may hold (default: all); running out turns on activation "
        "checkpointing, then halves the micro-batch, instead of ending the peer",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each model block's activations in backward: less memory, about one more "
        "forward pass of compute",
    )
    max_upload_mbps: float | None = Field(
        None, gt=0, le=1_000_000, description="megabits per second this peer may send (default: no limit)"
    )
    status_interval_s: float = Field(
        30.0, ge=1, le=3600, description="seconds between status lines when stdout is not a terminal"
    )
    round_journal: Path | None = Field(
        None,
        description="append one JSON line per averaging round tried and state downloaded to this file "
        "(swarm-sim reads it; see swarm/journal.py)",
    )
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="log verbosity")
    start_paused: bool = Field(
        False,
        description="join and serve, but compute nothing until `swarm-peer resume` (SIGUSR2); a rehearsal "
        "starts all its peers' training at once this way",
    )
    rehearse_attack: str | None = Field(
        None,
        max_length=64,
        description="REHEARSAL ONLY: behave as this named attacker (see docs/robustness.md), to test a run",
    )
    rehearse_attackers: int = Field(
        1, ge=1, le=1024, description="rehearsal: how many attackers collude (for alie and ipm)"
    )
    rehearse_group_size: int = Field(
        2, ge=2, le=1024, description="rehearsal: the averaging group size the attackers expect"
    )

    @field_validator("rehearse_attack")
    @classmethod
    def _known_attack(cls, name: str | None) -> str | None:
        from swarm.byzantine.attacks import attack_names

        if name is not None and name not in attack_names():
            raise ValueError(f"unknown attack {name!r}; known: {', '.join(attack_names())}")
        return name


def peer_fields(*names: str) -> dict[str, Any]:
    """``PeerConfig``'s fields ``names`` (type, default, bounds, description, flag aliases) as
    ``pydantic.create_model`` takes them, for another ``swarm-peer`` command acting on the same settings."""
    fields = PeerConfig.model_fields
    return {name: (fields[name].annotation, copy.deepcopy(fields[name])) for name in names}
