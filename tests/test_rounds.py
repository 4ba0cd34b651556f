"""The averager's round registry: a part stream that names its group before this peer's round starts is
served the moment it starts (no polling), an ID nobody registers is answered after the deadline, and a
stream that gives up leaves nothing behind."""

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


def test_streams_that_give_up_leave_nothing_behind_and_one_id_can_have_many_waiters():
    """A stream closed by its sender is cancelled mid-wait; streams naming one ID time out on their own."""

    async def scenario() -> tuple[list[object], object]:
        registry: RoundRegistry[str] = RoundRegistry()
        closed = [
            asyncio.create_task(registry.wait_for(i.to_bytes(2, "big"), timeout_s=10.0)) for i in range(300)
        ]
        same = [asyncio.create_task(registry.wait_for(b"g", timeout_s=t)) for t in (0.05, 5.0)]
        await asyncio.sleep(0.01)
        for task in closed:
            task.cancel()
        await asyncio.gather(*closed, return_exceptions=True)
        first = await same[0]  # its deadline passes; the other stream on the same ID waits on
        registry.add(b"g", "runner-g")
        return [first, await same[1]], registry.lookup(b"g")

    (first, second), live = asyncio.run(scenario())
    assert first is None and second == "runner-g" and live == "runner-g"
