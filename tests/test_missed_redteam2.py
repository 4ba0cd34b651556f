"""The book of reducers that missed rounds (``swarm.averaging.missed.MissedRounds``), read a third time as
an attacker who has read the code: a reducer that answers "no such round" instead of timing out. Each test
failed on the book before its fix (any BAD_GROUP or NOT_IN_GROUP first answer was a denial, whenever it came
and whatever the reducer had taken) and shows the bound that holds now.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID
from test_missed_redteam import NUMEL, Network, daemonless, no_mpfutures

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager

pytestmark = pytest.mark.timeout(60)

__all__ = ["no_mpfutures"]  # test_missed_redteam's autouse fixture: hivemind's StepControl stubbed

# --- helpers ---------------------------------------------------------------------------------------


class SharedLeader:
    """An honest leader's matchmaking: every member is told the same group ID, members and signed entries,
    in ``order`` (the leader, ``order[0]``, decides the order, so it decides each part's substitute)."""

    def __init__(self, order: list[str]):
        self.order = order
        self.entries: dict[str, bytes] = {}
        self.group_id = os.urandom(16)
        self.ready = asyncio.Event()

    def matchmaking_for(self, member: str):
        shared = self

        class Stub:
            target_group_size = 64
            leader = PeerID.from_base58(self.order[0])

            def widen(self, *_):
                pass

            async def look_for_group(self, step):
                shared.entries[member] = step.data_for_gather
                if len(shared.entries) == len(shared.order):
                    shared.ready.set()
                await shared.ready.wait()
                return SimpleNamespace(
                    group_id=shared.group_id,
                    peer_ids=[PeerID.from_base58(p) for p in shared.order],
                    gathered=[shared.entries[p] for p in shared.order],
                )

        return Stub()


def denying_router(w: Averager, victims: set[str], *, delay_silences: float = 0.0, take_inputs: bool = False):
    """W's part streams: served honestly for members outside ``victims``; a victim is told "no averaging
    round with this group ID here", word for word what an honest ``PartRouter`` says, after
    ``delay_silences`` times the round's silence deadline. ``take_inputs``: W first lets its reducer take
    the victim's contributions (its aggregate is ready) and only then denies the round to the victim."""
    honest = w.route_part
    kept: set[asyncio.Task] = set()

    async def router(stream, sender: PeerID):
        if sender.to_base58() not in victims:
            async for message in honest(stream, sender):
                yield message
            return
        if take_inputs:
            answers: asyncio.Queue = asyncio.Queue()

            async def drain():
                async for message in honest(stream, sender):
                    await answers.put(message)

            task = asyncio.create_task(drain())
            kept.add(task)
            await answers.get()  # the victim's aggregate chunk, which the victim never sees
            runner = next(iter(w.rounds.live.values()))
        else:
            first = await stream.__anext__()
            runner = await w.rounds.wait_for(first.group_id, 5.0)
        await asyncio.sleep(delay_silences * runner.sender_timeout_s)
        yield apb.PartChunk(code=apb.BAD_GROUP, error="no averaging round with this group ID here")

    w.route_part = router


def run_group(averagers: list[Averager], order: list[str], vector=None) -> tuple[list, float]:
    """One round of ``averagers`` in a group an honest leader (``order[0]``) announces; (outcomes, seconds)."""
    leader = SharedLeader(order)
    for averager in averagers:
        averager.matchmaking = leader.matchmaking_for(averager.p2p.peer_id.to_base58())

    async def scenario():
        make = vector or (lambda: torch.ones(NUMEL))
        return await asyncio.gather(*[a.average(make(), 1.0) for a in averagers])

    logging.disable(logging.WARNING)  # every member logs each failure
    started = time.monotonic()
    try:
        outcomes = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        logging.disable(logging.NOTSET)
    return outcomes, time.monotonic() - started


# --- 1. a withholder answers "no such round" instead of timing out -----------------------------------


def test_a_withholder_that_denies_at_the_deadline_instead_of_timing_out_is_struck(monkeypatch):
    """Attack: admitted W reduces a part in honest V's rounds and never delivers it; instead of letting its
    part streams time out (a strike each: avoided for V's next 1, 2, 4, ... 256 searches), it reads the
    first chunk of each stream, holds it for 1.5 of the round's silence deadlines (the sender waits at most
    2) and answers BAD_GROUP, "no averaging round with this group ID here": the words of an honest
    ``PartRouter`` whose round never started. Flaw: ``PartSender.exchange_with`` takes any BAD_GROUP or
    NOT_IN_GROUP first answer for a denial, whenever it comes and whatever W read first, and ``missed``
    gives a denial no strike and a span of one search, because a leader can provoke an honest one. An
    honest denial comes within ``sender_timeout_s`` of the first chunk (the router's wait for the round);
    nothing looks at when it came. Cost: each round W joins waits as long as for a timeout, then its part is
    repaired (every sender re-streams its contributions to W's part to the substitute); W is back in the
    search after next, for ever: it breaks 10,000 of V's 20,000 rounds (50%, ~600 an hour with 3 s
    rounds), where the same W timing out breaks 85 (~1 in 256 at the cap, ~5 an hour): 118x as many, and it
    never has a strike to work off. Now a denial counts as one only when it comes within the router's wait
    (``sender_timeout_s``) and ``DENIAL_SLACK_S``, and only from a member whose signed contribution to this
    peer's part did not arrive (a member that contributed knew the round)."""
    network = Network()
    keys = [SigningKey.generate() for _ in range(4)]  # A (the leader), W, S (W's substitute), B
    wid = keys[1].peer_id

    def one_round() -> list:
        averagers = [daemonless(network, key) for key in keys]
        for averager in averagers:  # fast links declared: the silence deadline is its floor
            averager.link.mbit = 10_000.0
        w = averagers[1]
        honest = [averagers[0], averagers[2], averagers[3]]
        denying_router(w, {a.p2p.peer_id.to_base58() for a in honest}, delay_silences=1.5)
        outcomes, _ = run_group(averagers, [k.peer_id for k in keys])
        return [(a, result) for a, (_group, result) in zip(averagers, outcomes, strict=True) if a is not w]

    # W's own signed contributions reached every honest reducer's part: it knew the round, so its denial
    # is a miss, with a strike, at each of them.
    for averager, result in one_round():
        assert result.complete, "the substitute repaired W's part"
        assert averager.policy.missed.strikes(wid) == 1
    # And a denial that comes later than a router's wait for the round (plus the slack) is a miss at the
    # sender already, whatever W contributed.
    monkeypatch.setattr("swarm.averaging.sender.DENIAL_SLACK_S", 0.0)
    for _averager, result in one_round():
        assert result.failed_reducers == [wid] and not result.denied_by


def test_a_reducer_that_serves_one_member_and_denies_the_others_is_struck_by_each_of_them():
    """Attack: in a group of k, W lets its reducer take every member's contributions, returns its honest
    aggregate to one member A that is not its part's substitute, and tells every other member, the
    substitute S included, that it knows no such round. Flaw: a repair needs the inputs of every member
    still in the round, and A, which W served, never asks the substitute (``repair``: "any member can veto a
    repair by not asking"); that veto was paid for with a strike per member while a withholder's misses were
    timeouts, and a denial now costs W one search of each victim and no strike. A, whose round is complete,
    even credits W with a delivered part (``delivered``), forgiving strikes W earned with A. Nothing
    compares what W told A with what it told the others under the same group ID, although no honest
    member both serves and denies one round. Cost: the k - 2 members W denied end with no round (A
    applies it: the group's states diverge, and the victims retry or catch up), after waiting out the
    repair's deadline (``averaging_timeout_s``, 30 s by default, instead of a ~3 s round); W is let in
    again at each victim's search after next, so it breaks every other round of each of them for as long
    as it likes (~600 an hour with 3 s rounds, against ~5 an hour for a withholder at the cap), and one W
    in a group of 64 loses 62 members' round each time. Now each victim whose part W contributed to
    counts the denial as a miss (a strike, spans doubling); that A applies a round the others lose (the
    repair veto) stays open."""
    network = Network()
    keys = [SigningKey.generate() for _ in range(5)]  # A (leader, served), W, S (W's substitute), B, D
    averagers = [daemonless(network, key) for key in keys]
    w = averagers[1]
    victims = [averagers[2], averagers[3], averagers[4]]
    denying_router(w, {v.p2p.peer_id.to_base58() for v in victims}, take_inputs=True)
    outcomes, _ = run_group(averagers, [k.peer_id for k in keys])
    wid = keys[1].peer_id
    _, served = outcomes[0]
    assert served.complete and not served.failed_reducers and not served.denied_by
    for victim, (_group, result) in zip(victims, outcomes[2:], strict=True):
        assert not result.complete, "the repair waited for A's inputs, which never came (open, see repair)"
        # W's signed contributions reached each victim's part: it knew the round, so its denial is a miss.
        assert victim.policy.missed.strikes(wid) == 1
        assert "did not deliver" in victim.policy.refusal(wid)
