"""``swarm-peer doctor``: check, before joining, everything that would make joining or training fail.

Each check prints one line, and each problem its fix. Checks: Python, torch and the compute device,
the identity file, that the coordinator answers (and speaks our protocol), that other peers can open
a connection to this machine (the coordinator dials back to the address the check came from), clock
skew against the coordinator, and free disk. The exit code is 1 when joining would fail, else 0;
warnings (such as not being dialable) do not fail it, since the peer can still join.

Example::

    swarm-peer doctor --coordinator run.example.org:31330 --port 31337
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
from pydantic import ConfigDict, Field, create_model

from peer.config import peer_fields
from protocols import coordinator_pb2 as pb
from protocols.envelope import MAX_CLOCK_SKEW_S
from protocols.errors import (
    AdmissionDenied,
    CoordinatorKeyMismatch,
    NetworkError,
    ProtocolError,
    SwarmError,
    VersionMismatch,
)
from protocols.keys import PublicKey
from protocols.version import PROTOCOL_VERSION
from swarm.coordinator_client import SERVICE, parse_address
from swarm.rpc import CHANNEL_OPTIONS, error_from_rpc

MIN_PYTHON = (3, 10)
MIN_FREE_BYTES = 100 << 20  # below this the peer cannot even keep its logs and key safely
LOW_FREE_BYTES = 1 << 30
SKEW_WARN_S = 10.0


class DoctorConfig(
    create_model(
        "_JoinSettings",
        __config__=ConfigDict(extra="forbid"),
        **peer_fields(
            "coordinator",
            "device",
            "identity",
            "host",
            "port",
            "name",
            "run_id",
            "coordinator_key",
            "join_token",
            "known_coordinators",
        ),  # fmt: skip
    )
):
    """What ``swarm-peer doctor`` checks: the settings ``swarm-peer join`` would use (``PeerConfig``'s own
    fields, so the flags are the same), and how long to wait for the coordinator."""

    timeout_s: float = Field(
        10.0, gt=0, le=300, description="give up on the coordinator after this many seconds"
    )


@dataclass
class Check:
    """One ``swarm-peer doctor`` finding: ok, warn or fail, what was found, and how to fix it."""

    name: str
    level: Literal["ok", "warn", "fail"]
    message: str
    fix: str = ""


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("python", "fail", f"Python {version} is too old", "install Python 3.10 or newer")
    return Check("python", "ok", f"Python {version}")


def check_torch_and_device(choice: str) -> list[Check]:
    try:
        import torch
    except ImportError as e:
        return [Check("torch", "fail", f"torch cannot be imported ({e})", "pip install torch")]
    from peer.device import describe_device, resolve_device

    checks = [Check("torch", "ok", f"torch {torch.__version__}")]
    try:
        device = resolve_device(choice)
        checks.append(Check("device", "ok", f"computes on {describe_device(device)}"))
    except SwarmError as e:
        message, _, fix = str(e).partition("; ")
        checks.append(Check("device", "fail", message, fix))
    return checks


def check_identity(path: Path) -> Check:
    from swarm.identity import load_identity

    path = path.expanduser()
    if not path.exists():
        return Check("identity", "ok", f"no key at {path} yet; joining creates one")
    try:
        key = load_identity(path)
    except SwarmError as e:
        return Check(
            "identity", "fail", str(e), f"move {path} away to start with a new identity, or pass --identity"
        )
    return Check("identity", "ok", f"peer ID {key.peer_id} ({path})")


def check_disk(path: Path) -> Check:
    directory = path.expanduser().parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    free = shutil.disk_usage(directory).free
    shown = f"{free / (1 << 30):.1f} GiB free in {directory}"
    if free < MIN_FREE_BYTES:
        return Check(
            "disk", "fail", shown, "free some disk space (at least 100 MiB) or use --identity elsewhere"
        )
    if free < LOW_FREE_BYTES:
        return Check("disk", "warn", shown, "logs and pinned keys need little, but keep at least 1 GiB free")
    return Check("disk", "ok", shown)


def _tcp_probe(host: str, port: int, timeout_s: float) -> str | None:
    """None if something accepts TCP connections at host:port, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"the host name {host!r} does not resolve ({e.strerror})"
    except TimeoutError:
        return f"no answer within {timeout_s:.0f}s (a firewall may drop the packets)"
    except OSError as e:
        return e.strerror or str(e)


