"""Whom a member avoids after a broken round, and not forever.

A member that answers that it knows no such round was listed with its own signed, fresh entry in a group
every member checked: it joined and walked away. Before, that answer counted against the leader and the
denied part was never repaired, so one such member failed every round it joined and got honest leaders
avoided; now the denier is avoided and its part is repaired like a withheld one. Suspects are kept in a
bounded map, and a repeat offender is avoided longer each time.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.averaging.averager import Averager, RunMatchmaking
from swarm.averaging.missed import FORGIVE_AFTER, MAX_AVOID_SEARCHES, MAX_STRIKES
from swarm.averaging.policy import MAX_SUSPECT_S, MAX_SUSPECTS, SUSPECT_S, PeerPolicy, Suspects
from swarm.byzantine.attacks import make_attack

pytestmark = pytest.mark.timeout(120)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def avoided_for(suspects: Suspects, peer: str, clock: Clock) -> float:
    return suspects.get(peer).until - clock.now


def test_a_repeat_offender_is_avoided_twice_as_long_each_time_up_to_the_cap():
    clock = Clock()
    suspects = Suspects(clock=clock)
    spans = []
    for _ in range(7):
        suspects.add("w", "did not deliver its part of a round")
        spans.append(avoided_for(suspects, "w", clock))
        assert suspects.refusal("w") is not None
        clock.now += spans[-1] + 1.0  # let back in, then it withholds again
        assert suspects.refusal("w") is None
    assert spans == [SUSPECT_S * 2**i for i in range(5)] + [MAX_SUSPECT_S, MAX_SUSPECT_S]


def test_an_offence_seen_again_while_avoided_escalates_nothing_and_an_old_one_is_forgotten():
    clock = Clock()
    suspects = Suspects(clock=clock)
    suspects.add("w", "withheld")
    for _ in range(5):  # every groupmate's report of the same round, or a group that listed it again
        clock.now += 1.0
        suspects.add("w", "withheld")
    assert avoided_for(suspects, "w", clock) == SUSPECT_S - 5.0
    clock.now += SUSPECT_S - 5.3  # 0.3 s left: the refusal says so, rounded up, not "for 0s more"
    assert "for 1s more" in suspects.refusal("w")
    clock.now -= SUSPECT_S - 5.3
    clock.now += SUSPECT_S + suspects.repeat_window_s + 1.0
    assert suspects.refusal("w") is None and len(suspects) == 0
    suspects.add("w", "withheld")
    assert avoided_for(suspects, "w", clock) == SUSPECT_S, "a clean slate after the window"


def test_a_member_offence_upgrades_a_leader_only_suspicion():
    suspects = Suspects()
    suspects.add("l", "listed a peer twice", leader_only=True)
    assert suspects.refusal("l") is None and suspects.refusal("l", as_leader=True) is not None
    suspects.add("l", "did not deliver its part of a round")
    assert "did not deliver" in suspects.refusal("l")


def test_the_suspects_stay_bounded_and_the_oldest_offence_goes_first():
    clock = Clock()
    suspects = Suspects(max_suspects=3, clock=clock)
    for peer in "abcde":
        suspects.add(peer, "withheld")
        clock.now += 1.0
    assert len(suspects) == 3
    assert [suspects.refusal(p) is not None for p in "abcde"] == [False, False, True, True, True]
    policy = PeerPolicy(None, "run")
    for i in range(MAX_SUSPECTS + 50):
        policy.suspect(f"sybil{i}", "withheld")
    assert len(policy.suspects) == MAX_SUSPECTS
    assert policy.refusal("sybil0") is None and policy.refusal(f"sybil{MAX_SUSPECTS + 49}") is not None


def searched(policy: PeerPolicy, failed=(), denied=(), delivered=()) -> None:
    """One search of ``policy``'s peer that ran a round with these reducers, then counts."""
    policy.blame_round(list(failed), list(denied), delivered=list(delivered))
    policy.search_counted()


