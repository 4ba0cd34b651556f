"""Butterfly all-reduce in which every peer of the group ends with the same bits.

The vector is cut into one contiguous part per peer. Every peer streams its chunks of part ``k`` to
peer ``k``, which aggregates them with the run's rule and streams back the *encoded* result: the same
bytes to every sender, and the reducer decodes those very bytes for itself. A member that nobody can
dial (``reducers``, from its signed group entry) gets an empty part: it sends its contributions and
receives the results over streams it opens, like hivemind's client mode. hivemind's runner instead
adds compressed deltas to each peer's own values, which leaves peers differing in the low bits.

Faults: a sender that is silent for longer than the round's silence deadline (``sender_timeout_s`` plus
the time one chunk takes at the round's rate, see ``deadlines``) or sends a chunk of the wrong part,
order, size or encoding is dropped from the aggregation with a log line naming it, and the round goes
on without it. A part whose reducer fails a sender comes from the part's substitute instead (see
``repair``); when that fails too the part is missing, the caller sees ``complete=False`` and must not
apply the round (it retries, or resynchronizes from peers that completed it).

Signatures: given the peer's key, every contribution and every aggregate chunk is signed (see
``evidence``). A reducer signs, with its output, the exact inputs it aggregated (sender, weight, data
hash); a sender refuses an aggregate whose signature fails, that leaves out most of the group, or that
lists an input of this sender other than the one it sent. A member whose matchmaking data carried no
nonce commitment is left out of the round by everyone.

Two phases: members reveal their nonces (the group's draw of validators, see ``verification``) only
after every part has arrived or failed for them, on the same streams, so no reducer knows who checks
it before it has signed and delivered its aggregate. ``run()`` returns after the first phase;
``revealed`` completes after the second.

Layout of the code: this module holds what the whole round shares (its group, layout, output, counters
and the two phases) and composes three objects, each with its own state: ``sender`` (a
``sender.PartSender``: streams this peer's chunks of the other parts and checks what comes back),
``reducer`` (a ``reducer.PartReducer``: checks, aggregates, signs and returns this peer's own part) and
``repairs`` (a ``repair.PartRepairs``: a substitute's side of a repair, and a sender's turn to one). A
rehearsal or a test swaps one of them through ``sender_type``, ``reducer_type`` or ``repairs_type``.

Transport: a part stream goes over the reducer's announced TCP data address when it has one and answers
(see ``transport``), and over hivemind's libp2p streams otherwise; both carry the same ``PartChunk``
messages and reach the same ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID, ServicerBase

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.compression import Codec
from swarm.averaging.deadlines import round_deadlines
from swarm.averaging.evidence import (
    DEFAULT_CHUNK_VALUES,
    SignedInput,
    chunk_bounds,
    draw_seed,
    drawn_chunk,
    layout_chunk_values,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.reducer import PartReducer
from swarm.averaging.repair import PartRepairs
from swarm.averaging.sender import PartSender
from swarm.averaging.transport import DataPlane
from swarm.ratelimit import RateLimiter

logger = logging.getLogger(__name__)


__all__ = [
    "DEFAULT_CHUNK_VALUES",
    "ButterflyAllReduce",
    "RoundResult",
    "RoundSettings",
    "SignedOutput",
    "Traffic",
    "chunk_bounds",
    "split_bounds",
]


@dataclass
class Traffic:
    """Bytes of tensor data a peer sent and received, over all its rounds."""

    sent: int = 0
    received: int = 0


@dataclass
class RoundResult:
    """What one peer got from a round: the aggregated vector and whether every part of it arrived.

    The byte counts are those of the moment the vector was complete; a reducer may still be sending
    its part to slower groupmates then (``Traffic`` counts those bytes too).
    """

    vector: torch.Tensor
    complete: bool
    dropped: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    failed_reducers: list[str] = field(default_factory=list)
    denied_by: list[str] = field(default_factory=list)  # reducers that said they know no such round
    # What the wire carried of this peer's own vector (decoded; zero where a chunk never went out):
    # with a sparse codec, ``vector - sent`` is what error feedback keeps for the next round.
    sent: torch.Tensor | None = None
    # With ``keep_signed``: each part's signer and its aggregate chunks as signed, for a complete round.
    signed: SignedOutput | None = None
    # A step's combined result (``swarm.training.tiered``): the checked certificates of its second tier's
    # groups, each naming its members and their signed total weight. Empty for a group's own result.
    tier_groups: list[dict] = field(default_factory=list)


@dataclass
class SignedOutput:
    """A complete round's output as its signers signed it: per part, the member that signed the aggregate
    (its reducer, or the substitute that repaired it) and its chunks in order (none for a part nobody
    reduces). Whoever holds the round's signed entries can check it (``tiers.TierCheck``)."""

    signers: list[int]
    chunks: list[list[apb.PartChunk]]