def _http_probe(host: str, port: int, timeout_s: float) -> str | None:
    """The status line if the server at host:port answers plain HTTP/1.x (not the coordinator's gRPC)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            first = conn.recv(256)
    except OSError:
        return None
    line = first.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    return line if line.startswith("HTTP/") else None


async def _rpc(
    channel: grpc.aio.Channel, address: str, method: str, request, response_type, timeout_s: float
):
    call = channel.unary_unary(
        SERVICE + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_type.FromString,
    )
    try:
        return await call(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        raise error_from_rpc(e, address) from None


async def _listen(host: str, port: int) -> tuple[asyncio.Server | None, int, list[int]]:
    """A throwaway listener on the peer's port that counts the connections it accepts."""
    accepted: list[int] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    try:
        server = await asyncio.start_server(on_connect, host=host, port=port)
    except OSError:
        return None, port, accepted  # already in use, for example by a running peer: dial that instead
    return server, server.sockets[0].getsockname()[1], accepted


async def check_coordinator(config: DoctorConfig) -> list[Check]:
    address = config.coordinator
    try:
        host, port = parse_address(address)
    except ProtocolError as e:
        return [
            Check("coordinator", "fail", str(e), "give the address as HOST:PORT, e.g. run.example.org:31330")
        ]
    why = await asyncio.to_thread(_tcp_probe, host, port, config.timeout_s)
    if why is not None:
        return [
            Check(
                "coordinator", "fail", f"cannot reach {address}: {why}",
                "check the address and port with the organizer, that the coordinator is running "
                "(swarm-coordinator start), and that no firewall blocks TCP port " + str(port),
            )
        ]  # fmt: skip
    checks: list[Check] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        started = time.time()
        try:
            header = pb.Header(protocol_version=PROTOCOL_VERSION, run_id="")
            status = await _rpc(channel, address, "Status", pb.StatusRequest(header=header), pb.StatusResponse,
                                config.timeout_s)  # fmt: skip
        except SwarmError as e:
            http = await asyncio.to_thread(_http_probe, host, port, config.timeout_s)
            if http is not None:
                message = (
                    f"{address} is a web server ({http}), not a swarm coordinator's gRPC port "
                    "(is this the dashboard port?)"
                )
            else:
                message = f"{address} accepts connections but does not answer as a swarm coordinator ({e})"
            return [
                Check("coordinator", "fail", message, "ask the organizer for the coordinator's gRPC address")
            ]
        rtt = time.time() - started
        if status.protocol_version != PROTOCOL_VERSION:
            return [
                Check(
                    "coordinator", "fail",
                    f"{address} speaks protocol version {status.protocol_version}, this peer {PROTOCOL_VERSION}",
                    "install the swarm version the organizer names",
                )
            ]  # fmt: skip
        online = sum(1 for p in status.peers if p.state == "online")
        checks.append(
            Check("coordinator", "ok", f"run {status.run_id!r} at {address} answers in {rtt * 1000:.0f} ms; "
                  f"{online} peers online")
        )  # fmt: skip
        checks.append(_skew_check(status.server_time - (started + rtt / 2)))
        checks.append(await _dial_back_check(channel, config))
    checks += await check_admission(config, status.run_id)
    return checks


async def check_admission(config: DoctorConfig, served_run_id: str) -> list[Check]:
    """Join as ``swarm-peer join`` would (pinned key, join token, identity), then leave at once, and check
    the run's components against this machine: what a volunteer gets wrong shows here, not at join."""
    from swarm.components import check_components
    from swarm.config import RunConfig
    from swarm.coordinator_client import CoordinatorClient
    from swarm.identity import load_or_create_identity
    from swarm.trust import KnownCoordinators, key_mismatch_fix

    run_id = config.run_id or served_run_id
    known = KnownCoordinators(config.known_coordinators)
    try:
        expected = (
            PublicKey.from_peer_id(config.coordinator_key) if config.coordinator_key else known.pinned(run_id)
        )
        key = await asyncio.to_thread(load_or_create_identity, config.identity.expanduser())
    except SwarmError as e:
        return [Check("admission", "fail", str(e), "fix the file or flag named above")]
    token = config.join_token or os.environ.get("SWARM_JOIN_TOKEN") or None
    async with CoordinatorClient(config.coordinator, timeout_s=config.timeout_s) as client:
        try:
            admission = await client.join(
                key, run_id, name=config.name, device="doctor check", join_token=token,
                coordinator_key=expected,
            )  # fmt: skip
        except CoordinatorKeyMismatch as e:
            pinned_by = "--coordinator-key" if config.coordinator_key else str(known.path)
            return [Check("coordinator key", "fail", str(e), key_mismatch_fix(run_id, e.offered, pinned_by))]
        except AdmissionDenied as e:
            return [Check("admission", "fail", str(e), "ask the organizer to admit this peer")]
        except SwarmError as e:
            return [Check("admission", "fail", f"joining run {run_id!r} failed: {e}", "")]
        with contextlib.suppress(SwarmError):
            await client.leave(key, run_id, reason="swarm-peer doctor: check done")
    checks = [Check("admission", "ok", f"run {run_id!r} admits peer {key.peer_id}")]
    try:
        run = RunConfig.parse(admission.run_spec, source="run spec from the coordinator")
        await asyncio.to_thread(check_components, run)
    except SwarmError as e:
        checks.append(
            Check(
                "components", "fail", str(e), "install what the run needs (the organizer names the package)"
            )
        )
    else:
        checks.append(Check("components", "ok", f"model {run.model.name!r} and dataset {run.dataset.name!r}"))
    return checks


