"""Settings of the coordinator process (the run itself is a ``swarm.config.RunConfig``)."""

from __future__ import annotations

from pathlib import Path

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
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="log verbosity")

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()

    @property
    def identity_path(self) -> Path:
        return (self.identity or self.data_dir / "identity.key").expanduser()
