"""Averaging rounds among the peers of a run: hivemind's matchmaking finds the group, our runner reduces.

``Averager`` lives in the peer's own event loop and talks through a replica of the DHT's libp2p
daemon. It registers two handlers under the run's prefix: matchmaking (hivemind's, declaring under one
fixed key with signed values: ``declarations``) and the all-reduce parts (``ButterflyAllReduce``). Given the peer's signing key it also listens for part streams on a TCP
data address, announced to its groupmates in the matchmaking data (see ``transport``), and signs its
matchmaking entry. Its ``PeerPolicy`` says whom it may meet: matchmaking neither leads nor follows a
peer the policy refuses, and every group is checked before its round (``groups.check_group``). Build
one with ``factory.build_averager`` rather than by hand.

Example::

    averager = Averager(dht, prefix="my-run", numel=vector.numel(), aggregator="mean", compression="fp16")
    await averager.start()
    result = await averager.average(vector, weight=64)
    if result is not None and result.complete:
        vector = result.vector
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from protocols import averaging_pb2 as apb
from protocols.envelope import MAX_CLOCK_SKEW_S
from protocols.errors import ConfigError, SwarmError
from protocols.keys import SigningKey
from protocols.version import MAX_ENVELOPE_BYTES
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.allreduce import (
    DEFAULT_CHUNK_VALUES,
    ButterflyAllReduce,
    RoundResult,
    RoundSettings,
    Traffic,
)
from swarm.averaging.archive import InputArchive
from swarm.averaging.compression import DEFAULT_TOPK_DENSITY, get_codec
from swarm.averaging.deadlines import Throughput, round_mbit, transfer_deadline_s
from swarm.averaging.evidence import ENTRY, MAX_MEMBERS, NONCE_BYTES
from swarm.averaging.groups import (
    EntryFit,
    GroupEntryBody,
    GroupRefused,
    VerifiedGroup,
    check_group,
    enough_reducers,
    make_entry,
)
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.matchmaking import RunMatchmaking, closing_rule
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.rounds import PartRouter, RoundRegistry
from swarm.averaging.transport import MAX_CONNECTIONS_PER_PEER, DataPlane, announce_host
from swarm.averaging.verification import Accuser, serve_inputs, validate_round
from swarm.inbound import SMALL_REQUEST_BYTES, UNARY_MAX_BYTES, BoundedServicer, HandlerBound
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner

logger = logging.getLogger(__name__)

#: The widest matchmaking window, in the run's ``matchmaking_time_s`` (see ``Averager.matchmaking_window_s``).
MAX_PATIENCE = 8.0
#: The widest window in seconds: the longest a signed declaration may announce (``declarations``).
MAX_WINDOW_S = 300.0


@dataclass
class GroupRound:
    """A round's group as matchmaking assembled it, with each member's declared weight."""

    group_id: bytes
    peer_ids: list[PeerID]
    weights: list[float]
    extras: list[dict]
    addresses: list[str | None]
    commitments: list[bytes | None] = field(default_factory=list)
    leader: str | None = None  # who announced the group; None for a group of one
    reducers: list[bool] | None = None  # which members reduce a part (None: all); see groups.py
    uplinks_mbit: list[float | None] | None = None  # each member's declared upload rate; see deadlines.py
    signed_entries: list[bytes] = field(default_factory=list)  # the kept members' signed entries
    excluded: list[str] = field(default_factory=list)  # listed members left out (their entries did not hold)


class AveragingServicer(BoundedServicer):
    """The P2P handlers of an averager (hivemind finds the ``rpc_*`` methods by their annotations).
    A part stream's messages are bounded like the data plane's frames; the others are small requests."""

    bounds = {
        "rpc_join_group": lambda self: HandlerBound(MAX_ENVELOPE_BYTES + SMALL_REQUEST_BYTES, 4),
        "rpc_aggregate_part": lambda self: HandlerBound(self.averager.max_frame, MAX_CONNECTIONS_PER_PEER),
        "rpc_round_inputs": lambda self: HandlerBound(SMALL_REQUEST_BYTES, MAX_CONNECTIONS_PER_PEER),
    }
    reply_bytes = dict.fromkeys(bounds, UNARY_MAX_BYTES)  # a chunk at fp32 with its inputs is far less

    def __init__(self, averager: Averager):
        self.averager = averager

    def exempt(self, peer_id: str) -> bool:
        # The coordinator demanding a round's inputs: certified Sybils holding every slot must not make
        # this reducer look as if it refused (coordinator.roundinputs).
        return peer_id == self.averager.policy.judge

    async def admission(self, peer_id: str) -> str | None:
        # Within a follower's wait for the leader's first answer, like matchmaking's own check.
        return await self.averager.policy.admission(peer_id, timeout_s=self.averager.matchmaking_time_s / 4)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> TypingAsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in self.averager.matchmaking.rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: TypingAsyncIterator[apb.PartChunk], context: P2PContext
    ) -> TypingAsyncIterator[apb.PartChunk]:
        async for message in self.averager.route_part(stream, context.remote_id):
            yield message

    async def rpc_round_inputs(
        self, request: apb.InputsRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.SignedInput]:
        # A validator may ask while this reducer still serves slower groupmates: look at live rounds too.
        averager = self.averager
        runner = averager.rounds.lookup(request.group_id)
        async for message in serve_inputs(
            runner, request, context.remote_id, judge=averager.policy.judge, archive=averager.archive
        ):
            yield message


class Averager:
    """A peer's averaging under one prefix: matchmaking, the butterfly all-reduce, and its handlers.

    Build one with ``factory.build_averager`` from the run config; the arguments are its settings.

    Args:
        dht: the running DHT; the averager uses a replica of its libp2p daemon.
        prefix: the averaging key (the run ID, or ``<run_id>.stage<k>`` for a pipeline stage).
        numel: how many values every member's vector holds.
        aggregator, aggregator_options: the robust rule each reducer applies to its part, and its options.
        compression: the wire encoding of the vectors (``fp16``, ``none``, ``int8`` or ``topk``).
        topk_density: with ``topk``, the share of each block of values a sender keeps.
        max_group_size: at most this many peers in one group.
        matchmaking_time_s: how long a leader waits for followers before assembling.
        sender_timeout_s: how long to wait for a groupmate's next message before dropping it, at least:
            a round adds the time one chunk takes at its slowest member's uplink (see ``deadlines``).
        averaging_timeout_s: the most one round (after matchmaking) may take, at least: a round adds
            the time its busiest member needs to send its bytes at the slowest member's uplink.
        max_weight: the largest weight (sample count) a member may declare; larger ones are capped.
        runner_type: the all-reduce class (tests pass a subclass that misbehaves).
        signing_key: signs this peer's group entry and round inputs; None only in unsigned tests.
        record_signer: signs its matchmaking declarations with its certificate (default: none attached).
        data_host, data_port, data_announce_host: the TCP data plane's listen address and the host
            announced to groupmates.
        upload_limiter: the peer's shared upload token bucket.
        policy: ``PeerPolicy``, whom this peer may meet (certified, not banned, not suspected).
        verify_probability: the chance that this peer validates a part of a finished round.
        accuse: sends evidence against a reducer whose result a validator proved wrong.
        hooks: what this peer does where a member could lie (``hooks``); None: an honest peer's.
        data_plane: open the TCP data plane (else every part stream rides libp2p).
        client_mode: this peer cannot be dialed, so it only ever follows in matchmaking, and says so in
            its signed entry: it reduces no part of a round.
        min_reducers: a group needs at least this many members that can be dialed, else it is left.
    """

    matchmaking_type: type[RunMatchmaking] = RunMatchmaking

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        numel: int,
        aggregator: str = "mean",
        compression: str = "fp16",
        topk_density: float = DEFAULT_TOPK_DENSITY,
        max_group_size: int = 64,
        matchmaking_time_s: float = 2.0,
        sender_timeout_s: float = 5.0,
        averaging_timeout_s: float = 30.0,
        max_weight: float = math.inf,
        runner_type: type[ButterflyAllReduce] = ButterflyAllReduce,
        signing_key: SigningKey | None = None,
        data_host: str = "127.0.0.1",
        data_port: int = 0,
        data_announce_host: str | None = None,
        upload_limiter: RateLimiter | None = None,
        aggregator_options: dict | None = None,
        policy: PeerPolicy | None = None,
        verify_probability: float = 0.0,
        accuse: Accuser | None = None,
        hooks: RoundHooks | None = None,
        data_plane: bool = True,
        client_mode: bool = False,
        min_reducers: int = 1,
        record_signer: RecordSigner | None = None,
    ):
        self.dht, self.prefix, self.numel = dht, prefix.replace(".", "_"), numel
        self.aggregator = get_aggregator(aggregator, aggregator_options)
        self.codec = get_codec(compression, topk_density=topk_density)
        self.max_group_size, self.matchmaking_time_s = max_group_size, matchmaking_time_s
        self.sender_timeout_s, self.averaging_timeout_s = sender_timeout_s, averaging_timeout_s
        self.max_weight = max_weight
        self.runner_type = runner_type
        self.signing_key, self.data_host, self.data_port = signing_key, data_host, data_port
        if record_signer is None and signing_key is not None:
            record_signer = RecordSigner(signing_key)
        self.record_signer = record_signer
        self.data_announce_host = data_announce_host
        self.data_plane: DataPlane | None = None
        self.use_data_plane = data_plane
        # A peer others cannot dial (behind NAT) never leads a group: followers could not reach it.
        self.client_mode, self.min_reducers = client_mode, min_reducers
        self.upload_limiter = upload_limiter
        self.traffic = Traffic()
        self.link = Throughput()  # this peer's measured upload rate, declared in its group entries
        self.round_mbit: float | None = None  # the rate the last round counted on (its slowest member's)
        self.last_form_s = 0.0  # how long the last round's matchmaking took
        # Whether this averager's searches count toward the policy's spans of missed rounds (``missed``):
        # a second tier's do not, so that a representative's tier search spends nobody's span.
        self.counts_searches = True
        # The longest a search of this averager may run and its round's entries be checked after (None: the
        # run's search): a second tier's waits for groups that end their first tier later (``tiers``).
        self.longest_search_s: float | None = None
        if verify_probability > 0 and signing_key is None:
            # Validators refuse unsigned inputs, so every reducer would be suspected and shunned.
            raise ConfigError(
                f"verify_probability {verify_probability} needs signed round inputs: pass signing_key"
            )
        self.verify_probability, self.accuse = verify_probability, accuse
        # The trainer's sender checks (``swarm.training.sendercheck.SenderChecks``), set after building:
        # ``keep(runner, signed_entries)`` at a complete round, ``check(runner, outcomes)`` after its checks.
        self.sender_checks = None
        self.hooks = hooks if hooks is not None else RoundHooks()
        # Without a policy the averager admits anyone: only local benchmarks and tests build it so.
        self.policy = policy if policy is not None else PeerPolicy(None, prefix)
        # Live rounds, where inbound parts find theirs, and the last few kept for validators.
        self.rounds: RoundRegistry[ButterflyAllReduce] = RoundRegistry()
        self.archive = InputArchive()  # the inputs of chunks this peer aggregated, for the coordinator
        # Where an inbound part stream, from either transport, finds its round (see rounds.py).
        self.route_part = PartRouter(
            self.rounds,
            silence_s=lambda: self.stream_silence_s,
            wait_s=sender_timeout_s,
            banned=lambda: self.banned,
            denies=self.hooks.denies_rounds,
        )
        self._verifications: set[asyncio.Task] = set()
        self._nonce = b""
        self._entry = b""
        self.schema_hash = hashlib.sha256(f"{self.prefix}/{numel}/{self.codec.schema}".encode()).digest()
        self.p2p = None
        self.matchmaking: Matchmaking | None = None
        self._lock = asyncio.Lock()

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    @property
    def max_frame(self) -> int:
        """The largest part-stream message the data plane accepts: a full chunk in this run's codec, with
        the signed list of inputs a reducer sends along (and a margin for the other fields)."""
        return self.codec.max_bytes(DEFAULT_CHUNK_VALUES) + ENTRY.size * MAX_MEMBERS + 4096

    @property
    def led_last_group(self) -> bool:
        """Whether this peer led the last group its matchmaking assembled."""
        return self.matchmaking.leader == self.peer_id

    @property
    def entry_max_age_s(self) -> float:
        """A gathered entry older than this is stale: the longest search, plus the clock skew allowed."""
        longest_s = max(self.averaging_timeout_s + 3 * self.matchmaking_time_s, self.longest_search_s or 0.0)
        return longest_s + MAX_CLOCK_SKEW_S

    @property
    def network_mbit(self) -> float | None:
        """The upload rate this peer counts on for transfers outside a round: the lower of its own
        measured rate and the rate its last round counted on (None: nothing measured yet)."""
        known = [r for r in (self.link.mbit, self.round_mbit) if r is not None]
        return min(known) if known else None

    @property
    def stream_silence_s(self) -> float:
        """How long a part stream may be silent before its first message: a full chunk from a sender
        feeding a few reducers at once."""
        return transfer_deadline_s(
            3 * self.codec.max_bytes(DEFAULT_CHUNK_VALUES), self.network_mbit, floor_s=self.sender_timeout_s
        )

    def transfer_deadline_s(self, nbytes: int) -> float:
        """How long moving ``nbytes`` outside a round (a state download) may take: the round deadline's
        floor plus the time at ``network_mbit`` (see ``deadlines``)."""
        return transfer_deadline_s(nbytes, self.network_mbit, floor_s=self.averaging_timeout_s)

    def round_settings(self) -> RoundSettings:
        """What this peer's next round runs under (built per round: a benchmark swaps the rule between
        rounds)."""
        return RoundSettings(
            p2p=self.p2p, servicer_type=AveragingServicer, prefix=self.prefix, aggregator=self.aggregator,
            codec=self.codec, sender_timeout_s=self.sender_timeout_s, round_timeout_s=self.averaging_timeout_s,
            key=self.signing_key, data_plane=self.data_plane, upload_limiter=self.upload_limiter,
            traffic=self.traffic, hooks=self.hooks,
        )  # fmt: skip

    @property
    def banned(self) -> frozenset[str]:
        """Peer IDs on the run's ban list (change them through ``policy.set_bans``)."""
        return self.policy.banned

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()
        self.servicer = AveragingServicer(self)
        await self.servicer.add_p2p_handlers(self.p2p, namespace=self.prefix)
        self.matchmaking = self.matchmaking_type(
            self.p2p,
            self.schema_hash,
            self.dht,
            servicer_type=AveragingServicer,
            prefix=self.prefix,
            target_group_size=self.max_group_size,
            min_group_size=2,
            min_matchmaking_time=self.matchmaking_time_s,
            request_timeout=max(0.5, self.matchmaking_time_s / 2),  # set per search: RunMatchmaking.widen
            client_mode=self.client_mode,
            policy=self.policy,
            signer=self.record_signer,
            hooks=self.hooks,
        )
        if self.signing_key is not None and self.use_data_plane:
            await self._start_data_plane()

    async def _start_data_plane(self) -> None:
        if self.signing_key.peer_id != self.p2p.peer_id.to_base58():
            raise SwarmError(
                f"the signing key is {self.signing_key.peer_id}, but the DHT runs as {self.p2p.peer_id}"
            )
        host = self.data_announce_host
        if host is None:
            maddrs = await self.p2p.get_visible_maddrs()
            visible = [str(m).split("/")[2] for m in maddrs if str(m).startswith(("/ip4/", "/ip6/"))]
            host = announce_host(self.data_host, visible)
        plane = DataPlane(
            self.signing_key,
            self.prefix,
            self.route_part,
            max_frame=self.max_frame,
            admission=self.policy.admission,
        )
        try:
            address = await plane.start(self.data_host, self.data_port, host)
        except SwarmError as e:
            logger.warning(f"{e}; groupmates will reach this peer through libp2p only")
            return
        self.data_plane = plane
        logger.info(f"averaging data address {address}")

    async def checks_done(self, timeout_s: float) -> None:
        """Wait until the checks of every round so far have ended, the accusations they filed included
        (a filing starts while its round's checks end); raises TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while self._verifications:
                await asyncio.gather(*list(self._verifications))

    async def shutdown(self) -> None:
        for task in list(self._verifications):
            task.cancel()
        if self.data_plane is not None:
            await self.data_plane.close()
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.prefix)

    async def find_group(
        self,
        weight: float,
        extra: dict | None = None,
        expected_size: int | None = None,
        fits: EntryFit | None = None,
        failed_tries: int = 0,
        window_s: float | None = None,
        closes_when: Callable[[dict[str, GroupEntryBody]], bool] | None = None,
    ) -> GroupRound | None:
        """Gather with the peers looking for a group now; None when no group formed in time.

        hivemind's leader assembles as soon as it has ``min_group_size`` members once its window opens,
        so the minimum is 2: a peer that trains alone uses ``solo_group`` instead of matchmaking. With
        ``expected_size`` (the peers the caller knows to be ready for this round) a leader assembles the
        moment that many have joined, rather than waiting out the window. A member whose signed entry
        ``fits`` refuses is excluded and suspected (``groups.check_group``). ``failed_tries``: searches
        at the caller's step that formed no group, which widen the window (``matchmaking_window_s``).
        ``window_s``: a window of the caller's instead, within ``longest_search_s``. ``closes_when``: as
        leader, assemble as soon as it holds for the followers' entries gathered so far (peer ID -> entry,
        each opened under its own key; ``matchmaking.closing_rule``), as it does at ``expected_size``.
        """
        self._nonce = os.urandom(NONCE_BYTES)
        body = GroupEntryBody(
            schema_hash=self.schema_hash,
            weight=float(weight),
            commit=hashlib.sha256(self._nonce).digest(),
            data=self.data_plane.address if self.data_plane is not None and not self.client_mode else None,
            extra=extra or {},
            dialable=not self.client_mode,
            uplink_mbit=None if self.link.mbit is None else round(self.link.mbit, 3),
            certificate=self.record_signer.certificate if self.record_signer is not None else b"",
        )
        self._entry = make_entry(self.signing_key, self.prefix, body)
        target = self.max_group_size if expected_size is None else expected_size
        self.matchmaking.target_group_size = max(2, min(self.max_group_size, target))
        if window_s is None:
            window_s = self.matchmaking_window_s(failed_tries)
            if failed_tries and window_s > self.matchmaking_window_s(failed_tries - 1):
                logger.info(
                    f"{failed_tries} searches at this step formed no group; waiting {window_s:.1f}s for a group now"
                )
            # A group that has not formed within a few windows will not: give up and let the caller re-check
            # whether the run moved on without this peer.
            search_s = min(self.averaging_timeout_s, 3 * window_s + 2.0)
        else:
            longest_s = self.longest_search_s or self.averaging_timeout_s
            window_s = min(max(window_s, self.matchmaking_time_s), longest_s / 2, MAX_WINDOW_S)
            search_s = window_s + self.matchmaking_time_s + 2.0
        self.matchmaking.widen(window_s, self.matchmaking_time_s)
        self.matchmaking.full = None
        if closes_when is not None:
            self.matchmaking.full = closing_rule(
                closes_when, prefix=self.prefix, schema_hash=self.schema_hash, signed=self.signing_key is not None,
                max_age_s=self.entry_max_age_s, limit=self.max_group_size,
            )  # fmt: skip
        now = get_dht_time()
        step = StepControl(
            scheduled_time=now + window_s,
            deadline=now + search_s,
            allow_retries=False,
            weight=weight,
            data_for_gather=self._entry,
        )
        step.attach(MPFuture(), MPFuture())
        step.allow_allreduce()
        try:
            info = await self.matchmaking.look_for_group(step)
        except (MatchmakingException, asyncio.TimeoutError) as e:
            logger.info(f"no averaging group formed: {e!r}")
            return None
        except Exception as e:  # a leader that vanished mid-request breaks its stream with no common base
            logger.warning(f"matchmaking failed: {e!r}; will try again")
            return None
        finally:
            self.matchmaking.full = None
        if info is None:
            return None
        return await self._checked(info, fits)

    async def _checked(self, info, fits: EntryFit | None = None) -> GroupRound | None:
        """The group with only members whose signed entries hold; None when it must be left."""
        peers = {p.to_base58(): p for p in info.peer_ids}
        names = [p.to_base58() for p in info.peer_ids]
        leader = self.matchmaking.leader.to_base58() if self.matchmaking.leader else "unknown"
        short = info.group_id.hex()[:8]
        try:
            group: VerifiedGroup = check_group(
                names, info.gathered, me=self.peer_id.to_base58(), my_entry=self._entry, leader=leader,
                prefix=self.prefix, schema_hash=self.schema_hash, signed=self.signing_key is not None,
                refusal=self.policy.listed_refusal, max_age_s=self.entry_max_age_s, fits=fits,
                certify=self.policy.certificate_refusal, leader_at_fault=self.policy.leader_at_fault,
                max_members=max(2, self.max_group_size),  # the floor of matchmaking's target size
            )  # fmt: skip
        except GroupRefused as e:
            blame = f"retrying without {e.culprit}" if e.culprit else "blaming nobody"
            logger.warning(f"leaving group {short}: {e.reason}; {blame}")
            if e.culprit is not None and e.culprit != self.peer_id.to_base58():
                self.policy.suspect(e.culprit, e.reason, leader_only=e.culprit == leader)
            return None
        suspects = group.suspects
        for peer, reason in group.excluded.items():
            logger.warning(f"excluding {peer} from group {short}: {reason}")
            if peer in suspects:  # it signed what it claims: the round goes on without it
                self.policy.suspect(peer, reason)
        if len(group.peer_ids) < 2:
            logger.info(f"leaving group {short}: fewer than 2 members with valid entries")
            return None
        # Nobody is to blame: members behind NAT say so truthfully. Every member leaves the same groups.
        short_of = enough_reducers(group, self.min_reducers)
        if short_of is not None:
            logger.warning(f"leaving group {short}: {short_of}")
            return None
        entries = group.entries
        return GroupRound(
            info.group_id,
            [peers[p] for p in group.peer_ids],
            [min(e.weight, self.max_weight) for e in entries],
            [dict(e.extra) for e in entries],
            [e.data for e in entries],
            [e.commit for e in entries],
            self.matchmaking.leader.to_base58() if self.matchmaking.leader else None,
            group.reducers,
            group.uplinks_mbit,
            group.signed,
            list(group.excluded),
        )

    def matchmaking_window_s(self, failed_tries: int) -> float:
        """How long a leader waits for followers after ``failed_tries`` searches at one step formed no
        group: the run's ``matchmaking_time_s``, doubled for each, up to ``MAX_PATIENCE`` times it. On a
        loaded machine declarations, lookups and join requests take longer than a window meant for a
        quiet one, and every peer giving up at the same moment formed no group for minutes; a peer
        that is truly gone costs a wider window only at the step where it is missed."""
        widened = self.matchmaking_time_s * min(MAX_PATIENCE, 2.0 ** min(max(failed_tries, 0), 16))
        # Within the search's deadline (``averaging_timeout_s`` at most), so a gathered entry stays fresh, and
        # within the longest window a declaration may announce (``matchmaking_time_s``'s bound, 300 s).
        return min(widened, max(self.matchmaking_time_s, min(self.averaging_timeout_s / 2, MAX_WINDOW_S)))

    def solo_group(self, weight: float, extra: dict | None = None) -> GroupRound:
        """A group of this peer alone, for a run with no one else at this step."""
        return GroupRound(
            b"solo-" + get_dht_time().hex().encode(), [self.peer_id], [weight], [extra or {}], [None], [None]
        )

    async def average(
        self,
        vector: torch.Tensor,
        weight: float,
        extra: dict | None = None,
        *,
        alone: bool = False,
        expected_size: int | None = None,
        out: torch.Tensor | None = None,
        fits: EntryFit | None = None,
        failed_tries: int = 0,
        keep_signed: bool = False,
        window_s: float | None = None,
        closes_when: Callable[[dict[str, GroupEntryBody]], bool] | None = None,
    ) -> tuple[GroupRound, RoundResult] | None:
        """Find a group (or, ``alone``, none) and all-reduce ``vector`` in it; None when no group formed.

        Alone, the vector still goes through the wire encoding, so a solo step applies exactly what a
        group of one would. ``out`` (float32, ``numel`` values) receives the result instead of a new
        tensor; it holds garbage where parts of an incomplete round are missing. ``fits``, ``failed_tries``,
        ``window_s`` and ``closes_when``: see ``find_group``. ``keep_signed``: a complete round's result carries its
        signed output (``RoundResult.signed``), which a second-tier representative hands its group.
        """
        async with self._lock:
            started = time.monotonic()
            if alone:
                group = self.solo_group(weight, extra)
            else:
                group = await self.find_group(
                    weight,
                    extra,
                    expected_size,
                    fits,
                    failed_tries,
                    window_s=window_s,
                    closes_when=closes_when,
                )
            self.last_form_s = time.monotonic() - started  # what matchmaking took (round journal)
            if group is None:
                # A search broken at once (a leader whose entry does not open) does not move the count that
                # spans of missed rounds pass in; one that waited out the window does (``missed``).
                if self.counts_searches and self.last_form_s >= self.matchmaking_time_s:
                    self.policy.search_counted()
                return None
            runner = self.runner_type(
                self.round_settings(),
                group_id=group.group_id,
                peer_ids=group.peer_ids,
                weight=weight,
                local=vector,
                nonce=self._nonce,
                commitments=group.commitments or None,
                addresses=group.addresses,
                reducers=group.reducers,
                mbit=round_mbit(group.uplinks_mbit) if group.uplinks_mbit else None,
                out=out,
                keep_signed=keep_signed,
            )
            self.rounds.add(group.group_id, runner)
            if not runner.reduces(runner.index):
                logger.info(
                    f"round {group.group_id.hex()[:8]}: this peer cannot be dialed, so it reduces no part; "
                    f"{sum(map(runner.reduces, range(len(runner.members))))} of {len(runner.members)} members do"
                )
            try:
                result = await asyncio.wait_for(runner.run(), timeout=runner.round_timeout_s)
            except asyncio.TimeoutError:
                result = RoundResult(
                    runner.output, False, dict(runner.dropped), runner.bytes_sent, runner.bytes_received,
                    list(runner.failed_reducers), list(runner.denied_by), runner.sent,
                )  # fmt: skip
            finally:
                self.rounds.finish(group.group_id, runner)
                self._archive_later(runner)
                self.link.observe(*runner.send_sample())
                if len(group.peer_ids) > 1:
                    self.round_mbit = runner.deadlines.mbit
            # The retry forms without a reducer that did not deliver or denied the round; one that delivered
            # a complete round's part works off its misses (``missed``).
            failed, denied, delivered = runner.reducer_outcomes(result)
            self.policy.blame_round(failed, denied, delivered=delivered)
            if self.counts_searches:
                self.policy.search_counted()
            if result.complete and len(group.peer_ids) > 1:
                if self.sender_checks is not None:  # the state the senders computed at, before its update
                    await self.sender_checks.keep(runner, group.signed_entries)
                self._verify_later(runner)
            return group, result

    def _archive_later(self, runner: ButterflyAllReduce) -> None:
        """Keep the inputs this peer aggregated once the round's draw is settled (``InputArchive``)."""
        if runner.revealed is None or runner.hooks.refuses_inputs:  # a rehearsed reducer that shows nothing
            return
        runner.revealed.add_done_callback(lambda _: self.archive.keep(runner))

    def _verify_later(self, runner: ButterflyAllReduce) -> None:
        async def checks() -> list:
            outcomes = await validate_round(
                runner, probability=self.verify_probability, servicer_type=AveragingServicer, p2p=self.p2p,
                aggregator=self.aggregator, codec=self.codec, timeout_s=runner.round_timeout_s,
                accuse=self._file_later if self.accuse is not None else None, suspect=self.policy.suspect,
            )  # fmt: skip
            if self.sender_checks is not None:
                await self.sender_checks.check(runner, outcomes)
            return outcomes

        task = asyncio.create_task(checks())
        self._verifications.add(task)
        task.add_done_callback(self._verifications.discard)

    async def _file_later(self, accused: str, evidence, verdict: str) -> None:
        """File an accusation without waiting for its verdict (the coordinator may replay for minutes), so
        that the round's sender checks run while their state copy is still kept."""

        async def file() -> None:
            try:
                await self.accuse(accused, evidence, verdict)
            except Exception as e:
                logger.warning(f"could not file the accusation against {accused}: {e!r}")

        task = asyncio.create_task(file())
        self._verifications.add(task)
        task.add_done_callback(self._verifications.discard)
