"""The averager's round registry: a part stream that names its group before this peer's round starts is
served the moment it starts (no polling), an ID nobody registers is answered after the deadline, and a
flood of made-up IDs cannot pile up waiters."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm.averaging.rounds import RoundRegistry

pytestmark = pytest.mark.timeout(30)


def test_an_early_stream_is_served_the_moment_its_round_starts():
    async def scenario() -> tuple[object, float, object]:
        registry: RoundRegistry[str] = RoundRegistry()
        started = time.monotonic()
        waiting = asyncio.create_task(registry.wait_for(b"g1", timeout_s=10.0))
        await asyncio.sleep(0.05)
        registry.add(b"g1", "runner-1")
        found = await waiting
        unknown = await registry.wait_for(b"nobody", timeout_s=0.05)
        return found, time.monotonic() - started, unknown

    found, elapsed, unknown = asyncio.run(scenario())
    assert found == "runner-1" and elapsed < 1.0, "woken by the round, not by a deadline"
    assert unknown is None


def test_finished_rounds_stay_readable_for_validators_and_are_bounded():
    registry: RoundRegistry[str] = RoundRegistry(keep=2)
    for i in range(3):
        registry.add(bytes([i]), f"r{i}")
    registry.finish(b"\x00", "r0")
    assert registry.lookup(b"\x00") == "r0" and registry.lookup(b"\x02") == "r2", "kept or still live"
    registry.finish(b"\x01", "r1")
    registry.finish(b"\x02", "r2")
    assert registry.lookup(b"\x00") is None and list(registry.recent) == [b"\x01", b"\x02"]
    assert registry.live == {}


def test_made_up_group_ids_cannot_pile_up_waiters():
    async def scenario() -> tuple[list[object], float]:
        registry: RoundRegistry[str] = RoundRegistry(max_waiting=4)
        waiters = [asyncio.create_task(registry.wait_for(bytes([i]), timeout_s=0.5)) for i in range(4)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        refused = await registry.wait_for(b"one too many", timeout_s=5.0)
        answered_in = time.monotonic() - started
        results = await asyncio.gather(*waiters)
        return [refused, *results, len(registry._waiting)], answered_in

    results, answered_in = asyncio.run(scenario())
    assert results[0] is None and answered_in < 0.5, "past the limit a stream is answered at once"
    assert results[1:5] == [None] * 4 and results[5] == 0, "waiters that time out are removed"
