"""Whom a member avoids after a broken round: never an honest peer framed by its leader, and not forever.

A leader may list an absent honest peer with that peer's entry from an earlier group. The peer answers
that it knows no such round; its groupmates used to avoid it as a failed reducer, so a leader could
take honest peers out of matchmaking at will and never be blamed. Now that answer counts against the
leader. Suspects are kept in a bounded map, and a repeat offender is avoided longer each time.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from helpers import KEYS, start_dhts
from hivemind.p2p import PeerID

from swarm.averaging.averager import Averager, GroupRound
from swarm.averaging.policy import MAX_SUSPECT_S, MAX_SUSPECTS, SUSPECT_S, PeerPolicy, Suspects

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


def test_a_peer_that_knows_no_such_round_counts_against_the_leader_that_listed_it():
    policy = PeerPolicy(None, "run")
    policy.blame_round(["withholder"], ["honest"], me="follower", leader="leader")
    assert policy.refusal("honest") is None, "the peer the leader listed is not avoided"
    assert "listed honest" in policy.refusal("leader", as_leader=True)
    assert policy.refusal("leader") is None, "the leader may still be a member"
    assert "did not deliver" in policy.refusal("withholder"), "a reducer that took the round stays a suspect"
    leading = PeerPolicy(None, "run")  # the leader gathered the entries itself: the member lies
    leading.blame_round([], ["liar"], me="leader", leader="leader")
    assert "knows no such round" in leading.refusal("liar")


# --- real peers: a leader lists an absent honest peer --------------------------------------------------

NUMEL = 4096


class Announced(Averager):
    """A member handed the group a malicious leader announced instead of one matchmaking found."""

    announced: GroupRound

    async def find_group(self, weight, extra=None, expected_size=None) -> GroupRound:
        return self.announced


def test_a_leader_listing_an_absent_peer_is_avoided_and_the_absent_peer_is_not():
    dhts = start_dhts(3)
    leader, follower, absent = (KEYS[d.peer_id.to_base58()] for d in dhts)

    async def scenario():
        averagers = [
            Announced(dht, prefix="suspicion", numel=NUMEL, signing_key=KEYS[dht.peer_id.to_base58()],
                      data_plane=False, sender_timeout_s=1.0, averaging_timeout_s=15.0)
            for dht in dhts
        ]  # fmt: skip
        for averager in averagers:
            await averager.start()
        group = GroupRound(
            os.urandom(16), [PeerID.from_base58(k.peer_id) for k in (leader, follower, absent)],
            [1.0] * 3, [{}] * 3, [None] * 3, leader=leader.peer_id,
        )  # fmt: skip
        for averager in averagers[:2]:
            averager.announced = group
        # The absent peer is up and serving, but looks for no group: it answers BAD_GROUP.
        outcomes = await asyncio.gather(*[a.average(torch.ones(NUMEL), 1.0) for a in averagers[:2]])
        for averager in averagers:
            await averager.shutdown()
        return outcomes, averagers[1].policy

    try:
        outcomes, policy = asyncio.run(scenario())
    finally:
        for dht in dhts:
            dht.shutdown()
    _, result = outcomes[1]
    assert not result.complete and result.denied_by == [absent.peer_id] and result.failed_reducers == []
    assert policy.refusal(absent.peer_id) is None, "the honest peer the leader listed stays eligible"
    assert f"listed {absent.peer_id}" in policy.refusal(leader.peer_id, as_leader=True)
