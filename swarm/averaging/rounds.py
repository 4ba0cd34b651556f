"""Where an inbound part finds its round: the averager's registry of live and recent rounds.

A round exists on this peer from the moment matchmaking hands it a group until its runner ends; a
groupmate may learn of the group a moment earlier and open its part stream first. Both transports
(``transport.DataPlane`` and libp2p's ``rpc_aggregate_part``) hand such a stream to the averager's
``PartRouter``, which reads its first message, refuses a banned sender and asks
``RoundRegistry.wait_for``: it answers at once for a live round, or wakes when a round is added and
looks again, or gives up after the caller's deadline. The router then hands the stream down to that
round's ``serve``: an inbound part only ever goes down, from transport to router to round. Finished
rounds stay readable (``lookup``) for the validators who ask for their inputs right after; only the
last ``keep`` are held.

Nothing here trusts the group ID a stream names, and a waiting stream holds no state of its own in the
registry: a stream that is closed, cancelled or timed out leaves nothing behind, and a made-up ID costs
only the stream that names it, until the deadline (the data plane bounds those streams per peer;
libp2p's handlers do not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection
from typing import Generic, Protocol, TypeVar

from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb


class ServesParts(Protocol):
    """A round that takes an inbound part stream: ``ButterflyAllReduce.serve``."""

    def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: PeerID
    ) -> AsyncIterator[apb.PartChunk]: ...


Runner = TypeVar("Runner", bound=ServesParts)

KEEP_ROUNDS = 4  # finished rounds held for validators


class RoundRegistry(Generic[Runner]):
    """The live rounds of one averager by group ID, and the last ``keep`` finished ones."""

    def __init__(self, keep: int = KEEP_ROUNDS):
        self.keep = keep
        self.live: dict[bytes, Runner] = {}
        self.recent: OrderedDict[bytes, Runner] = OrderedDict()
        self._added = asyncio.Event()  # set, then replaced, each time a round is added

    def add(self, group_id: bytes, runner: Runner) -> None:
        """A round starts here: wake the streams waiting for a round, which look again."""
        self.live[group_id] = runner
        added, self._added = self._added, asyncio.Event()
        added.set()

    def finish(self, group_id: bytes, runner: Runner) -> None:
        """A round ended: keep it for validators, dropping the oldest beyond ``keep``."""
        self.live.pop(group_id, None)
        self.recent[group_id] = runner
        self.recent.move_to_end(group_id)
        while len(self.recent) > self.keep:
            self.recent.popitem(last=False)

    def lookup(self, group_id: bytes) -> Runner | None:
        """A finished round kept for validators, or a live one (a validator may ask while it still runs)."""
        return self.recent.get(group_id) or self.live.get(group_id)

    async def wait_for(self, group_id: bytes, timeout_s: float) -> Runner | None:
        """The live round ``group_id``, waiting up to ``timeout_s`` for it to start; None if it does not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (runner := self.live.get(group_id)) is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._added.wait(), left)
        return runner


class PartRouter:
    """Hands each inbound part stream to its round in ``rounds``.

    Args:
        rounds: the averager's registry of live rounds.
        silence_s: how long the stream may be silent before its first message (it follows the
            measured link, so it is asked per stream).
        wait_s: how long a stream waits for the round it names to start here.
        banned: the peer IDs (base58) on the run's ban list now; their streams are refused at once.
        denies: a rehearsed denier (``RoundHooks.denies_rounds``): every stream is told no such round.
    """

    def __init__(
        self,
        rounds: RoundRegistry,
        *,
        silence_s: Callable[[], float],
        wait_s: float,
        banned: Callable[[], Collection[str]],
        denies: bool = False,
    ):
        self.rounds, self.silence_s, self.wait_s, self.banned = rounds, silence_s, wait_s, banned
        self.denies = denies

    async def __call__(
        self, stream: AsyncIterator[apb.PartChunk], sender: PeerID
    ) -> AsyncIterator[apb.PartChunk]:
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout=self.silence_s())
        except (asyncio.TimeoutError, StopAsyncIteration):
            return
        if sender.to_base58() in self.banned():
            yield apb.PartChunk(code=apb.NOT_IN_GROUP, error="this peer is banned from the run")
            return
        # The sender may have learned of the group a moment before we did; a round whose first phase is
        # over here may still stand in for a part that another member's reducer failed (see ``repair``).
        runner = self.rounds.live.get(first.group_id) or self.rounds.recent.get(first.group_id)
        runner = runner or await self.rounds.wait_for(first.group_id, self.wait_s)
        if runner is None or self.denies:
            yield apb.PartChunk(code=apb.BAD_GROUP, error="no averaging round with this group ID here")
            return
        async for message in runner.serve(first, stream, sender):
            yield message


__all__ = ["KEEP_ROUNDS", "PartRouter", "RoundRegistry"]