def test_a_reducer_that_missed_a_round_sits_out_searches_and_works_its_misses_off_by_delivering():
    # A slow honest peer on a loaded machine misses one round: it is left out of the retry (the next
    # search), not locked out for a minute, and however long the gap between rounds is.
    policy = PeerPolicy(None, "run")
    searched(policy, failed=["slow"], denied=["gave-up"], delivered=["fine"])
    assert "did not deliver" in policy.refusal("slow") and "no such round" in policy.refusal("gave-up")
    assert "in this search:" in policy.refusal("slow"), "the retry forms without it"
    assert policy.refusal("fine") is None
    searched(policy)
    assert policy.refusal("slow") is None and policy.refusal("gave-up") is None, "back in the search after"
    # Each miss while let in doubles the searches it sits out, up to the cap; a miss seen again while it
    # is still avoided (a leader listed it anyway) escalates nothing.
    missed, spans = policy.missed, []
    for _ in range(11):
        policy.blame_round(["slow"], [])
        searched(policy, failed=["slow"])
        spans.append(missed._book["slow"].until - missed.searches)
        for _ in range(spans[-1]):
            assert policy.refusal("slow") is not None
            searched(policy)
        assert policy.refusal("slow") is None
    assert spans == [2**i for i in range(1, 9)] + [MAX_AVOID_SEARCHES] * 3
    assert missed.strikes("slow") == MAX_STRIKES, "strikes stop with the span"
    # Only delivered rounds forgive: FORGIVE_AFTER of them per strike, never the searches that passed.
    for _ in range(FORGIVE_AFTER * 3):
        searched(policy, delivered=["slow"])
    assert missed.strikes("slow") == MAX_STRIKES - 3
    for _ in range(FORGIVE_AFTER * 20):  # more than enough: a clean slate, and a miss is a first one again
        searched(policy, delivered=["slow"])
    assert missed.strikes("slow") == 0 and policy.refusal("gave-up") is None and len(missed) == 0
    searched(policy, failed=["slow"])
    assert missed._book["slow"].until - missed.searches == 1
    # A denial earns no strike, however often: a leader can make an honest member deny (see missed.py).
    for _ in range(10):
        searched(policy, denied=["gave-up"])
        searched(policy)
    assert missed.strikes("gave-up") == 0 and policy.refusal("gave-up") is None
    policy.suspect("liar", "accepted this peer into its group, then never began the round")
    assert policy.suspects.get("liar").until - time.monotonic() > SUSPECT_S - 5, (
        "other offences keep their minute"
    )


def test_a_peer_that_knows_no_such_round_counts_against_itself_not_the_leader():
    policy = PeerPolicy(None, "run")
    policy.blame_round(["withholder"], ["denier"])
    assert "said it knows no such round" in policy.refusal("denier")
    assert policy.refusal("leader") is None and policy.refusal("leader", as_leader=True) is None
    assert "did not deliver" in policy.refusal("withholder"), "a reducer that took the round stays a suspect"


# --- real peers: a member joins through matchmaking, then denies the round ------------------------------

NUMEL = 4096


class FollowOnly(RunMatchmaking):
    """Matchmaking that never leads, so the test knows the leader is honest."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "client_mode": True})


class Denier(Averager):
    """An admitted member that joins a group with its signed entry and contributes, but answers every
    stream to its part that it knows no such round, as an honest peer that left the group would (issue 25
    item 4): the registered ``denier`` attack, in an averager that never leads."""

    matchmaking_type = FollowOnly

    def __init__(self, *args, **kwargs):
        super().__init__(*args, hooks=make_attack("denier", group_size=3, attackers=1), **kwargs)


def test_a_member_that_denies_the_round_is_blamed_and_its_part_repaired(keyed_dhts):
    generator = torch.Generator().manual_seed(0)
    honest_inputs = [torch.randn(NUMEL, generator=generator) for _ in range(2)]
    mean = (honest_inputs[0] + honest_inputs[1]) / 2
    # The denier sends the honest mean, so every part's result is that mean whether it counts or not.
    inputs = [*honest_inputs, mean.clone()]
    denier = keyed_dhts[2][1].peer_id

    async def scenario():
        averagers = [
            (Denier if i == 2 else Averager)(
                dht,
                prefix="denial",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                sender_timeout_s=1.0,
                averaging_timeout_s=15.0,
                data_plane=False,
            )  # fmt: skip
            for i, (dht, key) in enumerate(keyed_dhts)
        ]
        for averager in averagers:
            await averager.start()
        try:
            return await asyncio.gather(
                *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, inputs, strict=True)]
            ), averagers
        finally:
            for averager in averagers:
                await averager.shutdown()

    outcomes, averagers = asyncio.run(scenario())
    (group, first), (_, second) = outcomes[:2]
    assert denier in [p.to_base58() for p in group.peer_ids], "the denier was listed in the group"
    assert group.leader != denier
    assert first.denied_by == second.denied_by == [denier]
    assert first.complete and second.complete, "the denied part was repaired by its substitute"
    assert torch.equal(first.vector, second.vector), "the honest peers hold the same bits"
    assert torch.allclose(first.vector, mean, atol=2e-3)
    for averager in averagers[:2]:
        # Its own signed contributions reached the honest members' parts, so it knew the round: its denial is
        # a miss, a strike (a denial alone would not tell it from an honest peer that gave up on the round).
        assert "did not deliver" in averager.policy.refusal(denier)
        assert averager.policy.missed.strikes(denier) == 1
        assert all(averager.policy.missed.strikes(str(p)) == 0 for p in group.peer_ids if str(p) != denier)
        assert averager.policy.refusal(group.leader, as_leader=True) is None, (
            "the honest leader is not blamed"
        )
