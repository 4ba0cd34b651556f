"""The coordinator's judging turns and evidence queue, in process: addresses take turns, a judgment that
gives up passes its turn on, and queued evidence is bounded per address and in all."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.judging import EvidenceQueue, JudgingTurns
from protocols.errors import NetworkError


def test_waiting_judgments_take_turns_by_address_and_a_cancelled_one_passes_its_turn_on():
    async def scenario() -> list[str]:
        turns, order = JudgingTurns(), []
        release = asyncio.Event()

        async def judgment(address: str, name: str, hold: asyncio.Event | None = None) -> None:
            async with turns.turn(address):
                order.append(name)
                if hold is not None:
                    await hold.wait()

        first = asyncio.create_task(judgment("a", "a0", release))
        await asyncio.sleep(0)
        # Address b queues five before c and d queue one each: each address waits one turn per round.
        waiting = [asyncio.create_task(judgment("b", f"b{i}")) for i in range(5)]
        await asyncio.sleep(0)
        waiting += [asyncio.create_task(judgment("c", "c0")), asyncio.create_task(judgment("d", "d0"))]
        gives_up = asyncio.create_task(judgment("e", "e0"))
        await asyncio.sleep(0)
        assert turns.waiting == 8
        gives_up.cancel()
        await asyncio.sleep(0)
        assert turns.waiting == 7
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *waiting), 5)
        assert turns.waiting == 0
        # Free again: the next one runs at once.
        await asyncio.wait_for(judgment("f", "f0"), 1)
        return order

    assert asyncio.run(scenario()) == ["a0", "b0", "c0", "d0", "b1", "b2", "b3", "b4", "f0"]


def test_a_turn_granted_as_its_judgment_is_cancelled_goes_to_the_next():
    async def scenario() -> list[str]:
        turns, order = JudgingTurns(), []
        hold = asyncio.Event()

        async def judgment(address: str, name: str) -> None:
            async with turns.turn(address):
                order.append(name)

        async def first() -> None:
            async with turns.turn("a"):
                order.append("a0")
                await hold.wait()
            # Leaving granted b0 its turn; b0 is cancelled before it could run.
            granted_then_cancelled.cancel()

        running = asyncio.create_task(first())
        await asyncio.sleep(0)
        granted_then_cancelled = asyncio.create_task(judgment("b", "b0"))
        after = asyncio.create_task(judgment("c", "c0"))
        await asyncio.sleep(0)
        hold.set()
        await running
        with pytest.raises(asyncio.CancelledError):
            await granted_then_cancelled
        await asyncio.wait_for(after, 1)
        return order

    assert asyncio.run(scenario()) == ["a0", "c0"]


def test_queued_evidence_is_kept_off_memory_within_its_address_share_and_the_total():
    async def scenario() -> None:
        queue = EvidenceQueue(capacity=10_000, per_key=6_000)
        one = await queue.put("a", b"x" * 5_000)
        with pytest.raises(NetworkError, match="one address may queue"):
            await queue.put("a", b"y" * 2_000)
        two = await queue.put("b", b"z" * 5_000)
        with pytest.raises(NetworkError, match="queue of accusations holds 10000"):
            await queue.put("c", b"w")
        assert await one.load() == b"x" * 5_000 and await two.load() == b"z" * 5_000
        one.close()
        one.close()  # once only
        assert queue.held == 5_000 and queue.held_by("a") == 0
        three = await queue.put("a", b"y" * 5_000)
        two.close()
        three.close()
        assert queue.held == 0

    asyncio.run(scenario())
