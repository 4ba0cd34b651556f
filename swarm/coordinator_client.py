"""A client for the coordinator's gRPC API: challenge-response join, heartbeats, leave and status.

Every call is bounded by ``timeout_s`` and raises only ``SwarmError`` subclasses. A join verifies the
coordinator's signed answer and the certificate in it against the coordinator key the caller pins.

Example::

    client = CoordinatorClient("127.0.0.1:31330")
    status = await client.status()
    print(status.run_id, [p.peer_id for p in status.peers])
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from protocols import coordinator_pb2 as pb
from protocols.certificates import PeerCertificate, verify_certificate
from protocols.envelope import open_envelope, seal
from protocols.errors import (
    AccusationInFlight,
    CoordinatorKeyMismatch,
    NetworkError,
    ProtocolError,
    SecurityError,
    SwarmError,
)
from protocols.keys import PublicKey, SigningKey
from protocols.messages import (
    ACCUSE,
    HEARTBEAT,
    JOIN,
    JOIN_ANSWER,
    JUDGING_BUDGET_S,
    LEAVE,
    MAX_ROUND_ENTRIES,
    MAX_SUSPECT_REPORTS,
    MAX_WITNESSED_ROUNDS,
    RUN_STATE,
    JoinAnswerBody,
    RunStateBody,
    parse_body,
    token_proof,
)
from protocols.version import PROTOCOL_VERSION
from swarm.rpc import CHANNEL_OPTIONS, error_from_rpc

logger = logging.getLogger(__name__)

SERVICE = "/swarm.coordinator.v1.Coordinator/"
# Waits between attempts to file an accusation the coordinator was too busy to take.
ACCUSE_RETRY_DELAYS_S = (15.0, 30.0, 60.0, 120.0, 240.0)
# While the coordinator still judges this accuser's earlier accusation (its recompute may wait behind
# others'), asked again this often, for at most this long: the accuser serves what it needs meanwhile.
ACCUSE_IN_FLIGHT_RETRY_S = 120.0
ACCUSE_IN_FLIGHT_WAIT_S = 7200.0
EVIDENCE_PIECE_BYTES = 512 << 10


@dataclass(frozen=True)
class Admission:
    """What a successful join returns."""

    certificate: PeerCertificate
    run_spec: dict[str, Any]
    dht_initial_peers: list[str]
    heartbeat_interval_s: float
    coordinator_key: PublicKey
    holds_checkpoint: bool = True


@dataclass(frozen=True)
class HeartbeatAnswer:
    """What the coordinator answered a heartbeat: the state it records for this peer, a renewed
    certificate (None while the current one is fresh), and its clock."""

    state: str
    certificate: PeerCertificate | None
    server_time: float
    # The run's state, signed by the coordinator (None from a coordinator that does not send it):
    # max_steps now (None: no limit) and the step of its final checkpoint once the run has finished.
    max_steps: int | None = None
    finished_step: int | None = None
    signed_run_state: bool = False
    # The run's standing, when the coordinator sent a newer one than the heartbeat's copy (None: none).
    standing_at: float = 0.0
    standing: dict[str, float] | None = None


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (or ``[IPv6]:PORT``); raises ProtocolError naming the bad part."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"coordinator address {address!r} is not HOST:PORT")
    return host, int(port)


class CoordinatorClient:
    """The coordinator's gRPC API from a peer's side; use it as an async context manager to close it.

    Args:
        address: the coordinator, HOST:PORT or ``unix:/path``.
        timeout_s: the deadline of every call.
        reconnect_s: the longest the channel waits between two attempts to reconnect to a coordinator it
            lost. gRPC's own backoff grows to 120 s, and a call made meanwhile fails at once without
            trying: peers that lost a restarting coordinator for a minute noticed it was back only up to
            two minutes later, whatever their own retry interval.
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0, reconnect_s: float = 5.0):
        """``address`` is HOST:PORT, or ``unix:/path`` for a coordinator's socket on this machine."""
        if not address.startswith("unix:/"):
            parse_address(address)
        self.address = address
        self.timeout_s = timeout_s
        backoff_ms = max(100, int(reconnect_s * 1000))
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                *CHANNEL_OPTIONS,
                ("grpc.initial_reconnect_backoff_ms", min(1000, backoff_ms)),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ],
        )
        self._last_seq = 0

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _header(self, run_id: str) -> pb.Header:
        return pb.Header(protocol_version=PROTOCOL_VERSION, run_id=run_id)

    def _next_seq(self) -> int:
        # Wall-clock based so the sequence keeps growing across restarts of the peer process.
        self._last_seq = max(self._last_seq + 1, time.time_ns())
        return self._last_seq

    async def _call(self, method: str, request: Any, response_type: Any) -> Any:
        rpc = self._channel.unary_unary(
            SERVICE + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        try:
            return await rpc(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.address) from None

    async def challenge(self, run_id: str = "") -> pb.ChallengeResponse:
        """A single-use join challenge; with no ``run_id`` the answer names the run the coordinator serves."""
        return await self._call(
            "Challenge", pb.ChallengeRequest(header=self._header(run_id)), pb.ChallengeResponse
        )

    async def join(
        self,
        key: SigningKey,
        run_id: str,
        *,
        name: str,
        device: str,
        role: str = "auto",
        join_token: str | None = None,
        coordinator_key: PublicKey | Callable[[str], PublicKey | None] | None = None,
    ) -> Admission:
        """Prove possession of ``key`` and get admitted. An empty ``run_id`` joins whatever run the
        coordinator serves (its challenge names it). ``coordinator_key`` pins whom to trust: a key, or a
        function from the run ID to the key pinned for it (None: trust on first use)."""
        challenge = await self.challenge(run_id)
        if not run_id:
            run_id = challenge.run_id
            if not run_id:
                raise ProtocolError(f"coordinator at {self.address} did not name its run; give its run ID")
        if callable(coordinator_key):
            coordinator_key = coordinator_key(run_id)
        offered = PublicKey(challenge.coordinator_public_key)
        if coordinator_key is not None and offered != coordinator_key:
            raise CoordinatorKeyMismatch(
                f"coordinator at {self.address} presents key {offered.peer_id}, "
                f"but this run's coordinator is pinned as {coordinator_key.peer_id}; refusing to join",
                offered=offered.peer_id,
                run_id=run_id,
            )
        proof = token_proof(join_token, challenge.challenge, key.public_key.raw) if join_token else b""
        body = {
            "challenge": challenge.challenge,
            "name": name,
            "device": device,
            "role": role,
            "token_proof": proof,
        }
        request = pb.JoinRequest(header=self._header(run_id), envelope=seal(key, JOIN, run_id, body))
        response = await self._call("Join", request, pb.JoinResponse)
        try:
            envelope = open_envelope(
                response.envelope, purpose=JOIN_ANSWER, run_id=run_id, signer=offered, what="join answer"
            )
        except SwarmError as e:
            raise SecurityError(f"coordinator at {self.address} sent an invalid join answer: {e}") from None
        answer = parse_body(JoinAnswerBody, envelope.body, sender=offered.peer_id, what="join answer")
        if answer.challenge != challenge.challenge:
            raise SecurityError(f"coordinator at {self.address} answered a different join challenge")
        certificate = verify_certificate(answer.certificate, issuer=offered, run_id=run_id)
        if certificate.public_key != key.public_key:
            raise SecurityError(f"coordinator at {self.address} issued a certificate for another key")
        return Admission(
            certificate=certificate,
            run_spec=answer.run_spec,
            dht_initial_peers=list(answer.dht_initial_peers),
            heartbeat_interval_s=answer.heartbeat_interval_s,
            coordinator_key=offered,
            holds_checkpoint=answer.holds_checkpoint,
        )

    async def heartbeat(
        self,
        key: SigningKey,
        run_id: str,
        coordinator_key: PublicKey,
        *,
        state: str = "online",
        metrics: dict[str, float] | None = None,
        step: int = 0,
        param_hash: str = "",
        suspects: list[str] | None = None,
        rounds: list[list[bytes]] | None = None,
        standing_at: float = 0.0,
    ) -> HeartbeatAnswer:
        seq = self._next_seq()
        body = {
            "seq": seq, "state": state, "metrics": dict(metrics or {}), "step": step,
            "param_hash": param_hash, "suspects": list(suspects or [])[:MAX_SUSPECT_REPORTS],
            "standing_at": float(standing_at),
        }  # fmt: skip
        if rounds:  # the signed group entries of rounds this peer applied lately (credit for the others)
            body["rounds"] = [list(entries)[:MAX_ROUND_ENTRIES] for entries in rounds[-MAX_WITNESSED_ROUNDS:]]
        request = pb.HeartbeatRequest(
            header=self._header(run_id), envelope=seal(key, HEARTBEAT, run_id, body)
        )
        response = await self._call("Heartbeat", request, pb.HeartbeatResponse)
        certificate = None
        if response.certificate:
            certificate = verify_certificate(response.certificate, issuer=coordinator_key, run_id=run_id)
            if certificate.public_key != key.public_key:
                raise SecurityError(f"coordinator at {self.address} renewed a certificate for another key")
        answer = HeartbeatAnswer(response.state, certificate, response.server_time)
        if not response.run_state:
            return answer
        what = f"run state from the coordinator at {self.address}"
        envelope = open_envelope(
            response.run_state, purpose=RUN_STATE, run_id=run_id, signer=coordinator_key, what=what
        )
        run_state = parse_body(RunStateBody, envelope.body, sender=envelope.sender, what=what)
        if run_state.seq != seq:
            raise SecurityError(f"{what} answers another heartbeat (sequence {run_state.seq}, not {seq})")
        return replace(
            answer, max_steps=run_state.max_steps or None, finished_step=run_state.finished_step or None,
            signed_run_state=True, standing_at=run_state.standing_at,
            standing=dict(run_state.standing) if run_state.standing_at > standing_at else None,
        )  # fmt: skip

    async def leave(self, key: SigningKey, run_id: str, *, reason: str = "") -> str:
        body = {"seq": self._next_seq(), "reason": reason[:256]}
        request = pb.LeaveRequest(header=self._header(run_id), envelope=seal(key, LEAVE, run_id, body))
        return (await self._call("Leave", request, pb.LeaveResponse)).state

    async def accuse(
        self, key: SigningKey, run_id: str, *, accused: str, reason: str, evidence: bytes
    ) -> pb.AccuseResponse:
        """File signed evidence that ``accused`` misbehaved; the coordinator judges it and bans someone."""
        body = {
            "accused": accused, "reason": reason[:512], "evidence_sha256": hashlib.sha256(evidence).digest(),
            "evidence_bytes": len(evidence),
        }  # fmt: skip
        piece = EVIDENCE_PIECE_BYTES
        parts = [pb.AccusationPart(header=self._header(run_id), envelope=seal(key, ACCUSE, run_id, body))]
        parts += [pb.AccusationPart(evidence=evidence[i : i + piece]) for i in range(0, len(evidence), piece)]
        rpc = self._channel.stream_unary(
            SERVICE + "Accuse",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.AccuseResponse.FromString,
        )
        try:
            # The coordinator may replay a sender's work before it answers (JUDGING_BUDGET_S at most).
            return await rpc(iter(parts), timeout=self.timeout_s + len(evidence) / 1e6 + JUDGING_BUDGET_S)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.address) from None

    async def accuse_until_taken(
        self, key: SigningKey, run_id: str, *, accused: str, reason: str, evidence: bytes,
        in_flight_wait_s: float = 0.0,
    ) -> pb.AccuseResponse:  # fmt: skip
        """``accuse``, tried again after each of ``ACCUSE_RETRY_DELAYS_S`` while the coordinator is too busy
        to take it (its evidence budget or this peer's accusations spent). With ``in_flight_wait_s``, a
        refusal because the coordinator still judges this peer's earlier accusation (``AccusationInFlight``:
        recomputes wait their turn) is asked again every ``ACCUSE_IN_FLIGHT_RETRY_S`` for that long instead:
        for a caller that serves what that judgment needs meanwhile (``ACCUSE_IN_FLIGHT_WAIT_S``)."""
        delays = iter(ACCUSE_RETRY_DELAYS_S)
        waited_s = 0.0
        while True:
            try:
                return await self.accuse(key, run_id, accused=accused, reason=reason, evidence=evidence)
            except NetworkError as e:
                if isinstance(e, AccusationInFlight) and waited_s < in_flight_wait_s:
                    delay_s = ACCUSE_IN_FLIGHT_RETRY_S
                else:
                    delay_s = next(delays, None)
                    if delay_s is None:
                        raise
                logger.info(f"accusation against {accused} not taken yet ({e}); retrying in {delay_s:.0f}s")
            await asyncio.sleep(delay_s)
            waited_s += delay_s

    async def dial_back(self, ports: list[int]) -> pb.DialBackResponse:
        """Ask the coordinator to open TCP connections back to this machine on ``ports``."""
        request = pb.DialBackRequest(header=self._header(""), ports=ports)
        return await self._call("DialBack", request, pb.DialBackResponse)

    async def status(
        self, run_id: str = "", *, after_peer_id: str = "", max_peers: int = 0
    ) -> pb.StatusResponse:
        """One page of the run's status: the peers after ``after_peer_id`` in ID order, at most
        ``max_peers`` (0: the coordinator's page size); ``next_after_peer_id`` asks for the next page."""
        request = pb.StatusRequest(
            header=self._header(run_id), after_peer_id=after_peer_id, max_peers=max_peers
        )
        return await self._call("Status", request, pb.StatusResponse)

    async def full_status(self, run_id: str = "", *, max_pages: int = 64) -> pb.StatusResponse:
        """The run's status with every page's peers, read page by page (at most ``max_pages`` pages: a
        coordinator that keeps naming a next page cannot keep the caller reading)."""
        first = await self.status(run_id)
        answer, pages = first, 1
        while answer.next_after_peer_id and pages < max_pages:
            answer = await self.status(run_id, after_peer_id=answer.next_after_peer_id)
            first.peers.extend(answer.peers)
            pages += 1
        first.next_after_peer_id = answer.next_after_peer_id
        return first
