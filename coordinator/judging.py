"""Which accusation the coordinator judges next, and where an accusation waits for its turn.

The coordinator judges one accusation at a time: a judgment may download a state and replay a whole
DiLoCo window (minutes). An accusation's evidence is read into memory under ``EvidenceBudget``; once
read and matched to its signed hash, it leaves that budget:

- ``EvidenceQueue`` keeps it in an unlinked temporary file until its turn, within a total
  (``queued_evidence_bytes``) and a share per caller address; past either, the accusation is refused
  as busy and its sender files it again. Judgments that wait hold no memory, so accusations queued
  behind a long replay cannot keep a later one from being read.
- ``JudgingTurns`` gives the next turn to the caller addresses in rotation: a judgment waits for at
  most one judgment of each other address with one waiting, however many accusations an address's
  keys have queued.

Example::

    queued = await queue.put(address, evidence)       # NetworkError: busy, file again
    async with turns.turn(address):
        verdict = judge(await queued.load())
    queued.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

from protocols.errors import NetworkError


class JudgingTurns:
    """One judgment at a time; the waiting ones take turns by caller address (round-robin), each
    address's own judgments first come first served."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """Hold the judging turn (waiting for it in ``key``'s place in the rotation)."""
        await self._acquire(key)
        try:
            yield
        finally:
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
                self._waiting.move_to_end(key)  # its next judgment waits for the other addresses' turns
            else:
                del self._waiting[key]
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False


class QueuedEvidence:
    """One accusation's evidence in its temporary file; ``close`` frees its place in the queue."""

    def __init__(self, queue: EvidenceQueue, key: str, size: int, file):
        self._queue, self.key, self.size, self._file = queue, key, size, file

    async def load(self) -> bytes:
        def read() -> bytes:
            self._file.seek(0)
            return self._file.read()

        return await asyncio.to_thread(read)

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        self._queue._give_back(self.key, self.size)


class EvidenceQueue:
    """Evidence of accusations waiting for their judgment, on disk: at most ``capacity`` bytes in all and
    ``per_key`` per caller address."""

    def __init__(self, capacity: int, per_key: int):
        self.capacity, self.per_key = capacity, per_key
        self.held = 0
        self._by_key: dict[str, int] = {}

    def held_by(self, key: str) -> int:
        return self._by_key.get(key, 0)

    async def put(self, key: str, data: bytes) -> QueuedEvidence:
        """Queue ``data`` for ``key``; NetworkError (busy: file again later) past its share or the total."""
        n = len(data)
        if self.held_by(key) + n > self.per_key:
            raise NetworkError(
                f"accusations from {key} waiting for their judgment hold {self.held_by(key)} evidence bytes, "
                f"and {n} more would pass the {self.per_key} one address may queue; file again after their verdicts"
            )
        if self.held + n > self.capacity:
            raise NetworkError(
                f"the coordinator's queue of accusations holds {self.held} evidence bytes, and {n} more would "
                f"pass its {self.capacity}; file again later"
            )
        self.held += n
        self._by_key[key] = self.held_by(key) + n

        def write():
            # Unlinked: gone when closed, and when the process ends.
            file = tempfile.TemporaryFile(prefix="swarm-evidence-")  # noqa: SIM115 (kept open until judged)
            try:
                file.write(data)
                file.flush()
            except BaseException:
                file.close()
                raise
            return file

        try:
            file = await asyncio.to_thread(write)
        except OSError as e:  # the coordinator's own disk: the accuser files again later
            self._give_back(key, n)
            raise NetworkError(f"the coordinator could not queue the evidence: {e}") from None
        except BaseException:
            self._give_back(key, n)
            raise
        return QueuedEvidence(self, key, n, file)

    def _give_back(self, key: str, n: int) -> None:
        self.held = max(0, self.held - n)
        left = self.held_by(key) - n
        if left > 0:
            self._by_key[key] = left
        else:
            self._by_key.pop(key, None)


__all__ = ["EvidenceQueue", "JudgingTurns", "QueuedEvidence"]
