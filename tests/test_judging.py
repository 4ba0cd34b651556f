"""The coordinator's judging turns, in process: caller addresses take turns, and a judgment that gives up
while waiting, or just as its turn came, passes the turn on."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.judging import JudgingTurns, judging_for


def test_waiting_judgments_take_turns_by_address_and_a_cancelled_one_passes_its_turn_on():
    async def scenario() -> list[str]:
        turns, order = JudgingTurns(), []
        release = asyncio.Event()

        async def judgment(address: str, name: str, hold: asyncio.Event | None = None) -> None:
            with judging_for(address):
                async with turns:
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
            with judging_for(address):
                async with turns:
                    order.append(name)

        async def first() -> None:
            with judging_for("a"):
                async with turns:
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
