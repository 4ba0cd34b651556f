"""Where an inbound part finds its round: the averager's registry of live and recent rounds.

A round exists on this peer from the moment matchmaking hands it a group until its runner ends; a
groupmate may learn of the group a moment earlier and open its part stream first. Both transports
(``transport.DataPlane`` and libp2p's ``rpc_aggregate_part``) hand such a stream to ``Averager.serve_part``,
which asks ``RoundRegistry.wait_for``: it answers at once for a live round, or wakes the moment the round
is added, or gives up after the caller's deadline. Finished rounds stay readable (``lookup``) for the
validators who ask for their inputs right after; only the last ``keep`` are held.

Nothing here trusts the group ID a stream names: an ID nobody registers costs a waiter until the deadline,
and at most ``max_waiting`` distinct unknown IDs wait at once (the rest are answered "no such round" at once).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Generic, TypeVar

Runner = TypeVar("Runner")

KEEP_ROUNDS = 4  # finished rounds held for validators
MAX_WAITING = 256  # distinct group IDs that streams may wait for at once


class RoundRegistry(Generic[Runner]):
    """The live rounds of one averager by group ID, the last ``keep`` finished ones, and waiters."""

    def __init__(self, keep: int = KEEP_ROUNDS, max_waiting: int = MAX_WAITING):
        self.keep, self.max_waiting = keep, max_waiting
        self.live: dict[bytes, Runner] = {}
        self.recent: OrderedDict[bytes, Runner] = OrderedDict()
        self._waiting: dict[bytes, asyncio.Future] = {}

    def add(self, group_id: bytes, runner: Runner) -> None:
        """A round starts here: wake the streams that named it early."""
        self.live[group_id] = runner
        waiter = self._waiting.pop(group_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(runner)

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
        runner = self.live.get(group_id)
        if runner is not None:
            return runner
        waiter = self._waiting.get(group_id)
        if waiter is None:
            if len(self._waiting) >= self.max_waiting:
                return None
            waiter = self._waiting[group_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout_s)
        except asyncio.TimeoutError:
            if self._waiting.get(group_id) is waiter and not waiter.done():
                del self._waiting[group_id]
                waiter.cancel()
            return self.live.get(group_id)


__all__ = ["KEEP_ROUNDS", "MAX_WAITING", "RoundRegistry"]
