"""Bad input to a live coordinator: each request gets a clear error naming what is wrong, the coordinator
logs one line naming the sender, stays up, and stores nothing from it."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lab.localswarm import FAST_MEMBERSHIP, Child, LocalSwarm, running_coordinator, status, wait_until
from protocols import coordinator_pb2 as pb
from protocols.codec import pack, unpack
from protocols.envelope import seal
from protocols.errors import AdmissionDenied, SecurityError, UnknownRun
from protocols.keys import SigningKey
from protocols.messages import HEARTBEAT, JOIN
from protocols.version import PROTOCOL_VERSION
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.timeout(120)

RUN = "test-run"
HEADER = pb.Header(protocol_version=PROTOCOL_VERSION, run_id=RUN)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    harness = LocalSwarm(tmp_path_factory.mktemp("coordinator-input"))
    try:
        yield harness.start_coordinator()
    finally:
        harness.kill_all()


def call(coordinator: Child, method: str, request: bytes) -> bytes:
    with grpc.insecure_channel(coordinator.extra["address"]) as channel:
        return channel.unary_unary(f"/swarm.coordinator.v1.Coordinator/{method}")(request, timeout=10)


def refused(coordinator: Child, method: str, request: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(coordinator, method, request)
    return info.value


def challenge(coordinator: Child) -> bytes:
    raw = call(coordinator, "Challenge", pb.ChallengeRequest(header=HEADER).SerializeToString())
    return pb.ChallengeResponse.FromString(raw).challenge


def join_request(key: SigningKey, nonce: bytes, **overrides) -> bytes:
    body = {
        "challenge": nonce,
        "name": "tester",
        "device": "cpu",
        "role": "auto",
        "token_proof": b"",
    } | overrides
    return pb.JoinRequest(header=HEADER, envelope=seal(key, JOIN, RUN, body)).SerializeToString()


def heartbeat_request(
    key: SigningKey, seq: int, *, run_id: str = RUN, metrics=None, step=0, param_hash=""
) -> bytes:
    body = {"seq": seq, "state": "online", "metrics": metrics or {}, "step": step, "param_hash": param_hash}
    return pb.HeartbeatRequest(header=HEADER, envelope=seal(key, HEARTBEAT, run_id, body)).SerializeToString()


def test_malformed_protobuf_is_named(coordinator: Child):
    error = refused(coordinator, "Join", b"garbage-not-protobuf")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed JoinRequest" in error.details()


def test_malformed_envelope_is_named(coordinator: Child):
    request = pb.JoinRequest(header=HEADER, envelope=b"\x93not-an-envelope").SerializeToString()
    error = refused(coordinator, "Join", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "join request" in error.details()


def test_unknown_protocol_version_and_run(coordinator: Child):
    old = pb.ChallengeRequest(header=pb.Header(protocol_version=99, run_id=RUN)).SerializeToString()
    error = refused(coordinator, "Challenge", old)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 99" in error.details()

    other = pb.ChallengeRequest(
        header=pb.Header(protocol_version=PROTOCOL_VERSION, run_id="other")
    ).SerializeToString()
    error = refused(coordinator, "Challenge", other)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown run 'other'" in error.details() and RUN in error.details()


def test_forged_signature_is_refused(coordinator: Child):
    key = SigningKey.generate()
    request = pb.JoinRequest.FromString(join_request(key, challenge(coordinator)))
    outer = unpack(request.envelope)
    outer["sig"] = bytes([outer["sig"][0] ^ 1]) + outer["sig"][1:]
    request.envelope = pack(outer)
    error = refused(coordinator, "Join", request.SerializeToString())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "signature does not verify" in error.details() and key.peer_id in error.details()


def test_replayed_challenge_is_refused(coordinator: Child):
    key = SigningKey.generate()
    request = join_request(key, challenge(coordinator))
    pb.JoinResponse.FromString(call(coordinator, "Join", request))
    error = refused(coordinator, "Join", request)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "already used" in error.details()
    # A challenge the coordinator never issued is refused the same way.
    error = refused(coordinator, "Join", join_request(SigningKey.generate(), b"\x07" * 32))
    assert "unknown, expired or already used" in error.details()


def test_bad_fields_are_named(coordinator: Child):
    error = refused(
        coordinator, "Join", join_request(SigningKey.generate(), challenge(coordinator), role="admin")
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'role'" in error.details()

    key = SigningKey.generate()
    call(coordinator, "Join", join_request(key, challenge(coordinator)))
    error = refused(coordinator, "Heartbeat", heartbeat_request(key, 1, metrics={"loss": math.nan}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "metrics" in error.details() and "finite" in error.details()


def test_oversized_message_is_refused(coordinator: Child):
    request = pb.JoinRequest(header=HEADER, envelope=b"x" * (2 << 20)).SerializeToString()
    assert refused(coordinator, "Join", request).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_heartbeats_need_a_joined_key_and_fresh_sequence(coordinator: Child):
    stranger = SigningKey.generate()
    error = refused(coordinator, "Heartbeat", heartbeat_request(stranger, 1))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"peer {stranger.peer_id} has not joined" in error.details()

    key = SigningKey.generate()
    call(coordinator, "Join", join_request(key, challenge(coordinator)))
    beat = heartbeat_request(key, 5)
    assert pb.HeartbeatResponse.FromString(call(coordinator, "Heartbeat", beat)).state == "online"
    error = refused(coordinator, "Heartbeat", beat)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "old sequence number" in error.details()

    error = refused(coordinator, "Heartbeat", heartbeat_request(key, 6, run_id="other-run"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run 'other-run'" in error.details()


def test_client_translates_errors_and_refuses_an_unpinned_coordinator(coordinator: Child):
    async def scenario() -> None:
        async with CoordinatorClient(coordinator.extra["address"], timeout_s=10) as client:
            key = SigningKey.generate()
            with pytest.raises(UnknownRun, match="unknown run 'nope'"):
                await client.join(key, "nope", name="n", device="cpu")
            with pytest.raises(SecurityError, match="refusing to join"):
                await client.join(
                    key, RUN, name="n", device="cpu", coordinator_key=SigningKey.generate().public_key
                )

    asyncio.run(scenario())


def test_divergent_parameters_are_flagged(coordinator: Child):
    keys = [SigningKey.generate() for _ in range(3)]
    for key in keys:
        call(coordinator, "Join", join_request(key, challenge(coordinator)))
    for key, param_hash in zip(keys, ["a" * 64, "a" * 64, "b" * 64], strict=True):
        call(coordinator, "Heartbeat", heartbeat_request(key, 1, step=7, param_hash=param_hash))
    peers = {p.peer_id: p for p in status(coordinator.extra["address"]).peers}
    assert [peers[k.peer_id].diverged for k in keys] == [False, False, True]
    assert peers[keys[2].peer_id].step == 7 and peers[keys[2].peer_id].param_hash == "b" * 64
    wait_until(
        lambda: f"{keys[2].peer_id} diverged" in coordinator.output(), timeout_s=10, what="the log line"
    )
    error = refused(coordinator, "Heartbeat", heartbeat_request(keys[0], 2, step=7, param_hash="xyz"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "param_hash" in error.details()


def test_coordinator_survives_and_stored_only_admitted_peers(coordinator: Child):
    # Runs last in this module: every refused request above left no trace in the record.
    snapshot = status(coordinator.extra["address"])
    assert coordinator.process.poll() is None
    assert len(snapshot.peers) == 6, "only the six keys that joined properly are recorded"
    log = wait_until(lambda: coordinator.output().count("refused") >= 10 and coordinator.output(), timeout_s=10,
                     what="refusals in the coordinator log")  # fmt: skip
    assert "refused Join from ipv4:127.0.0.1" in log


@pytest.mark.parametrize("policy", ["token", "allowlist"])
def test_admission_policies(tmp_path: Path, policy: str):
    member = SigningKey.generate()
    admission = {"policy": "token", "join_token": "open-sesame"}
    if policy == "allowlist":
        admission = {"policy": "allowlist", "allowlist": [member.peer_id]}
    run = RunConfig(run_id=RUN, membership=FAST_MEMBERSHIP, admission=admission)

    async def scenario() -> None:
        async with (
            running_coordinator(run, tmp_path / "data") as node,
            CoordinatorClient(node.address, timeout_s=10) as client,
        ):
            outsider = SigningKey.generate()
            with pytest.raises(AdmissionDenied, match=outsider.peer_id):
                await client.join(outsider, RUN, name="o", device="cpu", join_token="wrong")
            token = "open-sesame" if policy == "token" else None
            admitted = await client.join(member, RUN, name="m", device="cpu", join_token=token)
            assert admitted.certificate.peer_id == member.peer_id
            assert "join_token" not in str(admitted.run_spec) and "allowlist" not in str(admitted.run_spec)
            assert [p.peer_id for p in (await client.status()).peers] == [member.peer_id]

    asyncio.run(scenario())
