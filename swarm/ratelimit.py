"""A token-bucket limit on the bytes a peer sends, shared by every sender in its process.

``swarm-peer join --max-upload-mbps 20`` makes one ``RateLimiter``; each sender awaits
``acquire(len(data))`` before writing ``data``. Waiters are served first come, first served, so one
big tensor part cannot starve the small messages queued behind it for longer than its own share.
A write larger than the bucket is let through in bucket-sized installments, never refused.

Example::

    limiter = RateLimiter.from_mbps(20)        # 20 megabits per second, 0.25 s of burst
    await limiter.acquire(len(chunk))
    await stream.write(chunk)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from protocols.errors import ConfigError

# How many seconds of traffic may leave at once after a quiet spell.
DEFAULT_BURST_S = 0.25


class RateLimiter:
    """At most ``rate_bytes_per_s`` on average, with bursts of up to ``burst_bytes``."""

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        burst_bytes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not math.isfinite(rate_bytes_per_s) or rate_bytes_per_s <= 0:
            raise ConfigError(f"upload rate must be a positive number of bytes/s, got {rate_bytes_per_s}")
        burst = rate_bytes_per_s * DEFAULT_BURST_S if burst_bytes is None else burst_bytes
        if not math.isfinite(burst) or burst < 1:
            raise ConfigError(f"burst must be at least 1 byte, got {burst}")
        self.rate_bytes_per_s = float(rate_bytes_per_s)
        self.burst_bytes = float(burst)
        self._clock = clock
        self._tokens = self.burst_bytes
        self._updated = clock()
        self._lock = asyncio.Lock()
        self.bytes_sent = 0

    @classmethod
    def from_mbps(cls, mbps: float, **kwargs: object) -> RateLimiter:
        """A limiter of ``mbps`` megabits (10^6 bits) per second."""
        return cls(mbps * 1e6 / 8, **kwargs)  # type: ignore[arg-type]

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._updated)
        self._updated = now
        self._tokens = min(self.burst_bytes, self._tokens + elapsed * self.rate_bytes_per_s)

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` now if the bucket holds them and nobody is waiting; never blocks."""
        if nbytes < 0:
            raise ValueError(f"cannot send a negative number of bytes ({nbytes})")
        if self._lock.locked():
            return False
        self._refill()
        if nbytes > self._tokens:
            return False
        self._tokens -= nbytes
        self.bytes_sent += nbytes
        return True

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent (callers queue in arrival order), then count them as sent."""
        if nbytes < 0:
            raise ValueError(f"cannot send a negative number of bytes ({nbytes})")
        async with self._lock:
            remaining = float(nbytes)
            while remaining > 0:
                self._refill()
                take = min(remaining, self.burst_bytes)
                if self._tokens >= take:
                    self._tokens -= take
                    remaining -= take
                    continue
                await asyncio.sleep((take - self._tokens) / self.rate_bytes_per_s)
        self.bytes_sent += nbytes
