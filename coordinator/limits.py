"""Limits that keep one caller from exhausting the coordinator for everyone else.

``Challenge`` is the one RPC anyone may call without a key, so it is limited per caller address (an
IPv4 address, or an IPv6 /64, which one host gets as cheaply as one address) with a token bucket and a
cap on the challenges one caller may hold open; the global cap on open challenges is then far above
what one caller can take. Accusations are limited per peer ID, and the evidence they carry is read
under a deadline and charged, piece by piece as it arrives, to a byte budget with a share per
caller address (``EvidenceBudget``): a stalled accusation holds only the bytes it has sent, one
address never holds more than its share, and an accusation that finds the budget full waits its
turn (first come, first served, until its own deadline) instead of being refused.

Every map here is bounded: a bucket table forgets its least recently seen callers, and the open
challenge counts exist only while challenges are open (at most the global cap).

Example::

    buckets = KeyedBuckets(burst=4, refill_s=15.0, max_keys=1024)
    if not buckets.take(caller_key(context.peer())):
        raise NetworkError("too many requests; retry later")
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import NetworkError
from swarm.averaging.transport import host_key


class ServiceLimits(BaseModel):
    """Per-caller and global limits of the coordinator's gRPC service."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    challenge_burst_per_caller: int = Field(
        32, ge=1, le=10_000, description="Challenge calls one address may make at once before it is slowed"
    )
    challenge_refill_s: float = Field(
        1.0, gt=0, le=3600, description="seconds for one address to earn one more Challenge call"
    )
    open_challenges_per_caller: int = Field(
        32, ge=1, le=10_000, description="unanswered join challenges one address may hold at once"
    )
    max_open_challenges: int = Field(
        10_000, ge=1, le=1_000_000, description="unanswered join challenges held across all callers"
    )
    accusation_burst_per_peer: int = Field(
        4, ge=1, le=1000, description="accusations one peer may file at once before it is slowed"
    )
    accusation_refill_s: float = Field(
        15.0, gt=0, le=86_400, description="seconds for one peer to earn one more accusation"
    )
    evidence_read_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="seconds an accusation's stream (signed part and evidence) may take"
    )
    stage_state_timeout_s: float = Field(
        120.0, gt=0, le=3600,
        description="seconds the coordinator spends getting a stage's state to judge stage evidence",
    )  # fmt: skip
    evidence_budget_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        le=64 << 30,
        description="evidence bytes held in memory by all accusations at once",
    )
    evidence_share_per_address_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        le=64 << 30,
        description="evidence bytes the accusations from one caller address may hold at once",
    )
    stored_evidence_bytes: int = Field(
        4 << 30,
        ge=0,
        le=1 << 40,
        description="evidence bytes kept on disk for convictions; past it, only the verdict",
    )
    max_tracked_callers: int = Field(
        65_536, ge=16, le=10_000_000, description="callers and peers whose rate limits are remembered at once"
    )


