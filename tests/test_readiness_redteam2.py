"""What ``swarm.training.readiness`` counts of the claims at an every_step peer's step, against three defects
of its second version: a member of the last round that raised the pace its whole count of the other groups
was scaled by (its claim then counted as many median members as there were groups), and honest peers that
computed several times their share because their last round showed less than the step holds (a swarm
that grew, a step cut short, members that joined a round with one micro-batch). Each test failed on that
version; it now asserts the bound the module docstring and docs/protocol.md state.
"""

from __future__ import annotations

import pytest
from helpers import module_dht_fixtures
from readiness_helpers import (
    MICRO,
    TARGET,
    at_step,
    first_ready,
    keys,
    plain_group,
    readiness_trainer,
    signed_group,
)

from swarm.training.readiness import ShownWork, counted_claims

module_nodes, nodes = module_dht_fixtures(1)


@pytest.fixture
def trainer(nodes):
    return readiness_trainer(nodes, "readiness-redteam2")


HUGE = 10**12


# --- 1. a member of the last round raised the pace that scales the other groups' whole weight ----------


def test_one_liar_in_a_group_of_two_counts_as_itself_and_moves_no_pace(trainer):
    """A swarm of four groups of two at the run's steady share (32 samples each: 8 x 32 = the target). The
    peer's last groupmate claims the target at this step: it counts as its share, and the pace the
    three other groups' 192 samples are counted at stays the peer's own (the lower median of the two), so
    a Sybil record beside it adds nothing (before: the peer was ready after one micro-batch, the liar's
    record moving its count by 240 samples)."""
    peer = trainer.peer
    share = TARGET // 8
    liar = "liar"
    others = [keys(2) for _ in range(3)]
    groups = [
        plain_group(b"mine", [peer.peer_id, liar], 2.0 * share),
        *(signed_group(b"g%d" % g, ks, 2.0 * share) for g, ks in enumerate(others)),
    ]
    peer.shown = ShownWork.of_round(
        step=peer.step, members=[peer.peer_id, liar], weights=[share, share], me=peer.peer_id,
        target=TARGET, groups=groups, group_id=b"mine",
    )  # fmt: skip
    assert peer.shown.weights == {liar: share} and peer.shown.rest == 3 * 2 * share
    trainer._micro_step()
    honest = {k.peer_id: peer.samples for ks in others for k in ks}  # the other groups, at the same pace
    at_step(peer, {**honest, liar: HUGE, "sybil": HUGE})
    assert peer.samples == MICRO and not peer.ready_for_round() and peer.wants_compute()
    lying = sum(counted_claims({**honest, liar: HUGE, "sybil": HUGE}, own=MICRO, shown=peer.shown, step=0))
    truthful = sum(
        counted_claims({**honest, liar: MICRO, "sybil": HUGE}, own=MICRO, shown=peer.shown, step=0)
    )
    assert lying - truthful == share - MICRO, "the liar counts as the share it signed, no more"


def test_one_liar_adds_at_most_a_median_member_whatever_the_number_of_groups():
    """One liar in a group of n, whose record claims the target, and a Sybil record: at the point its
    honest groupmates start their round, what the liar's claim adds to their count is at most a median
    member, in a swarm of 2, 4 or 8 groups (before: about one median member per group)."""
    share = 60
    for n in (3, 4):
        for groups in (2, 4, 8):
            target = groups * n * share
            mine = [f"g0p{i}" for i in range(n)]
            certs = [
                plain_group(b"g%d" % g, [f"g{g}p{i}" for i in range(n)], n * share) for g in range(groups)
            ]
            shown = ShownWork.of_round(
                step=3, members=mine, weights=[share] * n, me="g0p0", target=target, groups=certs,
                group_id=b"g0",
            )  # fmt: skip

            def honest(own: int, groups: int = groups, n: int = n) -> dict[str, int]:
                return {f"g{g}p{i}": own for g in range(groups) for i in range(n) if (g, i) != (0, 0)}

            def lying(own: int, honest=honest) -> dict[str, int]:
                return {**honest(own), "g0p1": HUGE, "sybil": HUGE}

            assert first_ready(shown, honest, target=target, micro=1) == share
            cut = first_ready(shown, lying, target=target, micro=1)
            added = sum(counted_claims(lying(cut), own=cut, shown=shown, step=3)) - sum(
                counted_claims({**honest(cut), "sybil": HUGE}, own=cut, shown=shown, step=3)
            )
            assert added <= share, (n, groups, added)
            assert cut >= share * (n - 1) // n, (n, groups, cut)


