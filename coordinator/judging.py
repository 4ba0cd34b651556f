"""Whose recomputation the coordinator runs next: caller addresses take turns.

The coordinator recomputes one accusation's evidence at a time (a recompute may replay a whole DiLoCo
window, minutes), under one lock that every judging function takes around its recompute
(``coordinator.accusations``). What expires (a stage's states, the inputs a reducer keeps, whether the
accused is online) is read before that, when the evidence arrives. First come first served let Sybils
from one address that queued twenty recomputes behind a long one put a victim's twenty-first;
``JudgingTurns`` gives the next turn to the caller addresses in rotation, each address's own in order,
so a recompute waits for at most one of each other address with one waiting.

The address is the judgment's context (``judging_for``), so the judging functions take the lock as
``async with judging:`` and need not know who asked.

Example::

    turns = JudgingTurns()
    with judging_for(address):
        verdict = await judge_accusation(..., judging=turns)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import OrderedDict, deque
from collections.abc import Iterator

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("judging_caller", default="")


@contextlib.contextmanager
def judging_for(address: str) -> Iterator[None]:
    """Take judging turns in the code below (its tasks included) as ``address``."""
    token = _CALLER.set(address)
    try:
        yield
    finally:
        _CALLER.reset(token)


class JudgingTurns:
    """A lock (``async with turns:``) whose waiters take turns by caller address (round-robin), each
    address's own first come first served."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def locked(self) -> bool:
        return self._busy

    async def __aenter__(self) -> None:
        await self._acquire(_CALLER.get())

    async def __aexit__(self, *exc) -> None:
        self._pass_on()

    async def _acquire(self, key: str) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._pass_on()  # granted just as it was cancelled: the next one takes it
            else:
                queue = self._waiting.get(key)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[key]
            raise

    def _pass_on(self) -> None:
        while self._waiting:
            key, queue = next(iter(self._waiting.items()))
            turn = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)  # its next one waits for the other addresses' turns
            else:
                del self._waiting[key]
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False


__all__ = ["JudgingTurns", "judging_for"]
