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
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coordinator.accusations import (
    EvidenceReader,
    StageStates,
    evidence_kind,
    judge_accusation,
    next_part,
    run_layouts,
)
from coordinator.contributions import ContributionStates
from coordinator.judging import JudgingTurns, judging_for
from coordinator.limits import EvidenceBudget, KeyedBuckets, RefusalLog, ServiceLimits, caller_key
from coordinator.roundinputs import RoundInputs
from coordinator.standing import Standing
from coordinator.store import PeerRecord, Store
from coordinator.witness import witnessed_rounds
from protocols import coordinator_pb2 as pb
from protocols.certificates import issue_certificate
from protocols.envelope import MAX_CLOCK_SKEW_S, Envelope, open_envelope, seal
from protocols.errors import (
    AccusationInFlight,
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
    RUN_STATE,
    AccuseBody,
    HeartbeatBody,
    JoinBody,
    LeaveBody,
    parse_body,
    token_proof,
)
from protocols.version import PROTOCOL_VERSION
from swarm.config import RunConfig
from swarm.rpc import ERROR_METADATA_KEY, status_code_for
from swarm.training.sendercheck import KIND as CONTRIBUTION_KIND

logger = logging.getLogger(__name__)

SERVICE_NAME = "swarm.coordinator.v1.Coordinator"
# A heartbeat or leave older than this is refused as a replay even if its sequence number were new.
MAX_REQUEST_AGE_S = 120.0
# A Status page holds at most this many peers and bytes (gRPC refuses messages over 1 MiB).
STATUS_PAGE_PEERS = 256
STATUS_PAGE_BYTES = 512 << 10
# Rows of peers whose certificates expired this long ago are pruned (the ban list's clock-skew grace).
PRUNE_GRACE_S = 600.0
MAX_CLOCK_OFFSETS = 1 << 16  # peers whose clock offset and session start are remembered (oldest go first)
CLOSE_WAIT_S = 10.0  # how long stopping waits for the judgments it cancelled


