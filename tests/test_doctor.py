"""``swarm-peer doctor``: a healthy setup passes; an unreachable or wrong-protocol coordinator fails
plainly with its fix; the coordinator's dial-back reports closed ports and cannot be abused."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from coordinator.dialback import BURST, MAX_QUEUED, MIN_INTERVAL_S, DialBackService, caller_host
from lab.localswarm import free_port, running_coordinator, tiny_run
from protocols import coordinator_pb2 as pb
from protocols.errors import NetworkError, ProtocolError
from protocols.keys import SigningKey
from protocols.version import PROTOCOL_VERSION
from swarm.config import AdmissionConfig, ComponentSpec, RunConfig
from swarm.models import register_model

pytestmark = pytest.mark.timeout(120)


async def doctor(*args: str, home: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "peer.cli", "doctor", "--cpu", "--host", "127.0.0.1",
        "--identity", str(home / "id.key"), "--timeout-s", "5", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), timeout=90)
    return process.returncode, out.decode()


def run_doctor(*args: str, home: Path) -> tuple[int, str]:
    return asyncio.run(doctor(*args, home=home))


@pytest.fixture
def http_server() -> Iterator[int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.TCPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def mute_server() -> Iterator[int]:
    """Accepts connections and closes them without a word: something that is not a coordinator."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_an_unreachable_coordinator_fails_clearly(tmp_path: Path):
    port = free_port()
    code, out = run_doctor("--coordinator", f"127.0.0.1:{port}", home=tmp_path)
    assert code == 1, out
    assert f"[FAIL] coordinator   cannot reach 127.0.0.1:{port}: Connection refused" in out
    assert "fix: check the address and port with the organizer" in out
    assert "joining would fail: 1 problem(s)" in out
    assert "[ok  ] python" in out and "[ok  ] device" in out, "the local checks still run"


def test_a_bad_address_fails_clearly(tmp_path: Path):
    code, out = run_doctor("--coordinator", "no-port-here", home=tmp_path)
    assert code == 1 and "coordinator address 'no-port-here' is not HOST:PORT" in out


def test_a_web_server_is_not_taken_for_a_coordinator(tmp_path: Path, http_server: int):
    code, out = run_doctor("--coordinator", f"127.0.0.1:{http_server}", home=tmp_path)
    assert code == 1, out
    assert (
        f"127.0.0.1:{http_server} is a web server (HTTP/1.0 200 OK), not a swarm coordinator's gRPC port"
        in out
    )


def test_a_server_of_another_protocol_is_named_as_such(tmp_path: Path, mute_server: int):
    code, out = run_doctor("--coordinator", f"127.0.0.1:{mute_server}", home=tmp_path)
    assert code == 1, out
    assert f"127.0.0.1:{mute_server} accepts connections but does not answer as a swarm coordinator" in out


def test_a_healthy_setup_is_ready_to_join(tmp_path: Path):
    async def scenario() -> tuple[int, str, int]:
        async with running_coordinator(tiny_run("doctor"), tmp_path / "coordinator") as node:
            port = free_port()
            code, out = await doctor("--coordinator", node.address, "--port", str(port), home=tmp_path)
            return code, out, port

    code, out, port = asyncio.run(scenario())
    assert code == 0, out
    assert "[ok  ] coordinator   run 'doctor' at 127.0.0.1:" in out
    assert "[ok  ] clock" in out
    assert (
        f"[ok  ] reachability  the coordinator opened a TCP connection to this machine at 127.0.0.1:{port}"
        in out
    )
    assert out.rstrip().endswith("ready to join")


