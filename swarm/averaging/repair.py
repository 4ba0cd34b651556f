"""Rounds that finish despite a withholder: a part whose reducer did not deliver is re-reduced in the round.

When the reducer of part ``p`` fails a sender (silence, a broken stream, an answer that does not hold
up), the sender turns to ``p``'s *substitute*: the next member after ``p``, in member order, that reduces
a part (``substitute``). It streams the substitute the same signed contributions to ``p`` it sent the
reducer (Ed25519 signs the same bytes the same), and takes back ``p``'s aggregate:

- **relayed**: when the substitute itself received the reducer's whole aggregate, it passes on those
  signed chunks, so members that got the part from its reducer and those that did not hold the same bits;
- **re-reduced**: otherwise the substitute waits until every other member but the reducer has sent its
  chunks of ``p`` or fell silent for the round's silence deadline, aggregates them and its own with the
  run's rule and the same seed (``aggregation_seed`` names the part, not who reduces it), and signs the
  result over the exact inputs it used, as a reducer does. It re-reduces only with more than half of the
  group's inputs, the floor every sender checks; with fewer the part stays missing, as before.

A re-reduced part is checked by validators like any other: its answers name the substitute as their
signer (``ButterflyAllReduce.signers``), the substitute shows the inputs it aggregated, and the evidence
names it (``RoundEvidence.signer``). Reveals wait for repairs (a sender's phase one ends only once every
part arrived, by either path, or failed), so the substitute, like a reducer, signs before it can know
the draw. The reducer that did not deliver is still reported and avoided (``failed_reducers``).

A reducer that delivers to some members and not others, including the substitute, leaves those it
served with its aggregate and the rest with the substitute's: the trainers' state check (the majority
of a group holding one state hash) then moves the fewer to the state most hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import torch

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import PublicKey
from swarm.averaging.evidence import (
    SignedInput,
    aggregate_message,
    aggregation_seed,
    contribution_message,
    input_entries,
    reduce_chunk,
)

logger = logging.getLogger(__name__)


class PartRepair:
    """The substitute's side of one part's repair in one round (``runner``: the ``ButterflyAllReduce``)."""

    def __init__(self, runner: Any, part: int):
        self.runner, self.part = runner, part
        chunks = len(runner.part_chunks[part]) - 1
        self.inputs: list[dict[int, tuple[torch.Tensor, SignedInput]]] = [{} for _ in range(chunks)]
        self.weights: dict[int, float] = {}
        self.results: list[apb.PartChunk | None] = [None] * chunks
        self.evidence: list[list[SignedInput]] = [[] for _ in range(chunks)]  # what a validator may ask for
        self.relayed = False
        # Senders it waits for: every member but the part's reducer, less those already silent to us.
        self.active = {i for i in runner._active if i != part} | {runner.index}
        self.changed, self.done = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self._run())

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.results)

    def deliver(self, sender: int, chunk: int, values: torch.Tensor, signed: SignedInput) -> None:
        if sender in self.active and not self.done.is_set():
            self.inputs[chunk][sender] = (values, signed)
            self.changed.set()

    def drop(self, sender: int, reason: str) -> None:
        if sender in self.active and sender != self.runner.index:
            self.active.discard(sender)
            logger.info(
                f"repair of part {self.part} in round {self.runner.group_id.hex()[:8]} goes on without "
                f"{self.runner.members[sender]}: {reason}"
            )
            self.changed.set()

    async def _run(self) -> None:
        runner, part = self.runner, self.part
        try:
            # This peer's own stream to the reducer must have ended (its deadlines bound it).
            await asyncio.wait_for(runner._direct_done[part].wait(), runner.round_timeout_s)
            if all(runner.received[part]):
                self.results = [runner.answers[part].get(c) for c in range(len(self.results))]
                self.relayed = True
                return
            for chunk in range(len(self.results)):
                message = runner._contribution(part, chunk)
                lo, hi = runner._chunk(part, chunk)
                own = runner.codec.decode_contribution(message.data, hi - lo, sender="this peer")
                signed = SignedInput(runner.index, message.data, message.signature, message.weight)
                self.deliver(runner.index, chunk, own, signed)
            for chunk in range(len(self.results)):
                await self._reduce(chunk)
        except Exception as e:
            logger.warning(f"repairing part {part} of round {runner.group_id.hex()[:8]} failed: {e!r}")
            self.results = [None] * len(self.results)
        finally:
            self.done.set()

    async def _reduce(self, chunk: int) -> None:
        runner, part = self.runner, self.part
        while not self.active.issubset(self.inputs[chunk]):
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=runner.sender_timeout_s)
            except asyncio.TimeoutError:
                for sender in self.active - set(self.inputs[chunk]):
                    self.drop(sender, f"sent nothing for {runner.sender_timeout_s:.1f}s")
        senders = sorted(self.active)
        if 2 * len(senders) <= len(runner.members):
            raise ProtocolError(f"only {len(senders)} of {len(runner.members)} members sent their inputs")
        inputs = [self.inputs[chunk][s] for s in senders]
        encoded = await asyncio.to_thread(
            reduce_chunk, runner.aggregator, runner.codec, [v for v, _ in inputs],
            [s.weight for _, s in inputs], aggregation_seed(runner.group_id, part, chunk),
        )  # fmt: skip
        lo, hi = runner._chunk(part, chunk)
        if runner.attack is not None:  # a rehearsed bad reducer lies as a substitute too
            honest = runner.codec.decode(encoded, hi - lo, sender="self")
            encoded = runner.codec.encode(runner.attack.reduce(honest))
        entries = input_entries([(s.sender_index, s.weight, s.data) for _, s in inputs])
        me = runner.members[runner.index]
        signature = runner._sign(aggregate_message(runner.digest, part, chunk, me, entries, encoded))
        self.results[chunk] = apb.PartChunk(
            part_index=part, chunk_index=chunk, data=encoded, signature=signature, included=entries
        )
        self.evidence[chunk] = [signed for _, signed in inputs]
        self.inputs[chunk].clear()

    async def consume(self, sender: int, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk]) -> None:
        """Take one sender's chunks of the part; a chunk that does not hold up ends its share."""
        runner, expected, message = self.runner, 0, first
        peer = runner.members[sender]
        try:
            while True:
                if message.part_index != self.part or message.chunk_index != expected:
                    raise ProtocolError(f"sent part {message.part_index} chunk {message.chunk_index}")
                if runner.key is not None:
                    PublicKey.from_peer_id(peer).verify(
                        message.signature,
                        contribution_message(runner.digest, self.part, expected, peer, message.weight, message.data),
                    )  # fmt: skip
                if not math.isfinite(message.weight) or message.weight < 0:
                    raise ProtocolError(f"claims weight {message.weight!r}")
                if self.weights.setdefault(sender, message.weight) != message.weight:
                    raise ProtocolError("changed its weight mid-round")
                lo, hi = runner._chunk(self.part, expected)
                runner._count(received=len(message.data))
                values = runner.codec.decode_contribution(message.data, hi - lo, sender=peer)
                self.deliver(
                    sender,
                    expected,
                    values,
                    SignedInput(sender, message.data, message.signature, message.weight),
                )
                expected += 1
                if expected == len(self.results):
                    return
                message = await runner._next(stream, runner.sender_timeout_s)
        except Exception as e:
            self.drop(sender, f"{e!r}")

    def trim(self, drawn: int | None) -> None:
        self.evidence = [inputs if c == drawn else [] for c, inputs in enumerate(self.evidence)]


