"""The coordinator's gRPC service: admission, heartbeats, leave, status and accusations.

Each handler receives raw bytes, so a malformed payload is answered with a clear INVALID_ARGUMENT
instead of grpc's generic deserialization failure. Everything is validated before the store is
touched: a refused request changes nothing and costs one log line naming the sender and the reason.
What one caller may take (challenges, accusations, evidence bytes) is bounded by ``ServiceLimits``; an
accusation's evidence is read in full, under a deadline, before it waits for the judge.
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import functools
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coordinator.limits import ByteBudget, KeyedBuckets, ServiceLimits, caller_key
from coordinator.store import PeerRecord, Store, diverged_peers
from protocols import coordinator_pb2 as pb
from protocols.certificates import issue_certificate
from protocols.envelope import Envelope, open_envelope, seal
from protocols.errors import (
    AdmissionDenied,
    Banned,
    NetworkError,
    ProtocolError,
    ReplayError,
    SwarmError,
    UnknownRun,
    VersionMismatch,
)
from protocols.keys import SigningKey
from protocols.messages import (
    ACCUSE,
    HEARTBEAT,
    JOIN,
    JOIN_ANSWER,
    LEAVE,
    AccuseBody,
    HeartbeatBody,
    JoinBody,
    LeaveBody,
    parse_body,
    token_proof,
)
from protocols.version import PROTOCOL_VERSION
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import parse_evidence
from swarm.config import RunConfig
from swarm.rpc import ERROR_METADATA_KEY, status_code_for

logger = logging.getLogger(__name__)

SERVICE_NAME = "swarm.coordinator.v1.Coordinator"
# A heartbeat or leave older than this is refused as a replay even if its sequence number were new.
MAX_REQUEST_AGE_S = 120.0


class CoordinatorService:
    """The coordinator's gRPC handlers: join by challenge-response, heartbeat, leave, status, accuse.

    Args:
        config: the run this coordinator serves; joins for any other run are refused.
        key: the coordinator's signing key, which signs certificates and answers.
        store: the run's record (peers, certificates, bans, credit).
        dht_initial_peers: the DHT bootstrap addresses handed to every admitted peer.
        limits: per-caller and global limits on challenges, accusations and evidence bytes.
        holds_checkpoint: whether the coordinator holds a checkpoint now (told to each peer it admits).
    """

    def __init__(
        self,
        config: RunConfig,
        key: SigningKey,
        store: Store,
        dht_initial_peers: list[str],
        limits: ServiceLimits | None = None,
        holds_checkpoint: Callable[[], bool] = lambda: True,
    ):
        self.config = config
        self.holds_checkpoint = holds_checkpoint
        self.key = key
        self.store = store
        self.dht_initial_peers = dht_initial_peers
        self.limits = limits = limits or ServiceLimits()
        # challenge -> (expires at, caller); insertion order is expiry order (one TTL for all)
        self._challenges: OrderedDict[bytes, tuple[float, str]] = OrderedDict()
        self._open_by_caller: dict[str, int] = {}
        self._challenge_buckets = KeyedBuckets(
            burst=limits.challenge_burst_per_caller,
            refill_s=limits.challenge_refill_s,
            max_keys=limits.max_tracked_callers,
        )
        self._accusation_buckets = KeyedBuckets(
            burst=limits.accusation_burst_per_peer,
            refill_s=limits.accusation_refill_s,
            max_keys=limits.max_tracked_callers,
        )
        self._evidence_budget = ByteBudget(limits.evidence_budget_bytes)
        self._accusing: set[str] = set()
        # peer -> the last step at which it was reported diverged (one log line per peer and step)
        self._flagged: OrderedDict[str, int] = OrderedDict()
        self._judging = asyncio.Lock()  # held only while recomputing an aggregate from evidence in memory

    @property
    def run_id(self) -> str:
        return self.config.run_id

    # --- checks shared by the handlers -------------------------------------------------------------

    def _check_header(self, header: pb.Header, *, allow_any_run: bool = False) -> None:
        if header.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"protocol version {header.protocol_version} is not supported; this coordinator speaks "
                f"{PROTOCOL_VERSION}: upgrade swarm"
            )
        if header.run_id != self.run_id and not (allow_any_run and not header.run_id):
            raise UnknownRun(f"unknown run {header.run_id!r}; this coordinator serves run {self.run_id!r}")

    def _open(self, data: bytes, purpose: str, what: str, max_age_s: float) -> Envelope:
        return open_envelope(data, purpose=purpose, run_id=self.run_id, max_age_s=max_age_s, what=what)

    async def _check_not_banned(self, peer_id: str) -> None:
        reason = await self.store.ban_reason(peer_id)
        if reason is not None:
            raise Banned(f"peer {peer_id} is banned from run {self.run_id!r}: {reason}")

    async def _known_peer(self, envelope: Envelope) -> PeerRecord:
        await self._check_not_banned(envelope.sender)
        record = await self.store.get_peer(envelope.sender)
        if record is None or record.public_key != envelope.signer.raw:
            raise AdmissionDenied(f"peer {envelope.sender} has not joined run {self.run_id!r}; join first")
        if record.state == "left":
            raise AdmissionDenied(f"peer {envelope.sender} has left run {self.run_id!r}; join again")
        return record

    def _check_admission(self, body: JoinBody, envelope: Envelope) -> None:
        admission = self.config.admission
        if admission.policy == "allowlist" and envelope.sender not in admission.allowlist:
            raise AdmissionDenied(f"peer {envelope.sender} is not on the allowlist of run {self.run_id!r}")
        if admission.policy == "token":
            expected = token_proof(admission.join_token or "", body.challenge, envelope.signer.raw)
            if not body.token_proof:
                raise AdmissionDenied(
                    f"run {self.run_id!r} admits only peers with its join token, and peer {envelope.sender} "
                    "gave none: pass --join-token (or set SWARM_JOIN_TOKEN) with the organizer's token"
                )
            if not hmac.compare_digest(expected, body.token_proof):
                raise AdmissionDenied(
                    f"peer {envelope.sender}: the join token does not match run {self.run_id!r}'s; ask the "
                    "organizer for the current token"
                )

    def _take_challenge(self, challenge: bytes, sender: str) -> None:
        entry = self._challenges.pop(challenge, None)
        if entry is not None:
            self._close_challenge(entry[1])
        if entry is None or entry[0] < time.time():
            raise ReplayError(
                f"join challenge from {sender} is unknown, expired or already used; request a new challenge"
            )

    def _close_challenge(self, caller: str) -> None:
        left = self._open_by_caller.pop(caller, 1) - 1
        if left > 0:
            self._open_by_caller[caller] = left

    def _expire_challenges(self, now: float) -> None:
        while self._challenges:
            challenge, (expires_at, caller) = next(iter(self._challenges.items()))
            if expires_at >= now:
                return
            del self._challenges[challenge]
            self._close_challenge(caller)

    # --- handlers ------------------------------------------------------------------------------------

    async def challenge(self, request: pb.ChallengeRequest, peer: str) -> pb.ChallengeResponse:
        """Anyone may ask, so each caller address gets a token bucket and a cap on open challenges; the
        global cap is then far more than one caller can hold."""
        self._check_header(request.header)
        now = time.time()
        self._expire_challenges(now)
        caller, limits = caller_key(peer), self.limits
        if not self._challenge_buckets.take(caller):
            retry_s = self._challenge_buckets.retry_after_s(caller)
            raise NetworkError(f"too many join challenges from {caller}; retry in {retry_s:.0f}s")
        if self._open_by_caller.get(caller, 0) >= limits.open_challenges_per_caller:
            raise NetworkError(
                f"{caller} holds {limits.open_challenges_per_caller} unanswered join challenges; "
                "answer one or wait for them to expire"
            )
        if len(self._challenges) >= limits.max_open_challenges:
            raise NetworkError("too many joins in progress; retry in a few seconds")
        challenge = secrets.token_bytes(32)
        expires_at = now + self.config.membership.challenge_ttl_s
        self._challenges[challenge] = (expires_at, caller)
        self._open_by_caller[caller] = self._open_by_caller.get(caller, 0) + 1
        return pb.ChallengeResponse(
            challenge=challenge, expires_at=expires_at, coordinator_public_key=self.key.public_key.raw
        )

    async def join(self, request: pb.JoinRequest, peer: str) -> pb.JoinResponse:
        self._check_header(request.header)
        membership = self.config.membership
        envelope = self._open(request.envelope, JOIN, "join request", membership.challenge_ttl_s)
        body = parse_body(JoinBody, envelope.body, sender=envelope.sender, what="join request")
        self._take_challenge(body.challenge, envelope.sender)
        await self._check_not_banned(envelope.sender)
        self._check_admission(body, envelope)

        role = "data" if body.role == "auto" else body.role
        now = time.time()
        certificate = issue_certificate(
            self.key,
            public_key=envelope.signer,
            run_id=self.run_id,
            role=role,
            name=body.name,
            serial=await self.store.next_serial(),
            ttl_s=membership.certificate_ttl_s,
            now=now,
        )
        await self.store.admit(
            PeerRecord(
                peer_id=envelope.sender,
                public_key=envelope.signer.raw,
                name=body.name,
                device=body.device,
                role=role,
                state="online",
                joined_at=now,
                last_seen=now,
                last_seq=0,
                cert_serial=certificate.serial,
                cert_expires_at=certificate.expires_at,
            )
        )
        logger.info(f"admitted {envelope.sender} ({body.name!r}, {body.device}, role {role}) from {peer}")
        answer = {
            "challenge": body.challenge,
            "certificate": certificate.encoded,
            "run_spec": self.config.to_spec(),
            "dht_initial_peers": self.dht_initial_peers,
            "heartbeat_interval_s": membership.heartbeat_interval_s,
            "holds_checkpoint": self.holds_checkpoint(),
        }
        return pb.JoinResponse(envelope=seal(self.key, JOIN_ANSWER, self.run_id, answer))

    async def heartbeat(self, request: pb.HeartbeatRequest, peer: str) -> pb.HeartbeatResponse:
        self._check_header(request.header)
        envelope = self._open(request.envelope, HEARTBEAT, "heartbeat", MAX_REQUEST_AGE_S)
        body = parse_body(HeartbeatBody, envelope.body, sender=envelope.sender, what="heartbeat")
        record = await self._known_peer(envelope)
        now = time.time()
        recorded = await self.store.record_heartbeat(
            envelope.sender,
            seq=body.seq,
            seen_at=now,
            metrics=body.metrics,
            step=body.step,
            param_hash=body.param_hash,
            suspects=body.suspects,
        )
        if not recorded:
            raise ReplayError(f"heartbeat from {envelope.sender} repeats an old sequence number")
        await self._flag_divergence(envelope.sender, body.step)
        if record.state == "offline":
            logger.info(f"{envelope.sender} ({record.name!r}) is back online")
        renewed = b""
        ttl_s = self.config.membership.certificate_ttl_s
        if record.cert_expires_at - now < ttl_s / 2:
            certificate = issue_certificate(
                self.key,
                public_key=envelope.signer,
                run_id=self.run_id,
                role=record.role,
                name=record.name,
                serial=await self.store.next_serial(),
                ttl_s=ttl_s,
                now=now,
            )
            await self.store.renew_certificate(envelope.sender, certificate.serial, certificate.expires_at)
            renewed = certificate.encoded
        return pb.HeartbeatResponse(state="online", certificate=renewed, server_time=now)

    async def _flag_divergence(self, peer_id: str, step: int) -> None:
        if not step:
            return
        diverged = diverged_peers(await self.store.list_peers())
        if peer_id in diverged and self._flagged.get(peer_id) != step:
            self._flagged.pop(peer_id, None)
            self._flagged[peer_id] = step
            while len(self._flagged) > self.limits.max_tracked_callers:
                self._flagged.popitem(last=False)
            logger.warning(
                f"{peer_id} diverged: its parameters at step {step} differ from most peers at that step"
            )

    async def leave(self, request: pb.LeaveRequest, peer: str) -> pb.LeaveResponse:
        self._check_header(request.header)
        envelope = self._open(request.envelope, LEAVE, "leave request", MAX_REQUEST_AGE_S)
        body = parse_body(LeaveBody, envelope.body, sender=envelope.sender, what="leave request")
        record = await self._known_peer(envelope)
        if not await self.store.record_leave(envelope.sender, seq=body.seq, seen_at=time.time()):
            raise ReplayError(f"leave request from {envelope.sender} repeats an old sequence number")
        logger.info(f"{envelope.sender} ({record.name!r}) left" + (f": {body.reason}" if body.reason else ""))
        return pb.LeaveResponse(state="left")

    async def status(self, request: pb.StatusRequest, peer: str) -> pb.StatusResponse:
        self._check_header(request.header, allow_any_run=True)
        records = await self.store.list_peers()
        diverged = diverged_peers(records)
        peers = [
            pb.PeerStatus(
                peer_id=r.peer_id,
                name=r.name,
                state=r.state,
                device=r.device,
                role=r.role,
                last_seen=r.last_seen,
                joined_at=r.joined_at,
                ban_reason=r.ban_reason,
                metrics=r.metrics,
                step=r.step,
                param_hash=r.param_hash,
                diverged=r.peer_id in diverged,
            )
            for r in records
        ]
        return pb.StatusResponse(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            coordinator_peer_id=self.key.peer_id,
            dht_initial_peers=self.dht_initial_peers,
            peers=peers,
            server_time=time.time(),
        )

    async def accuse(self, parts: AsyncIterator[bytes], peer: str) -> pb.AccuseResponse:
        """Judge an accusation by recomputing the aggregate from the signed evidence; ban whoever lied.

        The whole stream must arrive within ``evidence_read_timeout_s``, from a peer with an accusation
        to spare and none in flight, and its declared size must fit the evidence budget, all before it
        waits for the judge: a stalled or flooding accuser holds up only itself."""
        limits = self.limits
        deadline = asyncio.get_running_loop().time() + limits.evidence_read_timeout_s
        late = f"did not arrive within {limits.evidence_read_timeout_s:.0f}s"
        try:
            async with asyncio.timeout_at(deadline):
                first = await _next_part(parts)
                self._check_header(first.header)
                envelope = self._open(first.envelope, ACCUSE, "accusation", MAX_REQUEST_AGE_S)
                await self._known_peer(envelope)
        except TimeoutError:
            raise ProtocolError(f"accusation from {peer} {late}") from None
        sender = envelope.sender
        body = parse_body(AccuseBody, envelope.body, sender=sender, what="accusation")
        self._admit_accusation(sender, body.evidence_bytes)
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    evidence = await _read_evidence(first, parts, body, sender)
            except TimeoutError:
                # Holding the evidence budget open costs the staller every accusation it had left.
                self._accusation_buckets.empty(sender)
                raise ProtocolError(f"the evidence of the accusation from {sender} {late}") from None
            async with self._judging:
                verdict, guilty = await asyncio.to_thread(self._judge, evidence, body.accused, sender)
        finally:
            self._evidence_budget.release(body.evidence_bytes)
            self._accusing.discard(sender)
        if guilty is None:
            raise ProtocolError(
                f"accusation from {sender} against {body.accused} refused, nobody banned: {verdict}"
            )
        convicted = guilty == body.accused
        reason = (verdict if convicted else f"false accusation against {body.accused}: {verdict}")[:512]
        # Evidence proves a conviction; a false accusation's "evidence" is whatever its sender chose to send.
        kept = await self.store.ban(
            guilty,
            reason,
            evidence if convicted else None,
            max_stored_evidence_bytes=limits.stored_evidence_bytes,
        )
        if convicted and not kept:
            logger.warning(f"evidence against {guilty} not kept: the store holds all the evidence it may")
        logger.warning(f"accusation by {sender} against {body.accused}: banned {guilty} ({reason})")
        return pb.AccuseResponse(verdict=reason, banned_peer=guilty)

    def _admit_accusation(self, sender: str, evidence_bytes: int) -> None:
        """Let one more accusation of ``sender`` in, or refuse it; once in, it holds its evidence budget."""
        if sender in self._accusing:
            raise NetworkError(f"{sender} already has an accusation in flight; wait for its verdict")
        if not self._accusation_buckets.take(sender):
            retry_s = self._accusation_buckets.retry_after_s(sender)
            raise NetworkError(f"too many accusations from {sender}; retry in {retry_s:.0f}s")
        if not self._evidence_budget.reserve(evidence_bytes):
            raise NetworkError("the coordinator holds all the evidence it can judge at once; retry later")
        self._accusing.add(sender)

    def _judge(self, data: bytes, accused: str, accuser: str) -> tuple[str, str | None]:
        """(what was found, who is guilty): the accused if the evidence proves it, else the accuser; nobody
        when the evidence is of an averaging prefix this run does not use, whose layout the coordinator
        cannot know (so it cannot show that the accuser lied either)."""
        training = self.config.training
        try:
            evidence = parse_evidence(data)
        except SwarmError as e:
            return f"the evidence does not hold: {e}", accuser
        vector_numel = self._layouts.get(evidence.prefix)
        if vector_numel is None:
            return (
                f"the evidence is of averaging prefix {evidence.prefix[:80]!r}, which this run does not use",
                None,
            )
        try:
            if evidence.accused != accused or accuser not in evidence.members:
                raise ProtocolError("the evidence names another culprit, or a round the accuser was not in")
            aggregator = get_aggregator(training.aggregator, training.aggregator_options)
            codec = get_codec(training.compression, topk_density=training.topk_density)
            verdict = evidence.judge(aggregator, codec, vector_numel=vector_numel)
        except SwarmError as e:
            return f"the evidence does not hold: {e}", accuser
        if verdict is None:
            return "the aggregate is exactly what the rule gives", accuser
        return verdict, accused

    @functools.cached_property
    def _layouts(self) -> dict[str, int]:
        """Each averaging prefix of the run and the length of the vector averaged under it: the run's
        trainable parameters under the run's prefix, and each pipeline stage's under that stage's."""
        from swarm.models import build_model
        from swarm.pipeline.layout import build_stage
        from swarm.pipeline.worker import stage_prefix

        run = self.config

        def trainable(module) -> int:
            return sum(p.numel() for p in module.parameters() if p.requires_grad)

        # Averagers name their prefix with "." replaced by "_" (swarm.averaging.averager).
        layouts = {run.run_id.replace(".", "_"): trainable(build_model(run.model.name, run.model.config))}
        if run.pipeline.stages > 1:
            for index in range(run.pipeline.stages):
                prefix = stage_prefix(run.run_id, index).replace(".", "_")
                layouts[prefix] = trainable(build_stage(run, index))
        return layouts

    # --- wiring into grpc ----------------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, tuple[Any, Callable[[Any, str], Awaitable[Any]]]] = {
            "Challenge": (pb.ChallengeRequest, self.challenge),
            "Join": (pb.JoinRequest, self.join),
            "Heartbeat": (pb.HeartbeatRequest, self.heartbeat),
            "Leave": (pb.LeaveRequest, self.leave),
            "Status": (pb.StatusRequest, self.status),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _guarded(name, request_type, handler),
                request_deserializer=None,
                response_serializer=lambda message: message.SerializeToString(),
            )
            for name, (request_type, handler) in methods.items()
        }
        handlers["Accuse"] = grpc.stream_unary_rpc_method_handler(
            _guarded_stream("Accuse", self.accuse),
            request_deserializer=None,
            response_serializer=lambda message: message.SerializeToString(),
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


async def _read_evidence(
    first: pb.AccusationPart, parts: AsyncIterator[bytes], body: AccuseBody, sender: str
) -> bytes:
    """The evidence bytes the accusation signed for: exactly ``evidence_bytes`` of them, matching its hash."""
    evidence = bytearray(first.evidence)
    while len(evidence) < body.evidence_bytes:
        piece = await _next_part(parts, required=False)
        if piece is None:
            break
        evidence += piece.evidence
    if len(evidence) != body.evidence_bytes:
        raise ProtocolError(
            f"accusation from {sender} carried {len(evidence)} evidence bytes or more, "
            f"not the {body.evidence_bytes} it signed for"
        )
    if hashlib.sha256(evidence).digest() != body.evidence_sha256:
        raise ProtocolError(f"accusation from {sender}: evidence does not match its signed hash")
    return bytes(evidence)


async def _next_part(parts: AsyncIterator[bytes], *, required: bool = True) -> pb.AccusationPart | None:
    try:
        raw = await parts.__anext__()
    except StopAsyncIteration:
        if required:
            raise ProtocolError("accusation stream is empty") from None
        return None
    try:
        return pb.AccusationPart.FromString(raw)
    except (DecodeError, RuntimeWarning) as e:
        raise ProtocolError(f"malformed AccusationPart: {e}") from None


async def _answer(method: str, context: grpc.aio.ServicerContext, handle: Awaitable[Any]) -> Any:
    """Await a handler; a SwarmError becomes its gRPC status and a log line naming the caller."""
    peer = context.peer()
    try:
        return await handle
    except SwarmError as e:
        logger.warning(f"refused {method} from {peer}: {e}")
        error = e
    except Exception:
        logger.exception(f"internal error in {method} from {peer}")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error at the coordinator; see its log")
    await context.abort(
        status_code_for(error),
        str(error),
        trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),),
    )


def _guarded_stream(method: str, handler: Callable[[AsyncIterator[bytes], str], Awaitable[Any]]):
    async def call(parts: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await _answer(method, context, handler(parts.__aiter__(), context.peer()))

    return call


def _guarded(method: str, request_type: Any, handler: Callable[[Any, str], Awaitable[Any]]):
    async def parse_and_handle(raw: bytes, peer: str) -> Any:
        try:
            request = request_type.FromString(raw)
        except (DecodeError, RuntimeWarning) as e:
            raise ProtocolError(f"malformed {request_type.__name__}: {e}") from None
        return await handler(request, peer)

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await _answer(method, context, parse_and_handle(raw, context.peer()))

    return call