class CoordinatorService:
    """The coordinator's gRPC handlers: join by challenge-response, heartbeat, leave, status, accuse.

    Args:
        config: the run this coordinator serves; joins for any other run are refused.
        key: the coordinator's signing key, which signs certificates and answers.
        store: the run's record (peers, certificates, bans, credit).
        dht_initial_peers: the DHT bootstrap addresses handed to every admitted peer.
        limits: per-caller and global limits on challenges, accusations and evidence bytes.
        holds_checkpoint: whether the coordinator holds a checkpoint now (told to each peer it admits).
        standing: the credit it signs into heartbeat answers (the checkpoint keeper's too; default: its own).
    """

    def __init__(
        self,
        config: RunConfig,
        key: SigningKey,
        store: Store,
        dht_initial_peers: list[str],
        limits: ServiceLimits | None = None,
        holds_checkpoint: Callable[[], bool] = lambda: True,
        finished_step: Callable[[], int | None] = lambda: None,
        checkpoint_step: Callable[[], int | None] = lambda: None,
        outside_dht: Callable[[list[PeerRecord], float], set[str]] = lambda records, now: set(),
        stage_checkpoint: Callable[[int], object | None] = lambda stage: None,
        stage_states: StageStates | None = None,
        round_inputs: RoundInputs | None = None,
        contribution_states: ContributionStates | None = None,
        standing: Standing | None = None,
    ):
        self.config = config
        self.holds_checkpoint = holds_checkpoint
        self.finished_step, self.checkpoint_step = finished_step, checkpoint_step
        self.outside_dht, self.stage_checkpoint = outside_dht, stage_checkpoint
        self.stage_states = stage_states  # a stage's states at recent steps, for stage evidence
        self.round_inputs = round_inputs  # asks a reducer for the inputs behind its aggregate
        self.contribution_states = contribution_states  # the state a sender check was recomputed on
        self.standing = standing or Standing(store)  # credit by peer, signed into heartbeat answers
        # Each peer's clock minus ours, from its last signed heartbeat or join (within the skew bound), and
        # when its current session joined (the store keeps a peer's first join); a peer not seen joining
        # since this service started counts as joined when it started.
        self._clock_offsets: OrderedDict[str, float] = OrderedDict()
        self._sessions: OrderedDict[str, float] = OrderedDict()
        self._started_at = time.time()
        # When each peer's witnessed rounds were last read (see ``heartbeat``), bounded like the clocks.
        self._witnessed_at: OrderedDict[str, float] = OrderedDict()
        self._witness_every_s = config.membership.heartbeat_interval_s / 2
        self._standing_sent: OrderedDict[str, float] = OrderedDict()  # which standing each peer was sent
        # Refused requests, logged a bounded number of times a minute (a flood is counted, not written out).
        self._refusals = RefusalLog(logger.warning)
        self.key, self.store = key, store
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
        self._evidence_budget = EvidenceBudget(
            limits.evidence_budget_bytes, limits.evidence_share_per_address_bytes
        )
        self._accusing: set[str] = set()
        self._judgments: set[asyncio.Task] = set()  # accusations being judged (outliving their calls)
        # peer -> the last step at which it was reported diverged (one log line per peer and step)
        self._flagged: OrderedDict[str, int] = OrderedDict()
        # Held only while recomputing from evidence and a state in memory; caller addresses take turns.
        self._judging = JudgingTurns()

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
        self._check_header(request.header, allow_any_run=True)
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
            challenge=challenge,
            expires_at=expires_at,
            coordinator_public_key=self.key.public_key.raw,
            run_id=self.run_id,
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
        if role != "data" and self.config.pipeline.stages < 2:
            raise ProtocolError(
                f"join request from {envelope.sender}: field 'role': {role!r} needs a run split into pipeline "
                f"stages; run {self.run_id!r} is data-parallel (join as 'auto' or 'data')"
            )
        known = await self.store.get_peer(envelope.sender)
        if known is not None and known.role != role:
            raise ProtocolError(
                f"join request from {envelope.sender}: field 'role': this key joined as {known.role!r}; a key "
                f"keeps its role (its credit is counted by it): join as {known.role!r} or with a new identity"
            )
        now = time.time()
        self._note_clock(envelope.sender, envelope.issued_at - now)
        _remember(self._sessions, envelope.sender, now)
        await self.store.prune(now, grace_s=PRUNE_GRACE_S)
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
        self._standing_sent.pop(envelope.sender, None)  # a restarted peer holds no standing: send it again
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
        self._note_clock(envelope.sender, envelope.issued_at - now)
        rounds, refused = [], []
        # Each witnessed entry is a signature check: a peer's rounds are read at most twice a heartbeat
        # interval (it resends them), off the event loop, so back-to-back heartbeats cost one check each.
        if body.rounds and now - self._witnessed_at.get(envelope.sender, 0.0) >= self._witness_every_s:
            _remember(self._witnessed_at, envelope.sender, now)
            rounds, refused = await asyncio.to_thread(
                witnessed_rounds, body.rounds, run_id=self.run_id, reporter=envelope.sender, now=now
            )
        for reason in refused:  # its other rounds still count; these credit nobody
            self._refusals.refused(
                "Heartbeat", peer, ProtocolError(f"heartbeat from {envelope.sender}: {reason}")
            )
        recorded = await self.store.record_heartbeat(
            envelope.sender,
            seq=body.seq,
            seen_at=now,
            metrics=body.metrics,
            step=body.step,
            param_hash=body.param_hash,
            suspects=body.suspects,
            rounds=rounds,
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
        run_state = {
            "seq": body.seq, "max_steps": self.config.training.max_steps or 0,
            "finished_step": self.finished_step() or 0,
        }  # fmt: skip
        standing_at, credit = await self.standing.current()
        # Only a newer one than the peer holds, and each one once per peer: at most one per refresh.
        if standing_at > body.standing_at and self._standing_sent.get(envelope.sender) != standing_at:
            _remember(self._standing_sent, envelope.sender, standing_at)
            run_state.update(standing_at=standing_at, standing=credit)
        return pb.HeartbeatResponse(
            state="online", certificate=renewed, server_time=now,
            run_state=seal(self.key, RUN_STATE, self.run_id, run_state),
        )  # fmt: skip

    async def _flag_divergence(self, peer_id: str, step: int) -> None:
        if not step:
            return
        record = await self.store.get_peer(peer_id)
        majority = (await self.store.majority_hashes(step)).get(step)
        diverged = (
            record is not None
            and record.state == "online"
            and (record.param_hash not in ("", majority) or bool(self.outside_dht([record], time.time())))
        )
        if diverged and self._flagged.get(peer_id) != step:
            self._flagged.pop(peer_id, None)
            self._flagged[peer_id] = step
            while len(self._flagged) > self.limits.max_tracked_callers:
                self._flagged.popitem(last=False)
            logger.warning(
                f"{peer_id} diverged: its parameters at step {step} differ from most peers at that step, "
                "or its progress has not reached this coordinator's DHT (a split swarm)"
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
        """One page of the peer table: at most ``STATUS_PAGE_PEERS`` rows and ``STATUS_PAGE_BYTES``
        bytes whatever the table holds, so the answer always fits gRPC's message cap."""
        self._check_header(request.header, allow_any_run=True)
        if len(request.after_peer_id) > 128:
            raise ProtocolError("StatusRequest field 'after_peer_id' is longer than 128 characters")
        limit = min(request.max_peers or STATUS_PAGE_PEERS, STATUS_PAGE_PEERS)
        records, total = await self.store.peer_page(after=request.after_peer_id, limit=limit)
        majority = await self.store.majority_hashes()
        outside = self.outside_dht(records, time.time())
        response = pb.StatusResponse(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            coordinator_peer_id=self.key.peer_id,
            dht_initial_peers=self.dht_initial_peers,
            server_time=time.time(),
            total_peers=total,
            max_steps=self.config.training.max_steps or 0,
            checkpoint_step=self.checkpoint_step() or 0,
            finished_step=self.finished_step() or 0,
        )
        size = response.ByteSize()
        for r in records:
            row = pb.PeerStatus(
                peer_id=r.peer_id, name=r.name, state=r.state, device=r.device, role=r.role,
                last_seen=r.last_seen, joined_at=r.joined_at, ban_reason=r.ban_reason, metrics=r.metrics,
                step=r.step, param_hash=r.param_hash,
                diverged=r.state == "online"
                and ((bool(r.param_hash) and r.param_hash != majority.get(r.step)) or r.peer_id in outside),
            )  # fmt: skip
            size += row.ByteSize() + 8
            if size > STATUS_PAGE_BYTES:
                break
            response.peers.append(row)
        if response.peers and (len(response.peers) < len(records) or len(records) == limit):
            response.next_after_peer_id = response.peers[-1].peer_id
        return response

    async def accuse(self, parts: AsyncIterator[bytes], peer: str) -> pb.AccuseResponse:
        """Judge an accusation by recomputing the aggregate from the signed evidence; ban whoever lied.

        The whole stream must arrive within ``evidence_read_timeout_s``, from a peer with an accusation
        to spare and none in flight. Its evidence is charged to the budget as it arrives, within its
        address's share; when the budget is full it waits its turn rather than being refused, so
        stalled streams delay a true accusation only until their own deadlines cut them off."""
        limits = self.limits
        deadline = asyncio.get_running_loop().time() + limits.evidence_read_timeout_s
        late = f"did not arrive within {limits.evidence_read_timeout_s:.0f}s"
        try:
            async with asyncio.timeout_at(deadline):
                first = await next_part(parts)
                self._check_header(first.header)
                envelope = self._open(first.envelope, ACCUSE, "accusation", MAX_REQUEST_AGE_S)
                await self._known_peer(envelope)
        except TimeoutError:
            raise ProtocolError(f"accusation from {peer} {late}") from None
        sender = envelope.sender
        body = parse_body(AccuseBody, envelope.body, sender=sender, what="accusation")
        if await self.store.get_peer(body.accused) is None:
            # No honest round holds an uncertified member, and a ban of a key that never held a
            # certificate would stay on the ban list forever: refuse it, banning nobody.
            raise ProtocolError(f"accusation from {sender}: {body.accused} is not a peer of this run")
        self._admit_accusation(sender)
        reader = EvidenceReader(self._evidence_budget, caller_key(peer))
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    evidence = await reader.read(first, parts, body, sender)
            except TimeoutError:
                # Holding evidence bytes open costs the staller every accusation it had left.
                self._accusation_buckets.empty(sender)
                raise ProtocolError(f"the evidence of the accusation from {sender} {late}") from None
        except BaseException:
            reader.release()
            self._accusing.discard(sender)
            raise
        # The judgment and its ban outlive this call: a replay that takes longer than the accuser waits
        # (a DiLoCo window is many steps) still bans whoever it proves wrong, and the accusation stays in
        # flight until it ends, so asking again starts no second replay.
        judgment = asyncio.create_task(self._judge(evidence, body, sender, peer, reader))
        self._judgments.add(judgment)
        judgment.add_done_callback(self._judgment_done)
        return await asyncio.shield(judgment)

    async def _judge(
        self, evidence: bytes, body: AccuseBody, sender: str, peer: str, reader: EvidenceReader
    ) -> pb.AccuseResponse:
        limits = self.limits
        try:
            # A sender check replays the accused's work, each further one again: once it is convicted, no
            # more (a ban for a false accusation alone is no conviction: its sender check still convicts).
            # Other evidence may convict someone else (a stage-mate, a false accuser): judged.
            banned = (
                await self.store.conviction(body.accused)
                if evidence_kind(evidence) == CONTRIBUTION_KIND
                else None
            )
            if banned is not None:
                logger.info(f"accusation by {sender} against {body.accused}: already banned ({banned})"[:600])
                return pb.AccuseResponse(verdict=f"already banned: {banned}"[:512], banned_peer=body.accused)
            with judging_for(caller_key(peer)):
                verdict, guilty = await judge_accusation(
                    self.config, lambda: self._layouts, evidence, body.accused, sender, judging=self._judging,
                    stage_checkpoint=self.stage_checkpoint, stage_states=self.stage_states,
                    stage_state_timeout_s=limits.stage_state_timeout_s, round_inputs=self.round_inputs,
                    contribution_states=self.contribution_states, joined_at=self._joined_at,
                    banned=self.store.conviction,
                )  # fmt: skip
        finally:
            reader.release()
            self._accusing.discard(sender)
        if guilty is None:
            raise ProtocolError(
                f"accusation from {sender} against {body.accused} refused, nobody banned: {verdict}"
            )
        # Stage evidence may prove the accused's stage-mate wrong instead: the accuser could not tell which.
        convicted = guilty != sender
        if convicted and guilty != body.accused and await self.store.get_peer(guilty) is None:
            raise ProtocolError(
                f"accusation from {sender}: {guilty} is not a peer of this run; nobody banned"
            )
        reason = (verdict if convicted else f"false accusation against {body.accused}: {verdict}")[:512]
        # Evidence proves a conviction; a false accusation's "evidence" is whatever its sender chose to send.
        kept = await self.store.ban(
            guilty,
            reason,
            evidence if convicted else None,
            max_stored_evidence_bytes=limits.stored_evidence_bytes,
            false_accuser=not convicted,
            accuser_address=caller_key(peer),
        )
        if convicted and not kept:
            logger.warning(f"evidence against {guilty} not kept: the store holds all the evidence it may")
        logger.warning(f"accusation by {sender} against {body.accused}: banned {guilty} ({reason})")
        return pb.AccuseResponse(verdict=reason, banned_peer=guilty)

    async def close(self) -> None:
        """End the judgments still running or waiting their turn (their accusers file again), waiting for
        at most ``CLOSE_WAIT_S``: a replay already on a thread finishes there, unawaited."""
        judgments = list(self._judgments)
        for judgment in judgments:
            judgment.cancel()
        if judgments:
            await asyncio.wait(judgments, timeout=CLOSE_WAIT_S)

    def _judgment_done(self, task: asyncio.Task) -> None:
        self._judgments.discard(task)
        if not task.cancelled() and task.exception() is not None:  # its caller may have stopped waiting
            logger.info(f"accusation not upheld: {task.exception()}"[:600])

    def _note_clock(self, peer_id: str, offset_s: float) -> None:
        _remember(self._clock_offsets, peer_id, offset_s)

    async def _joined_at(self, peer_id: str) -> float | None:
        """When ``peer_id``'s current session joined, by its own clock (ours shifted by the offset its
        heartbeats show, else by the skew bound, the latest it can be), if it is online now."""
        record = await self.store.get_peer(peer_id)
        if record is None or record.state != "online":
            return None
        joined = self._sessions.get(peer_id, self._started_at)
        return joined + self._clock_offsets.get(peer_id, MAX_CLOCK_SKEW_S)

    def _admit_accusation(self, sender: str) -> None:
        """Let one more accusation of ``sender`` in, or refuse it."""
        if sender in self._accusing:
            raise AccusationInFlight(f"{sender} already has an accusation in flight; wait for its verdict")
        if not self._accusation_buckets.take(sender):
            retry_s = self._accusation_buckets.retry_after_s(sender)
            raise NetworkError(f"too many accusations from {sender}; retry in {retry_s:.0f}s")
        self._accusing.add(sender)

    @functools.cached_property
    def _layouts(self) -> dict[str, int]:
        return run_layouts(self.config)

    # --- wiring into grpc ----------------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, self.method_handlers())

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Every RPC this service answers, by method name: ``generic_handler`` serves exactly these (the
        hostile-peer harness, ``swarm.byzantine.hostile``, must send to each: tests/test_hostile.py)."""
        methods: dict[str, tuple[Any, Callable[[Any, str], Awaitable[Any]]]] = {
            "Challenge": (pb.ChallengeRequest, self.challenge),
            "Join": (pb.JoinRequest, self.join),
            "Heartbeat": (pb.HeartbeatRequest, self.heartbeat),
            "Leave": (pb.LeaveRequest, self.leave),
            "Status": (pb.StatusRequest, self.status),
        }
        refusals = self._refusals
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _guarded(name, request_type, handler, refusals),
                request_deserializer=None,
                response_serializer=lambda message: message.SerializeToString(),
            )
            for name, (request_type, handler) in methods.items()
        }
        handlers["Accuse"] = grpc.stream_unary_rpc_method_handler(
            _guarded_stream("Accuse", self.accuse, refusals),
            request_deserializer=None,
            response_serializer=lambda message: message.SerializeToString(),
        )
        return handlers


async def _answer(
    method: str, context: grpc.aio.ServicerContext, handle: Awaitable[Any], refusals: RefusalLog
) -> Any:
    """Await a handler; a SwarmError becomes its gRPC status and a log line naming the caller (a flood's
    refusals are counted, not each written out: ``RefusalLog``)."""
    peer = context.peer()
    try:
        return await handle
    except SwarmError as e:
        refusals.refused(method, peer, e)
        error = e
    except Exception:
        logger.exception(f"internal error in {method} from {peer}")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error at the coordinator; see its log")
    await context.abort(
        status_code_for(error),
        str(error),
        trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),),
    )


def _guarded_stream(
    method: str, handler: Callable[[AsyncIterator[bytes], str], Awaitable[Any]], refusals: RefusalLog
):
    async def call(parts: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await _answer(method, context, handler(parts.__aiter__(), context.peer()), refusals)

    return call


def _guarded(
    method: str, request_type: Any, handler: Callable[[Any, str], Awaitable[Any]], refusals: RefusalLog
):
    async def parse_and_handle(raw: bytes, peer: str) -> Any:
        try:
            request = request_type.FromString(raw)
        except (DecodeError, RuntimeWarning) as e:
            raise ProtocolError(f"malformed {request_type.__name__}: {e}") from None
        return await handler(request, peer)

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await _answer(method, context, parse_and_handle(raw, context.peer()), refusals)

    return call


def _remember(table: OrderedDict[str, float], peer_id: str, value: float) -> None:
    table[peer_id] = value
    table.move_to_end(peer_id)
    while len(table) > MAX_CLOCK_OFFSETS:
        table.popitem(last=False)