def _skew_check(skew_s: float) -> Check:
    ahead = "ahead of" if skew_s < 0 else "behind"
    shown = f"this clock is {abs(skew_s):.1f}s {ahead} the coordinator's"
    fix = "turn on time synchronisation (NTP), e.g. timedatectl set-ntp true"
    if abs(skew_s) >= MAX_CLOCK_SKEW_S:
        return Check(
            "clock", "fail", shown + f"; signed messages off by {MAX_CLOCK_SKEW_S:.0f}s are refused", fix
        )
    if abs(skew_s) >= SKEW_WARN_S:
        return Check("clock", "warn", shown, fix)
    return Check("clock", "ok", shown)


async def _dial_back_check(channel: grpc.aio.Channel, config: DoctorConfig) -> Check:
    server, port, accepted = await _listen(config.host, config.port)
    note = "" if config.port else f" (checked on free port {port}; join with a fixed --port to forward it)"
    fix = (
        f"forward TCP port {config.port or 'P'} on your router to this machine and join with --port "
        f"{config.port or 'P'}; or try --upnp; or run the peer on a machine with a public address"
    )
    try:
        request = pb.DialBackRequest(header=pb.Header(protocol_version=PROTOCOL_VERSION), ports=[port])
        try:
            answer = await _rpc(channel, config.coordinator, "DialBack", request, pb.DialBackResponse,
                                config.timeout_s)  # fmt: skip
        except VersionMismatch:
            return Check(
                "reachability", "warn",
                "the coordinator cannot dial back (an older version), so whether others can reach this "
                "peer was not checked", fix,
            )  # fmt: skip
        except NetworkError as e:
            return Check(
                "reachability", "warn", f"dial-back did not run: {e}", "run doctor again in a few seconds"
            )
        result = answer.results[0]
        if result.reachable and (server is None or accepted):
            return Check(
                "reachability", "ok",
                f"the coordinator opened a TCP connection to this machine at {answer.address}:{port}{note}",
            )  # fmt: skip
        detail = result.detail or "the connection reached another machine"
        return Check(
            "reachability", "warn",
            f"other peers cannot dial this machine at {answer.address}:{port} ({detail}); it can join and "
            f"train behind NAT: it sends its gradients and receives the averaged result over connections it "
            f"opens, but reduces no part of a round (the reachable peers do that work and send more) and never "
            f"leads a group, and a run needs enough reachable peers to form groups{note}", fix,
        )  # fmt: skip
    finally:
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()


async def diagnose(config: DoctorConfig) -> list[Check]:
    checks = [check_python()]
    checks += await asyncio.to_thread(check_torch_and_device, config.device)
    checks.append(await asyncio.to_thread(check_identity, config.identity))
    checks += await check_coordinator(config)
    checks.append(await asyncio.to_thread(check_disk, config.identity))
    return checks


MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def report(checks: list[Check]) -> tuple[str, int]:
    """The printed report and the exit code (1 when any check failed)."""
    lines = []
    for check in checks:
        lines.append(f"[{MARKS[check.level]}] {check.name:13} {check.message}")
        if check.fix and check.level != "ok":
            lines.append(f"       {'':13} fix: {check.fix}")
    failed = [c for c in checks if c.level == "fail"]
    warned = [c for c in checks if c.level == "warn"]
    if failed:
        lines.append(f"joining would fail: {len(failed)} problem(s) above must be fixed first")
    elif warned:
        lines.append(f"ready to join, with {len(warned)} warning(s)")
    else:
        lines.append("ready to join")
    return "\n".join(lines), 1 if failed else 0


def run_doctor(config: DoctorConfig) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    text, code = report(asyncio.run(diagnose(config)))
    print(text, flush=True)
    return code