@dataclass
class RoundSettings:
    """What every round of one peer runs under, whoever its group is: the peer's libp2p daemon and data
    plane, the run's rule and wire codec, the silence and round deadlines' floors, the key that signs its
    contributions and aggregates, its upload limiter and traffic counters, and its hooks (honest but in a
    rehearsal, see ``hooks``). The averager builds one per round from its own settings."""

    p2p: P2P
    servicer_type: type[ServicerBase]
    prefix: str
    aggregator: AggregatorFn
    codec: Codec
    sender_timeout_s: float
    round_timeout_s: float = 30.0
    key: SigningKey | None = None
    data_plane: DataPlane | None = None
    upload_limiter: RateLimiter | None = None
    traffic: Traffic = field(default_factory=Traffic)
    hooks: RoundHooks = field(default_factory=RoundHooks)
    chunk_values: int | None = None  # values per chunk; None: the layout's for the group size


class ButterflyAllReduce:
    """One round among ``peer_ids`` (in the same order on every peer); ``run()`` returns a RoundResult.

    ``settings`` holds what the peer's rounds share; the rest is this round's: its group (ID, members,
    their nonce commitments, data addresses and which of them reduce), this peer's ``weight``, vector and
    nonce, the slowest member's uplink (``mbit``, for the deadlines) and an optional output buffer.
    """

    sender_type: type[PartSender] = PartSender
    reducer_type: type[PartReducer] = PartReducer
    repairs_type: type[PartRepairs] = PartRepairs

    def __init__(
        self,
        settings: RoundSettings,
        *,
        group_id: bytes,
        peer_ids: Sequence[PeerID],
        weight: float,
        local: torch.Tensor,
        nonce: bytes = b"",
        commitments: Sequence[bytes | None] | None = None,
        addresses: Sequence[str | None] | None = None,
        reducers: Sequence[bool] | None = None,
        mbit: float | None = None,
        out: torch.Tensor | None = None,
        keep_signed: bool = False,
    ):
        p2p, key, hooks, codec = settings.p2p, settings.key, settings.hooks, settings.codec
        chunk_values, sender_timeout_s = settings.chunk_values, settings.sender_timeout_s
        self.p2p, self.servicer_type, self.prefix = p2p, settings.servicer_type, settings.prefix
        self.group_id, self.peer_ids = group_id, list(peer_ids)
        self.addresses = list(addresses) if addresses is not None else [None] * len(self.peer_ids)
        self.refusal: str | None = None
        self.commitments: list[bytes | None] = [None] * len(self.peer_ids)
        flags = list(reducers) if reducers is not None else [True] * len(self.peer_ids)
        if commitments is not None:
            flags = self._keep_committed(list(commitments), nonce, flags)
        if not any(flags):
            self.refusal = "no member of the group can be dialed to reduce a part"
            flags = [True] * len(flags)
        # Members nobody can dial reduce no part (see split_bounds); the round's digest fixes the layout.
        self.reducers = reducer_mask(flags)
        self.index = self.peer_ids.index(p2p.peer_id)
        self.weight = float(weight)
        self.key, self.nonce, self.hooks = key, nonce, hooks
        self.members = [p.to_base58() for p in self.peer_ids]
        self.digest = round_digest(
            self.prefix, group_id, self.members, [c for c in self.commitments if c], self.reducers
        )
        self.reveals: dict[int, bytes] = {self.index: nonce}
        self.local: torch.Tensor | None = local.detach().to(torch.float32).flatten()
        self.numel = self.local.numel()
        self.aggregator, self.codec = settings.aggregator, codec
        if chunk_values is None:
            chunk_values = layout_chunk_values(len(self.peer_ids), codec.bytes_per_value)
        self.chunk_values = chunk_values
        self.connect_timeout_s = sender_timeout_s / 2
        self.part_bounds = split_bounds(self.numel, len(self.peer_ids), self.reducers)
        # From the configured floors, the bytes each member moves and the slowest member's uplink (mbit).
        self.deadlines = round_deadlines(
            [hi - lo for lo, hi in zip(self.part_bounds[:-1], self.part_bounds[1:], strict=True)],
            chunk_bytes=codec.max_bytes(chunk_values), bytes_per_value=codec.max_bytes(chunk_values) / chunk_values,
            mbit=mbit, silence_floor_s=sender_timeout_s, round_floor_s=settings.round_timeout_s,
        )  # fmt: skip
        self.sender_timeout_s, self.round_timeout_s = self.deadlines.silence_s, self.deadlines.round_s
        # A sender reveals once every part has arrived or failed for it: a failed reducer's wait, plus the
        # slowest reducer's work on a loaded machine. Only the background check waits this long.
        self.reveal_timeout_s = 8 * self.sender_timeout_s
        self.data_plane, self.upload_limiter = settings.data_plane, settings.upload_limiter
        self.traffic = settings.traffic
        # Every value is written before a complete round returns; a caller's reused buffer spares a fresh
        # allocation (and its page faults) per round.
        self.output = out if out is not None else torch.empty_like(self.local)
        self.sent = torch.zeros_like(self.local)

        # A member that reduces nothing has no chunk at all (not one empty chunk): nobody streams to it.
        self.part_chunks = [
            chunk_bounds(hi - lo, chunk_values) if self.reduces(part) else [0]
            for part, (lo, hi) in enumerate(zip(self.part_bounds[:-1], self.part_bounds[1:], strict=True))
        ]
        self.received = [[False] * (len(c) - 1) for c in self.part_chunks]

        self.answers: list[dict[int, apb.PartChunk]] = [{} for _ in self.peer_ids]  # aggregates we got
        self.changed = asyncio.Event()  # a contribution, a drop or a reveal arrived
        self.dropped: dict[str, str] = {}
        self.failed_reducers: list[str] = []
        self.denied_by: list[str] = []
        self.bytes_sent = self.bytes_received = 0
        self._first_send: float | None = None
        self.send_window_s = 0.0  # from the first byte this peer sent until its phase one ended
        # Phase one ends when every part has arrived or failed for this peer; then it reveals its nonce.
        # Nobody streams to a member that reduces no part: it waits for no part of its own and no reveal.
        self._unsettled = {p for p in range(len(self.peer_ids)) if self.reduces(p) or p == self.index}
        self.delivered = asyncio.Event()
        self.heard: set[int] = {self.index}  # members whose reveal arrived, or whose stream to us ended
        self._senders = set(range(len(self.peer_ids))) if self.reduces(self.index) else {self.index}
        self.tasks: list[asyncio.Task] = []
        self.revealed: asyncio.Task | None = None
        self.kept_inputs: dict[tuple[int, int], SignedInput] = {}  # own inputs kept after trimming
        self.signers: dict[int, int] = {}  # parts that came from a substitute's re-reduction: its index
        self.closed = False
        self.keep_signed = keep_signed
        self.sender = self.sender_type(self)
        self.reducer = self.reducer_type(self)
        self.repairs = self.repairs_type(self)

    def _keep_committed(self, commitments: list[bytes | None], nonce: bytes, flags: list[bool]) -> list[bool]:
        """Leave out members with no nonce commitment (all honest members see the same list); returns
        the reducer flags of those kept."""
        me = self.peer_ids.index(self.p2p.peer_id)
        if commitments[me] is not None and commitments[me] != hashlib.sha256(nonce).digest():
            self.refusal = "the group lists a nonce commitment for this peer that is not its own"
        keep = [i for i, c in enumerate(commitments) if c is not None or i == me]
        for i in set(range(len(commitments))) - set(keep):
            logger.warning(
                f"leaving {self.peer_ids[i].to_base58()} out of round {self.group_id.hex()[:8]}: "
                "it committed to no nonce"
            )
        self.peer_ids = [self.peer_ids[i] for i in keep]
        self.addresses = [self.addresses[i] for i in keep]
        self.commitments = [commitments[i] for i in keep]
        return [flags[i] for i in keep]

    # --- what the composed parts share ---------------------------------------------------------------

    def reduces(self, part: int) -> bool:
        """Whether member ``part`` reduces a part of the vector (one nobody can dial does not)."""
        return not self.reducers or self.reducers[part]

    def reducer_outcomes(self, result: RoundResult) -> tuple[list[str], list[str], list[str]]:
        """The other reducers of this round by what they did for this peer: (did not deliver, denied the
        round, delivered). A denier whose signed contribution to this peer's part arrived knew the round: it
        withheld, whatever it answered. Only a complete round shows who delivered."""
        knew = {m for m in result.denied_by if self.reducer.contributed(self.members.index(m))}
        failed = [*result.failed_reducers, *sorted(knew)]
        denied = [m for m in result.denied_by if m not in knew]
        delivered = [
            member for i, member in enumerate(self.members)
            if result.complete and i != self.index and self.reduces(i)
            and member not in failed and member not in denied
        ]  # fmt: skip
        return failed, denied, delivered

    def chunk_range(self, part: int, chunk: int) -> tuple[int, int]:
        """Where ``chunk`` of ``part`` lies in the vector: (first index, one past the last)."""
        base, bounds = self.part_bounds[part], self.part_chunks[part]
        return base + bounds[chunk], base + bounds[chunk + 1]

    def chunk_count(self, part: int) -> int:
        return len(self.part_chunks[part]) - 1

    def send_sample(self) -> tuple[int, float]:
        """(bytes of contributions this peer sent, seconds from its first send until its phase one ended,
        or until now): a measure of its upload throughput that errs low. Every contribution has arrived
        once every part has (each aggregate needs it); the aggregates this peer sends as a reducer may
        still sit in socket buffers then, so they are left out, and with them up to half of the link's use.
        """
        if self._first_send is None:
            return 0, 0.0
        window = self.send_window_s or asyncio.get_running_loop().time() - self._first_send
        return self.sender.contributed_bytes, window

    def count(self, *, sent: int = 0, received: int = 0) -> None:
        """Bytes of tensor data that went out or came in, for this round and the peer's traffic."""
        if sent and self._first_send is None:
            self._first_send = asyncio.get_running_loop().time()
        self.bytes_sent += sent
        self.bytes_received += received
        self.traffic.sent += sent
        self.traffic.received += received

    async def throttle(self, nbytes: int) -> None:
        """Wait until the peer's upload limit lets ``nbytes`` go out."""
        if self._first_send is None:  # the wait for the first bytes counts as sending time
            self._first_send = asyncio.get_running_loop().time()
        if self.upload_limiter is not None:
            await self.upload_limiter.acquire(nbytes)

    def settle(self, part: int) -> None:
        """``part`` arrived or failed for this peer; once every part has, phase one is over."""
        self._unsettled.discard(part)
        if not self._unsettled:
            self.delivered.set()

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message) if self.key is not None else b""

    async def next(self, stream: AsyncIterator[apb.PartChunk], timeout_s: float) -> apb.PartChunk:
        return await asyncio.wait_for(stream.__anext__(), timeout_s)

    @property
    def shared_seed(self) -> bytes | None:
        """The group's random draw: every member's revealed nonce, in member order; None if one is missing."""
        if len(self.reveals) < len(self.members):
            return None
        return draw_seed(self.digest, [self.reveals[i] for i in range(len(self.members))])

    # --- the round's two phases ----------------------------------------------------------------------

    def _result(self, complete: bool) -> RoundResult:
        return RoundResult(
            self.output, complete, dict(self.dropped), self.bytes_sent, self.bytes_received,
            list(self.failed_reducers), list(self.denied_by), self.sent,
            self._signed_output() if complete and self.keep_signed else None,
        )  # fmt: skip

    def _signed_output(self) -> SignedOutput:
        """Every part's aggregate chunks as signed (taken before the reveal phase trims them)."""
        chunks = []
        for part in range(len(self.members)):
            if not self.reduces(part):
                chunks.append([])
            elif part == self.index and part not in self.signers:
                chunks.append(list(self.reducer.results))
            else:
                chunks.append([self.answers[part][c] for c in range(self.chunk_count(part))])
        return SignedOutput([self.signers.get(p, p) for p in range(len(self.members))], chunks)

    async def run(self) -> RoundResult:
        """Phase one: every part arrives (or fails). The reveals go on in ``revealed`` afterwards."""
        if self.refusal is not None:
            logger.warning(f"leaving round {self.group_id.hex()[:8]}: {self.refusal}")
            return self._result(False)
        others = [p for p in range(len(self.peer_ids)) if p != self.index and self.reduces(p)]
        self.tasks.append(asyncio.create_task(self.reducer.reduce_own_part()))
        self.tasks += self.sender.start(others)
        try:
            await self.delivered.wait()
        except BaseException:
            self.close()
            raise
        if self._first_send is not None:
            self.send_window_s = asyncio.get_running_loop().time() - self._first_send
        self.revealed = asyncio.create_task(self._reveal_phase())
        return self._result(all(all(part) for part in self.received))

    async def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: PeerID
    ) -> AsyncIterator[apb.PartChunk]:
        """An inbound part stream from a groupmate: its chunks of this peer's own part go to ``reducer``,
        its chunks of a part whose reducer failed it to ``repairs`` (when this peer stands in for it)."""
        if sender not in self.peer_ids or sender == self.p2p.peer_id:
            yield apb.PartChunk(code=apb.NOT_IN_GROUP, error="not a member of this averaging group")
            return
        if not self.reduces(self.index):
            yield apb.PartChunk(code=apb.BAD_CHUNK, error="this member reduces no part in this round")
            return
        index = self.peer_ids.index(sender)
        handler = self.reducer.serve if first.part_index == self.index else self.repairs.serve
        async for message in handler(first, stream, index):
            yield message

    async def _reveal_phase(self) -> None:
        """Wait (bounded) for our reveal to go out and every groupmate's reveal to come in."""
        deadline = asyncio.get_running_loop().time() + self.reveal_timeout_s + 2 * self.sender_timeout_s
        try:
            await asyncio.wait(self.tasks, timeout=deadline - asyncio.get_running_loop().time())
            while not self._senders <= self.heard | set(self.reveals):
                self.changed.clear()
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left)
        finally:
            self.close()
        self._trim()

    def _trim(self) -> None:
        """Once the draw is known, keep only what a validator can ask for: each part's drawn chunk (our
        input to it, the aggregate we got, and for our own part the inputs we aggregated). A round
        whose draw is incomplete keeps everything, since its validators draw chunks of their own."""
        seed = self.shared_seed
        if seed is None:
            return
        drawn = [drawn_chunk(seed, part, self.chunk_count(part)) for part in range(len(self.part_chunks))]
        self.kept_inputs = {
            (part, chunk): self.sender.own_input(part, chunk)
            for part, chunk in enumerate(drawn)
            if chunk is not None
        }
        self.local = None
        self.answers = [{c: a for c, a in got.items() if c == drawn[p]} for p, got in enumerate(self.answers)]
        self.reducer.trim(drawn[self.index])
        self.repairs.trim(drawn)

    # --- what validators read ------------------------------------------------------------------------

    def own_input(self, part: int, chunk: int) -> SignedInput | None:
        """This peer's signed contribution to one chunk of a part; None for a chunk that no validator
        drew once the round is trimmed."""
        return self.sender.own_input(part, chunk)

    def held_input(self, part: int, chunk: int, sender: int) -> SignedInput | None:
        """Member ``sender``'s signed input to ``chunk`` of ``part`` as this peer aggregated it, for its
        own part or one it re-reduced as a substitute; None if it holds none."""
        if part == self.index:
            inputs = self.reducer.evidence[chunk]
        else:
            repair = self.repairs.by_part.get(part)
            inputs = repair.evidence[chunk] if repair is not None else []
        return next((i for i in inputs if i.sender_index == sender), None)

    def aggregated_inputs(self) -> dict[tuple[int, int], list[SignedInput]]:
        """The signed inputs of each chunk this peer aggregated and still holds, by (part, chunk): its own
        part's, and those of parts it re-reduced as a substitute (after ``_trim``: the drawn chunks)."""
        held = {
            (self.index, chunk): list(items) for chunk, items in enumerate(self.reducer.evidence) if items
        }
        for part, repair in self.repairs.by_part.items():
            held.update({(part, chunk): list(items) for chunk, items in enumerate(repair.evidence) if items})
        return held

    def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
