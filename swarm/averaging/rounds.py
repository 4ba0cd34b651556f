"""Where an inbound part finds its round: the averager's registry of live and recent rounds.

A round exists on this peer from the moment matchmaking hands it a group until its runner ends; a
groupmate may learn of the group a moment earlier and open its part stream first. Both transports
(``transport.DataPlane`` and libp2p's ``rpc_aggregate_part``) hand such a stream to ``Averager.serve_part``,
which asks ``RoundRegistry.wait_for``: it answers at once for a live round, or wakes when a round is
added and looks again, or gives up after the caller's deadline. Finished rounds stay readable
(``lookup``) for the validators who ask for their inputs right after; only the last ``keep`` are held.

Nothing here trusts the group ID a stream names, and a waiting stream holds no state of its own in the
registry: a stream that is closed, cancelled or timed out leaves nothing behind, and a made-up ID costs
only the stream that names it, until the deadline (the data plane bounds those streams per peer;
libp2p's handlers do not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Generic, TypeVar

Runner = TypeVar("Runner")

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


__all__ = ["KEEP_ROUNDS", "RoundRegistry"]
