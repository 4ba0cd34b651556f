"""The upload limiter holds a peer to its --max-upload-mbps, however many senders share it."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocols.errors import ConfigError
from swarm.ratelimit import RateLimiter

pytestmark = pytest.mark.timeout(30)


def test_sending_takes_as_long_as_the_rate_demands():
    async def scenario() -> float:
        limiter = RateLimiter(400_000, burst_bytes=40_000)  # 400 kB/s
        started = time.monotonic()
        for _ in range(10):
            await limiter.acquire(20_000)  # 200 kB in all, 40 kB of it free as the initial burst
        assert limiter.bytes_sent == 200_000
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    assert 0.35 <= elapsed < 1.5, f"200 kB at 400 kB/s (40 kB burst) took {elapsed:.2f}s, expected about 0.4s"


def test_concurrent_senders_share_one_budget_in_arrival_order():
    async def scenario() -> tuple[float, list[int]]:
        limiter = RateLimiter.from_mbps(3.2, burst_bytes=10_000)  # 3.2 Mbit/s = 400 kB/s
        finished: list[int] = []

        async def sender(index: int) -> None:
            await limiter.acquire(50_000)  # bigger than the bucket: sent in installments
            finished.append(index)

        started = time.monotonic()
        await asyncio.gather(*(sender(i) for i in range(4)))
        return time.monotonic() - started, finished

    elapsed, order = asyncio.run(scenario())
    assert 0.45 <= elapsed < 2.0, f"4 x 50 kB at 400 kB/s took {elapsed:.2f}s, expected about 0.5s"
    assert order == [0, 1, 2, 3], "senders are served first come, first served"


def test_try_acquire_never_waits_and_respects_the_bucket():
    now = [0.0]
    limiter = RateLimiter(1000, burst_bytes=1000, clock=lambda: now[0])
    assert limiter.try_acquire(800)
    assert not limiter.try_acquire(800), "only 200 bytes are left in the bucket"
    now[0] += 0.6  # refills 600 bytes
    assert limiter.try_acquire(800)
    assert limiter.bytes_sent == 1600


@pytest.mark.parametrize("rate", [0, -5, float("nan"), float("inf")])
def test_a_rate_that_is_not_a_positive_number_is_refused(rate):
    with pytest.raises(ConfigError, match="upload rate"):
        RateLimiter(rate)


def test_negative_sizes_are_refused():
    limiter = RateLimiter(1000)
    with pytest.raises(ValueError, match="negative"):
        asyncio.run(limiter.acquire(-1))
