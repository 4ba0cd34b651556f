"""The accusations one validator files against senders it caught (``swarm.training.sendercheck``), with the
states they were found on.

The coordinator takes one accusation of a validator at a time and downloads the state the lie was found on
when that accusation's turn comes, so each accusation waits with its state. A validator holds a bounded
number of them: ``MAX_FILINGS`` accusations on at most ``MAX_KEPT`` states, filed in the order their lies
were found (a decoy's accusation must not spare a liar found beside it), the same state shared by the
accusations that need it. A state is served while an accusation needs it and ``KEEP_S`` after; when the
peer leaves, nothing waits any more and no state is kept for what waited.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarm.averaging.archive import KEEP_INPUTS_S
from swarm.config import RunConfig
from swarm.training.state import encode_state
from swarm.training.sync import EncodedState

logger = logging.getLogger(__name__)

#: How long a validator serves the state a lie was recomputed on once its accusation is answered (or given
#: up): as long as reducers keep their inputs.
KEEP_S = KEEP_INPUTS_S
#: States a validator holds at once for the coordinator (each one copy of the model and optimizer).
MAX_KEPT = 2
#: Accusations a validator holds: the one being filed and the ones waiting their turn.
MAX_FILINGS = 3

# (accused, evidence, verdict): files one accusation with the coordinator, returning once it is answered.
Accuse = Callable[[str, object, str], Awaitable[object]]


@dataclass
class StateCopy:
    """A member's state at a round's step, before the round's update, as checks and accusations use it."""

    step: int
    state_hash: str
    tensors: dict[str, torch.Tensor]
    entries: dict[int, bytes]  # member index -> its signed group entry
    kept_until: float = 0.0
    model: torch.nn.Module | None = None  # the state loaded for fits, once a round


@dataclass(frozen=True)
class _Filing:
    accused: str
    lie: object
    verdict: str
    copy: StateCopy


class Accusations:
    """One validator's accusations: those waiting their turn, the one being filed (a task of its own, one at
    a time as the coordinator takes them) and the states they need. ``accuse`` files one (None: nothing is
    filed, and a state a lie was found on is only kept ``KEEP_S`` for inspection)."""

    def __init__(self, run: RunConfig, accuse: Accuse | None):
        self.run, self.accuse = run, accuse
        self.kept: OrderedDict[str, StateCopy] = OrderedDict()  # state hash -> a state a lie was found on
        self.waiting: deque[_Filing] = deque()  # the first is being filed
        self._task: asyncio.Task | None = None
        self._closed = False

    def file(self, accused: str, lie: object, verdict: str, copy: StateCopy) -> bool:
        """Queue an accusation of ``accused`` found on ``copy``; False where it is not taken (the queue is
        full, it would need a third state, ``accused`` is accused already, or the peer left): the liar is
        then only avoided. Without ``accuse`` the state is kept ``KEEP_S`` and True is returned."""
        if self._closed:  # the peer left: a replay that ended since files nothing and keeps nothing
            return False
        if self.accuse is None:
            copy.kept_until = time.monotonic() + KEEP_S
            self._hold(copy)
            return True
        states = {f.copy.state_hash for f in self.waiting} | {copy.state_hash}
        if (
            len(self.waiting) >= MAX_FILINGS
            or len(states) > MAX_KEPT
            or any(f.accused == accused for f in self.waiting)
        ):
            return False
        # Served while the accusation waits and is in flight, however long the coordinator's recomputes
        # queue, and ``KEEP_S`` after. Accusations on one state share one copy (rounds retried at a step
        # each copied it).
        copy = next((f.copy for f in self.waiting if f.copy.state_hash == copy.state_hash), copy)
        copy.kept_until = math.inf
        self._hold(copy)
        self.waiting.append(_Filing(accused, lie, verdict, copy))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._file_in_turn())
        return True

    async def _file_in_turn(self) -> None:
        """File the waiting accusations one after the other; each state is kept ``KEEP_S`` after the last
        accusation that needs it is answered or given up."""
        while self.waiting and not self._closed:
            filing = self.waiting[0]
            try:
                await self.accuse(filing.accused, filing.lie, filing.verdict)
            except Exception as e:
                logger.warning(f"could not file the accusation against {filing.accused}: {e!r}")
            finally:
                if self.waiting and self.waiting[0] is filing:  # ``close`` may have cleared them
                    self.waiting.popleft()
                if all(f.copy is not filing.copy for f in self.waiting):
                    filing.copy.kept_until = time.monotonic() + KEEP_S

    async def filed(self) -> None:
        """Wait until the accusations being filed, if any, are answered or given up."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def close(self) -> None:
        """Stop filing, now and for accusations queued later (the peer leaves the run)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        for filing in self.waiting:  # nothing waits its turn any more: no state is kept for it
            self.kept.pop(filing.copy.state_hash, None)
        self.waiting.clear()

    def _hold(self, copy: StateCopy) -> None:
        now = time.monotonic()
        for state_hash in [h for h, c in self.kept.items() if c.kept_until < now]:
            del self.kept[state_hash]
        self.kept[copy.state_hash] = copy
        self.kept.move_to_end(copy.state_hash)
        # The oldest state no accusation waits on goes first (the filings hold at most ``MAX_KEPT``).
        for state_hash in [h for h, c in self.kept.items() if c.kept_until != math.inf]:
            if len(self.kept) <= MAX_KEPT:
                break
            del self.kept[state_hash]

    def find(self, state_hash: str) -> EncodedState | None:
        """A state a lie was found on (for the coordinator to judge it), encoded; None if none is kept."""
        copy = self.kept.get(state_hash)
        if copy is None or copy.kept_until < time.monotonic():
            return None
        data = encode_state(copy.step, copy.tensors, {"run_id": self.run.run_id})
        return EncodedState(copy.step, copy.state_hash, data)


__all__ = ["KEEP_S", "MAX_FILINGS", "MAX_KEPT", "Accusations", "StateCopy"]