# --- 2. a last round that showed fewer peers than the step holds: for that step only ------------------


def test_a_veteran_of_a_swarm_that_grew_counts_the_newcomers_as_its_own_samples_for_that_step_only(trainer):
    """Four peers that averaged as the swarm's only group (64 samples each: no second tier) are joined by
    twelve. The newcomers count claims as made and are ready at 16 samples; a veteran counts the twelve
    together as at most its own samples and computes to 52 (the documented price of a swarm that grew),
    and only at that step: the round is believed at the step it brought the peer to, no later."""
    peer = trainer.peer
    mates = [f"mate{i}" for i in range(3)]
    newcomers = [f"new{i}" for i in range(12)]
    peer.shown = ShownWork.of_round(
        step=peer.step,
        members=[peer.peer_id, *mates],
        weights=[TARGET // 4] * 4,
        me=peer.peer_id,
        target=TARGET,
    )
    assert peer.shown.rest == 0
    while True:
        trainer._micro_step()
        at_step(peer, dict.fromkeys([*mates, *newcomers], peer.samples))
        if not peer.wants_compute():
            break
    assert peer.ready_for_round() and peer.samples == 52
    assert not peer.shown.believed(peer.step + 1), "the next step counts claims as made, or by a new round"


# --- 3. after a step cut short, every groupmate counted at twice that short step's weight -----------------


def test_after_a_step_cut_to_one_micro_batch_the_next_step_holds_the_target(trainer):
    """At the swarm's first step every peer counts claims as made, so one record claiming the target starts
    every round after one micro-batch (documented). The round that follows shows each groupmate at one
    micro-batch; a member still counts up to the round's floor (the target over its four peers), so
    at the next step, with the record gone, a peer of a group of four is ready at its share of 64 (before:
    232, and the step's batch 3.6 times the target)."""
    peer = trainer.peer
    mates = [f"mate{i}" for i in range(3)]
    assert peer.shown is None
    first = counted_claims({**dict.fromkeys(mates, MICRO), "sybil": TARGET}, own=MICRO, shown=None, step=0)
    assert MICRO + sum(first) >= TARGET, "the first step: one micro-batch each"
    peer.shown = ShownWork.of_round(
        step=peer.step, members=[peer.peer_id, *mates], weights=[MICRO] * 4, me=peer.peer_id, target=TARGET
    )
    while True:
        trainer._micro_step()
        at_step(peer, dict.fromkeys(mates, peer.samples))
        if not peer.wants_compute():
            break
    assert peer.ready_for_round() and peer.samples == TARGET // 4


def test_half_a_group_joining_its_round_with_one_micro_batch_leaves_every_member_at_its_share():
    """Honest, no attacker: four veterans of a group of eight hold 62 samples each when four newcomers join
    its round with one micro-batch each. The lower median of the signed weights is then 4, but a member
    counts up to the floor (32), so at the next step each member is ready at its share (before: 200
    samples, over six times its share)."""
    members = [f"p{i}" for i in range(8)]
    shown = ShownWork.of_round(
        step=5, members=members, weights=[62] * 4 + [MICRO] * 4, me="p0", target=TARGET
    )
    assert set(shown.weights.values()) == {MICRO}
    ready = first_ready(shown, lambda own: dict.fromkeys(members[1:], own), target=TARGET, micro=MICRO)
    assert ready == TARGET // 8
