"""Settings of a volunteer peer; the flags of ``swarm-peer join`` are derived from these fields."""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocols.errors import SwarmError
from swarm.config import RUN_ID_PATTERN
from swarm.identity import DEFAULT_IDENTITY


class PeerConfig(BaseModel):
    """How to take part in a run."""

    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(description="coordinator address HOST:PORT")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="where to compute; auto picks a usable GPU, else the CPU",
        json_schema_extra={"cli_aliases": {"--gpu": "gpu", "--cpu": "cpu"}},
    )
    name: str = Field(
        default_factory=lambda: socket.gethostname()[:64] or "peer",
        min_length=1,
        max_length=64,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="display name shown to the organizer (default: host name)",
    )
    identity: Path = Field(DEFAULT_IDENTITY, description="key file; created with mode 0600 if missing")
    role: Literal["auto", "data", "stage", "trainer"] = Field(
        "auto",
        description="what this peer does: data-parallel training (data), host a pipeline stage (stage), "
        "stream micro-batches through the stages (trainer); auto: data, or in a pipeline run the stage most "
        "short of throughput",
    )
    stage: int | None = Field(
        None, ge=0, le=63, description="pipeline stage to host (default: the one most short of throughput)"
    )
    run_id: str | None = Field(
        None, pattern=RUN_ID_PATTERN, description="run to join (default: the coordinator's)"
    )
    coordinator_key: str | None = Field(
        None, description="peer ID of the coordinator's key, to trust no other (default: pin on first join)"
    )
    join_token: str | None = Field(None, description="the run's join token (or set SWARM_JOIN_TOKEN)")
    host: str = Field("0.0.0.0", description="address the DHT and the averaging data port listen on")
    port: int = Field(0, ge=0, le=65535, description="DHT (libp2p) port (0: any free port)")
    data_port: int = Field(
        0, ge=0, le=65535, description="TCP port for averaging data from groupmates (0: any free port)"
    )
    public_host: str | None = Field(
        None, max_length=253, description="address groupmates dial for averaging data (default: detected)"
    )
    upnp: bool = Field(False, description="ask the router to forward the DHT port (UPnP)")
    dialable: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="whether other peers can connect to this machine; auto: the coordinator dials back at "
        "join; a peer that cannot be dialed (behind NAT) never leads an averaging group",
    )
    known_coordinators: Path = Field(
        Path("~/.swarm/known_coordinators.json"), description="where pinned coordinator keys are kept"
    )
    join_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="give up joining after this many seconds"
    )
    rpc_timeout_s: float = Field(10.0, gt=0, le=300, description="timeout of one call to the coordinator")
    max_retry_interval_s: float = Field(30.0, ge=1, le=3600, description="longest wait between retries")
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
    leave_when_finished: bool = Field(
        True,
        description="leave and exit 0 once the coordinator says the run finished; --no-leave-when-finished "
        "keeps serving the final state until stopped (rehearsals that read every peer's end state)",
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
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="log verbosity")
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

    @field_validator("coordinator")
    @classmethod
    def _host_port(cls, address: str) -> str:
        from swarm.coordinator_client import parse_address

        try:
            parse_address(address)
        except SwarmError as e:
            raise ValueError(str(e)) from None
        return address

    @field_validator("name")
    @classmethod
    def _printable_text(cls, name: str) -> str:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("name must be valid UTF-8 text") from None
        return name

    @field_validator("rehearse_attack")
    @classmethod
    def _known_attack(cls, name: str | None) -> str | None:
        from swarm.byzantine.attacks import attack_names

        if name is not None and name not in attack_names():
            raise ValueError(f"unknown attack {name!r}; known: {', '.join(attack_names())}")
        return name

    @property
    def identity_path(self) -> Path:
        return self.identity.expanduser()


def peer_fields(*names: str) -> dict[str, Any]:
    """``PeerConfig``'s fields ``names`` (type, default, bounds, description, flag aliases) as
    ``pydantic.create_model`` takes them, for another ``swarm-peer`` command acting on the same settings."""
    fields = PeerConfig.model_fields
    return {name: (fields[name].annotation, copy.deepcopy(fields[name])) for name in names}
