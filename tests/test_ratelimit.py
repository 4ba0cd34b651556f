"""Politeness: the upload limiter holds a peer to its --max-upload-mbps however many senders share it,
and the limit flags are checked before a peer joins."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.config import PeerConfig
from peer.limits import upload_limiter
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


def _join(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--coordinator", "127.0.0.1:9", "--identity",
         str(tmp_path / "id.key"), *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip


def test_politeness_flags_are_checked_before_joining(tmp_path: Path):
    result = _join(tmp_path, "--cpu", "--max-gpu-memory", "4")
    assert result.returncode == 2
    assert "--max-gpu-memory limits GPU memory, but --cpu was given" in result.stderr
    result = _join(tmp_path, "--cpu", "--max-upload-mbps", "0")
    assert result.returncode == 2 and "--max-upload-mbps" in result.stderr
    result = _join(tmp_path, "--cpu", "--max-gpu-memory", "-1")
    assert result.returncode == 2 and "--max-gpu-memory" in result.stderr


def test_the_peer_gets_one_limiter_of_its_rate():
    limiter = upload_limiter(PeerConfig(coordinator="127.0.0.1:9", max_upload_mbps=8))
    assert limiter is not None and limiter.rate_bytes_per_s == 1_000_000
    assert upload_limiter(PeerConfig(coordinator="127.0.0.1:9")) is None