def test_dial_back_reports_closed_ports_and_refuses_abuse():
    service = DialBackService()
    header = pb.Header(protocol_version=PROTOCOL_VERSION)
    closed = free_port()

    async def scenario() -> None:
        answer = await service.dial_back(
            pb.DialBackRequest(header=header, ports=[closed]), "ipv4:127.0.0.1:5000"
        )
        assert answer.address == "127.0.0.1"
        assert not answer.results[0].reachable and "refused" in answer.results[0].detail.lower()
        # Callers behind one address that come together: BURST run at once (the first above was one),
        # the next wait for their slots, one every MIN_INTERVAL_S, and a call past MAX_QUEUED is refused.
        started = time.monotonic()
        calls = [
            service.dial_back(pb.DialBackRequest(header=header, ports=[closed]), f"ipv4:127.0.0.1:{5001 + i}")
            for i in range(BURST - 1 + MAX_QUEUED + 1)
        ]
        *answered, refused = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(a, pb.DialBackResponse) and a.address == "127.0.0.1" for a in answered), (
            answered
        )
        assert isinstance(refused, NetworkError) and "already due" in str(refused)
        assert time.monotonic() - started >= MAX_QUEUED * MIN_INTERVAL_S - 0.1
        # Two peers of another address joining together are both checked at once.
        started = time.monotonic()
        pair = [
            service.dial_back(pb.DialBackRequest(header=header, ports=[closed]), f"ipv4:127.0.0.2:{6000 + i}")
            for i in range(BURST)
        ]
        assert all(isinstance(a, pb.DialBackResponse) for a in await asyncio.gather(*pair))
        assert time.monotonic() - started < MIN_INTERVAL_S
        with pytest.raises(ProtocolError, match="1 to 4 ports"):
            await service.dial_back(
                pb.DialBackRequest(header=header, ports=[1, 2, 3, 4, 5]), "ipv4:10.0.0.1:1"
            )
        with pytest.raises(ProtocolError, match="1 to 4 ports"):
            await service.dial_back(pb.DialBackRequest(header=header, ports=[0]), "ipv4:10.0.0.2:1")

    asyncio.run(scenario())
    assert caller_host("ipv6:[::1]:4444") == "::1"
    with pytest.raises(ProtocolError):
        caller_host("unix:/tmp/socket")


def _doctor_against(run: RunConfig, tmp_path: Path, *args: str) -> tuple[int, str]:
    async def scenario() -> tuple[int, str]:
        async with running_coordinator(run, tmp_path / "coordinator") as node:
            return await doctor("--coordinator", node.address, *args, home=tmp_path)

    return asyncio.run(scenario())


def test_a_token_run_is_checked_with_the_volunteers_token(tmp_path: Path):
    run = tiny_run("doctor-token").model_copy(
        update={"admission": AdmissionConfig(policy="token", join_token="s3cret")}
    )

    async def scenario() -> list[tuple[int, str]]:
        async with running_coordinator(run, tmp_path / "coordinator") as node:
            return [
                await doctor("--coordinator", node.address, *args, home=tmp_path)
                for args in ([], ["--join-token", "wrong"], ["--join-token", "s3cret"])
            ]

    (none, wrong, right) = asyncio.run(scenario())
    assert none[0] == 1 and "admits only peers with its join token" in none[1], none[1]
    assert "--join-token" in none[1]
    assert wrong[0] == 1 and "the join token does not match" in wrong[1], wrong[1]
    assert right[0] == 0, right[1]
    assert "[ok  ] admission" in right[1] and "[ok  ] components" in right[1]


def test_a_coordinator_key_other_than_the_pinned_one_is_refused_with_its_remedy(tmp_path: Path):
    known = tmp_path / "known.json"
    pinned = SigningKey.generate().public_key.peer_id
    known.write_text(json.dumps({"doctor-pin": pinned}))
    code, out = _doctor_against(tiny_run("doctor-pin"), tmp_path, "--known-coordinators", str(known))
    assert code == 1, out
    assert f"pinned as {pinned}; refusing to join" in out
    assert f"remove run 'doctor-pin''s entry from {known}" in out and "--coordinator-key" in out
    assert json.loads(known.read_text()) == {"doctor-pin": pinned}, "doctor never re-pins"


class _OnlyHereConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(4, ge=1, le=64, description="width of the one layer")
    seq_len: int = Field(8, ge=1, le=64, description="longest sequence")


class _Linear(torch.nn.Linear):
    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(inputs.float()), targets.float())


def _build_linear(config: _OnlyHereConfig, generator: torch.Generator) -> torch.nn.Module:
    layer = _Linear(config.width, config.width)
    with torch.no_grad():
        layer.weight.normal_(generator=generator)
    return layer


def test_a_model_not_installed_here_names_the_entry_point_group(tmp_path: Path):
    # Registered in this process (the coordinator's) only: the doctor's process does not have it.
    register_model("doctor-only-here", _OnlyHereConfig)(_build_linear)
    run = tiny_run("doctor-model").model_copy(
        update={"model": ComponentSpec(name="doctor-only-here", config={"width": 4})}
    )
    code, out = _doctor_against(run, tmp_path)
    assert code == 1, out
    assert "[ok  ] admission" in out
    assert "[FAIL] components" in out and "unknown model 'doctor-only-here'" in out
    assert "entry point group 'swarm.models'" in out
