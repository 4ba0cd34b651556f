"""Settings of the coordinator process (the run itself is a ``swarm.config.RunConfig``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_PORT = 31330
DEFAULT_DHT_PORT = 31331


class CoordinatorConfig(BaseModel):
    """How to run a coordinator node; the CLI flags of ``swarm-coordinator start`` come from these fields."""

    model_config = ConfigDict(extra="forbid")

    config: Path | None = Field(None, description="run config TOML; without it, the built-in demo run")
    host: str = Field("0.0.0.0", description="address to serve gRPC and the DHT on")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="gRPC port (0: any free port)")
    dht_port: int = Field(
        DEFAULT_DHT_PORT, ge=0, le=65535, description="DHT (libp2p) port (0: any free port)"
    )
    data_dir: Path = Field(Path("~/.swarm/coordinator"), description="where the store and endpoint file live")
    identity: Path | None = Field(None, description="coordinator key file (default: DATA_DIR/identity.key)")
    upnp: bool = Field(False, description="ask the router to forward the DHT port (UPnP)")
    dashboard_port: int | None = Field(
        None, ge=0, le=65535, description="serve the web dashboard, /api/status and /metrics on this port"
    )
    dashboard_host: str | None = Field(None, description="address the dashboard listens on (default: --host)")
    history_interval_s: float = Field(
        5.0, ge=0.1, le=3600, description="how often the run's loss, throughput and peers are recorded"
    )
    log_to: Literal["none", "wandb", "tensorboard"] = Field(
        "none", description="also log the run's metrics to wandb or tensorboard (must be installed)"
    )
    log_dir: Path | None = Field(
        None, description="where tensorboard or wandb write their files (default: DATA_DIR/logs)"
    )
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="log verbosity")

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()

    @property
    def log_path(self) -> Path:
        return (self.log_dir or self.data_dir / "logs").expanduser()

    @property
    def identity_path(self) -> Path:
        return (self.identity or self.data_dir / "identity.key").expanduser()
