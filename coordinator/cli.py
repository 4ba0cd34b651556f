"""``swarm-coordinator``: start a coordinator node, show a run's status, ban or unban a peer.

Examples::

    swarm-coordinator start --config run.toml --port 31330
    swarm-coordinator status --coordinator 127.0.0.1:31330 --json
    swarm-coordinator ban 12D3KooW... --data-dir ~/.swarm/coordinator --reason "sent NaN gradients"
"""

from __future__ import annotations

import swarm.procenv  # noqa: F401  # isort: skip  (before grpc loads: see its docstring)

import argparse
import asyncio
import json
import sqlite3
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coordinator.config import CoordinatorConfig
from coordinator.datadir import STORE_FILE
from coordinator.store import ban_sync, unban_sync
from protocols import coordinator_pb2 as pb
from protocols.errors import ConfigError, ProtocolError, SwarmError
from protocols.keys import PublicKey
from swarm import runtime
from swarm.cliargs import add_config_arguments, config_from_args
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient, parse_address


class StatusConfig(BaseModel):
    """Settings of ``swarm-coordinator status``."""

    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(description="coordinator address HOST:PORT")
    as_json: bool = Field(
        False, description="print machine-readable JSON", json_schema_extra={"cli_flag": "--json"}
    )
    timeout_s: float = Field(10.0, gt=0, le=300, description="give up after this many seconds")

    @field_validator("coordinator")
    @classmethod
    def _host_port(cls, address: str) -> str:
        if not address.startswith("unix:/"):
            try:
                parse_address(address)
            except SwarmError as e:
                raise ValueError(str(e)) from None
        return address


class BanConfig(BaseModel):
    """Settings of ``swarm-coordinator ban`` and ``unban``."""

    model_config = ConfigDict(extra="forbid")

    peer_id: str = Field(description="peer ID to ban or unban")
    data_dir: Path = Field(Path("~/.swarm/coordinator"), description="the coordinator's data dir")
    reason: str = Field("banned by the organizer", max_length=256, description="why (shown to the peer)")


async def _start(config: CoordinatorConfig) -> None:
    # Imported here, not at the top: the node pulls in hivemind and torch (seconds), which `--help`,
    # `status` and a mistyped flag should not wait for.
    from coordinator.node import CoordinatorNode

    run = RunConfig.from_toml(config.config) if config.config else RunConfig.demo()
    stop = runtime.stop_event_on_signals()
    node = CoordinatorNode(config, run)
    await node.start()
    print(f"coordinator of run {run.run_id!r} listening on {node.address}", flush=True)
    if node.dashboard is not None:
        print(f"dashboard: {node.dashboard.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await node.stop()


async def _fetch_status(config: StatusConfig) -> dict:
    async with CoordinatorClient(config.coordinator, timeout_s=config.timeout_s) as client:
        return status_to_dict(await client.full_status())


def status_to_dict(status: pb.StatusResponse) -> dict:
    """The JSON form of a status answer (``swarm-coordinator status --json``)."""
    return {
        "run_id": status.run_id,
        "protocol_version": status.protocol_version,
        "coordinator_peer_id": status.coordinator_peer_id,
        "dht_initial_peers": list(status.dht_initial_peers),
        "server_time": status.server_time,
        "total_peers": status.total_peers,
        "max_steps": status.max_steps or None,
        "checkpoint_step": status.checkpoint_step or None,
        "finished_step": status.finished_step or None,
        "peers": [
            {
                "peer_id": p.peer_id,
                "name": p.name,
                "state": p.state,
                "device": p.device,
                "role": p.role,
                "last_seen": p.last_seen,
                "joined_at": p.joined_at,
                "ban_reason": p.ban_reason,
                "metrics": dict(p.metrics),
                "step": p.step,
                "param_hash": p.param_hash,
                "diverged": p.diverged,
            }
            for p in status.peers
        ],
    }


def run_progress(status: dict) -> str:
    """One line on where the run stands: its newest checkpoint, its limit, and whether it has finished."""
    if status.get("finished_step"):
        return f"FINISHED at step {status['finished_step']} (final checkpoint saved)"
    limit = f" of max_steps {status['max_steps']}" if status.get("max_steps") else ""
    return f"newest checkpoint: step {status.get('checkpoint_step') or 'none'}{limit}"


def _more_pages(status: dict) -> str:
    total = status.get("total_peers") or 0
    return f" of {total}" if total > len(status["peers"]) else ""


def format_status(status: dict) -> str:
    lines = [
        f"run {status['run_id']!r}  coordinator {status['coordinator_peer_id']}",
        f"DHT initial peers: {' '.join(status['dht_initial_peers'])}",
        run_progress(status),
        f"{len(status['peers'])} peers" + _more_pages(status) + ":",
    ]
    now = status["server_time"]
    for p in status["peers"]:
        seen = f"{max(0.0, now - p['last_seen']):.0f}s ago"
        extra = f"  ({p['ban_reason']})" if p["ban_reason"] else ""
        extra += "  DIVERGED" if p.get("diverged") else ""
        step = f"step {p.get('step', 0)}"
        # The hash's first 12 hex digits tell peers on different parameters apart at a glance.
        params = f"params {p['param_hash'][:12]}" if p.get("param_hash") else "params -"
        lines.append(
            f"  {p['peer_id']}  {p['name'][:20]:20}  {p['state']:8} {p['device'][:20]:20} {step:10} {params:19} "
            f"{seen}{extra}"
        )
    return "\n".join(lines)


def _ban(config: BanConfig, *, unban: bool) -> str:
    try:
        PublicKey.from_peer_id(config.peer_id)
    except ProtocolError as e:
        raise ConfigError(str(e)) from None
    path = config.data_dir.expanduser() / STORE_FILE
    if not path.is_file():
        raise ConfigError(f"no coordinator store at {path}; pass the coordinator's --data-dir")
    db = sqlite3.connect(path, timeout=10)
    try:
        if unban:
            return (
                f"unbanned {config.peer_id}"
                if unban_sync(db, config.peer_id)
                else f"{config.peer_id} was not banned"
            )
        ban_sync(db, config.peer_id, config.reason)
        return f"banned {config.peer_id}: {config.reason}"
    finally:
        db.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-coordinator", description="Run and inspect a swarm coordinator node."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_config_arguments(commands.add_parser("start", help="start a coordinator node"), CoordinatorConfig)
    add_config_arguments(
        commands.add_parser("status", help="show a run's peers and DHT addresses"), StatusConfig
    )
    for name in ("ban", "unban"):
        add_config_arguments(
            commands.add_parser(name, help=f"{name} a peer (offline edit of the store)"),
            BanConfig,
            positional=("peer_id",),
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "start":
            config = config_from_args(CoordinatorConfig, args)
            runtime.setup_logging(config.log_level)
            runtime.run(_start(config), fork_server=True)
        elif args.command == "status":
            config = config_from_args(StatusConfig, args)
            status = asyncio.run(_fetch_status(config))
            print(json.dumps(status, indent=2) if config.as_json else format_status(status))
        else:
            print(_ban(config_from_args(BanConfig, args), unban=args.command == "unban"))
    except SwarmError as e:
        print(f"swarm-coordinator: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