def caller_key(peer: str) -> str:
    """The address a gRPC caller (``context.peer()``: ``ipv4:1.2.3.4:5``, ``ipv6:%5B::1%5D:5``) is limited
    by, by the data plane's rule (``host_key``); anything else is limited as itself."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer[:128]
    return host_key(urllib.parse.unquote(rest).rsplit(":", 1)[0])


class KeyedBuckets:
    """A token bucket per key (``burst`` calls at once, one more every ``refill_s``), for at most
    ``max_keys`` keys: the least recently seen key is forgotten first, which only ever gives it a
    full bucket again."""

    def __init__(
        self, *, burst: int, refill_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic
    ):
        self.burst = burst
        self.refill_s = refill_s
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> bool:
        """Spend one token of ``key``; False (and nothing spent) when its bucket is empty."""
        now = self._clock()
        tokens, updated = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - updated) / self.refill_s)
        granted = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if granted else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return granted

    def empty(self, key: str) -> None:
        """Spend every token ``key`` has (it must wait a whole refill for its next call)."""
        self._buckets.pop(key, None)
        self._buckets[key] = (0.0, self._clock())
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def retry_after_s(self, key: str) -> float:
        tokens, _ = self._buckets.get(key, (float(self.burst), 0.0))
        return max(0.0, (1.0 - tokens) * self.refill_s)

    def __len__(self) -> int:
        return len(self._buckets)


class EvidenceBudget:
    """Evidence bytes held at once: at most ``capacity`` in all and ``per_key`` per caller address.

    ``charge`` takes bytes as they arrive. Past an address's share it refuses (only that address is
    slowed); past the global capacity it waits in line, first come first served, so that stalled
    streams delay a later accusation only until their deadlines cut them off, and never refuse it."""

    def __init__(self, capacity: int, per_key: int):
        self.capacity = capacity
        self.per_key = per_key
        self.held = 0
        self._by_key: dict[str, int] = {}
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()

    def held_by(self, key: str) -> int:
        return self._by_key.get(key, 0)

    async def charge(self, key: str, n: int) -> None:
        """Hold ``n`` more bytes for ``key``; NetworkError past its share. Cancelled while it waits, it
        holds nothing more."""
        if n <= 0:
            return
        if self.held_by(key) + n > self.per_key:
            raise NetworkError(
                f"accusations from {key} hold {self.held_by(key)} evidence bytes, and {n} more would pass "
                f"the {self.per_key} one address may hold; wait for their verdicts"
            )
        self._by_key[key] = self.held_by(key) + n
        if not self._waiting and self.held + n <= self.capacity:
            self.held += n
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((turn, n))
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.held -= n  # granted just as it was cancelled
            self._waiting = deque(w for w in self._waiting if w[0] is not turn)
            self._drop(key, n)
            self._admit_waiting()
            raise

    def release(self, key: str, n: int) -> None:
        """Give back ``n`` bytes that ``key`` was charged."""
        if n <= 0:
            return
        self.held = max(0, self.held - n)
        self._drop(key, n)
        self._admit_waiting()

    def _drop(self, key: str, n: int) -> None:
        left = self.held_by(key) - n
        if left > 0:
            self._by_key[key] = left
        else:
            self._by_key.pop(key, None)

    def _admit_waiting(self) -> None:
        while self._waiting and self.held + self._waiting[0][1] <= self.capacity:
            turn, n = self._waiting.popleft()
            if not turn.done():
                self.held += n
                turn.set_result(None)


class RefusalLog:
    """Log lines for refused requests: at most ``per_window`` a window of ``window_s`` for each (RPC, kind
    of error, caller address), then, once the window has passed, one line saying how many of that caller's
    were left out (written by any later refusal, whoever makes it). Every refusal of a flood used to write
    its own line, so a caller could fill the organizer's disk at the rate the coordinator refused it; and a
    budget shared by all callers would let one caller's junk hide another's refusals. At most
    ``max_keys`` windows are kept (the least recently refused caller is summed up and forgotten first),
    and at most ``max_lines`` refusals are written a window in all, however many callers refuse."""

    def __init__(
        self,
        log: Callable[[str], None],
        *,
        per_window: int = 20,
        window_s: float = 60.0,
        max_keys: int = 1024,
        max_lines: int = 200,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.per_window, self.window_s, self.clock = log, per_window, window_s, clock
        self.max_keys, self.max_lines = max_keys, max_lines
        self._lines, self._unlogged = 0, 0  # refusals logged and left out in all, this window
        self._windows: OrderedDict[tuple[str, str, str], tuple[float, int]] = OrderedDict()
        self._swept = clock()

    def refused(self, method: str, caller: str, error: Exception) -> None:
        now = self.clock()
        if now - self._swept >= self.window_s:
            self._sweep(now)
            if self._unlogged:
                self.log(
                    f"{self._unlogged} more refusals, from many callers, were not logged in the last minute"
                )
            self._lines = self._unlogged = 0
        key = (method, type(error).__name__, caller_key(caller))
        started, count = self._windows.pop(key, (now, 0))
        if now - started >= self.window_s:
            self._summarize(key, started, count, now)
            started, count = now, 0
        count += 1
        self._windows[key] = (started, count)
        while len(self._windows) > self.max_keys:
            old, (old_started, old_count) = self._windows.popitem(last=False)
            self._summarize(old, old_started, old_count, now)
        if count > self.per_window:
            return
        if self._lines >= self.max_lines:  # many callers at once: the process's own budget
            self._unlogged += 1
            return
        self._lines += 1
        self.log(f"refused {method} from {caller}: {error}")

    def _sweep(self, now: float) -> None:
        """Sum up and forget every window that has passed."""
        self._swept = now
        for key, (started, count) in list(self._windows.items()):
            if now - started >= self.window_s:
                del self._windows[key]
                self._summarize(key, started, count, now)

    def _summarize(self, key: tuple[str, str, str], started: float, count: int, now: float) -> None:
        if count > self.per_window:
            method, kind, caller = key
            self.log(
                f"{count - self.per_window} more refusals of {method} ({kind}) from {caller} in "
                f"{now - started:.0f}s were not logged"
            )