class PartRepairs:
    """The repair side of ``ButterflyAllReduce`` (a mixin; its constructor holds the round's state)."""

    def substitute(self, part: int) -> int | None:
        """The member that stands in for the reducer of ``part``: the next one after it that reduces."""
        count = len(self.members)
        return next((i % count for i in range(part + 1, part + count) if self.reduces(i % count)), None)

    def _repair_for(self, part: int) -> PartRepair:
        repair = self.repairs.get(part)
        if repair is None:
            repair = self.repairs[part] = PartRepair(self, part)
            self._tasks.append(repair.task)
        return repair

    async def _serve_repair(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: int
    ) -> AsyncIterator[apb.PartChunk]:
        """A groupmate's contributions to a part whose reducer failed it; that part's aggregate back."""
        part = first.part_index
        if (
            part >= len(self.members)
            or sender == part
            or not self.reduces(part)
            or self.substitute(part) != self.index
        ):
            yield apb.PartChunk(code=apb.BAD_CHUNK, error=f"this member does not stand in for part {part}")
            return
        if part not in self.repairs and self.revealed is not None and self.revealed.done():
            yield apb.PartChunk(code=apb.BAD_GROUP, error="this round is over here")
            return
        repair = self._repair_for(part)
        consumer = asyncio.create_task(repair.consume(sender, first, stream))
        try:
            await asyncio.wait_for(repair.done.wait(), self.round_timeout_s)
            if getattr(self.attack, "withhold", False):  # a rehearsed withholder withholds here too
                return
            for result in repair.results:
                if result is None:
                    return
                await self._throttle(len(result.data))
                self._count(sent=len(result.data))
                yield result
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    async def _recover(self, part: int) -> bool:
        """After the reducer of ``part`` failed this peer: the part from its substitute; whether it came."""
        substitute = self.substitute(part)
        if substitute is None or substitute == part:
            return False
        if substitute == self.index:
            repair = self._repair_for(part)
            await repair.done.wait()
            if not repair.complete or repair.relayed:
                return False
            for chunk, message in enumerate(repair.results):
                self._take(part, chunk, message)
            self.signers[part] = self.index
            return True
        try:
            signer = await self._recover_from(part, substitute)
        except Exception as e:
            logger.warning(
                f"substitute {self.members[substitute]} of part {part} failed in round "
                f"{self.group_id.hex()[:8]}: {e!r}"
            )
            return False
        if signer != part:
            self.signers[part] = signer
        return True

    async def _recover_from(self, part: int, substitute: int) -> int:
        chunks = len(self.part_chunks[part]) - 1
        sent: list[bytes] = []

        async def outgoing() -> AsyncIterator[apb.PartChunk]:
            for chunk in range(chunks):
                message = self._contribution(part, chunk)
                sent.append(hashlib.sha256(message.data).digest())
                await self._throttle(len(message.data))
                self._count(sent=len(message.data))
                yield message

        stream = await self._open(substitute, outgoing())
        signer = None
        try:
            for expected in range(chunks):
                # The substitute first waits out its own stream to the reducer and the other senders.
                message = await self._next(stream, 4 * self.sender_timeout_s)
                if message.code != apb.OK:
                    raise ProtocolError(f"answered {apb.Code.Name(message.code)}: {message.error[:200]}")
                if message.part_index != part or message.chunk_index != expected:
                    raise ProtocolError(f"sent part {message.part_index} chunk {message.chunk_index}")
                # A relayed aggregate is signed by the reducer; a re-reduced one by the substitute.
                candidates = [signer] if signer is not None else [part, substitute]
                signer = self._signed_by(part, expected, message, sent[expected], candidates)
                self._count(received=len(message.data))
                self._take(part, expected, message)
        finally:
            if hasattr(stream, "aclose"):
                with contextlib.suppress(Exception):
                    await stream.aclose()
        return signer if signer is not None else part

    def _signed_by(
        self, part: int, chunk: int, message: apb.PartChunk, sent: bytes, candidates: list[int]
    ) -> int:
        error: Exception | None = None
        for signer in candidates:
            try:
                self._check_answer(part, chunk, message, sent, signer=signer)
                return signer
            except Exception as e:
                error = e
        raise ProtocolError(f"an answer of part {part} chunk {chunk} does not hold up: {error!r}")

    def _take(self, part: int, chunk: int, message: apb.PartChunk) -> None:
        lo, hi = self._chunk(part, chunk)
        self.output[lo:hi] = self.codec.decode(message.data, hi - lo, sender=self.members[part])
        self.answers[part][chunk] = message
        self.received[part][chunk] = True
