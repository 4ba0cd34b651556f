"""What ``swarm.training.readiness`` counts of the claims at an every_step peer's step, in a swarm of several
groups, against three defects of its third version: the other groups' allowance (``ShownWork.rest``
scaled by ``ShownWork.pace``) was driven to the peer's own samples by one groupmate of a group of two
claiming nothing (the pace was the lower median of two ratios: their minimum) or signing a sliver of
weight (each other group weighed at most its signers times that sliver), or by a round that showed every
member at one micro-batch, and the peer then computed several times its share. Each test failed on that
version and now asserts the peer is ready at its share, or within one micro-batch of it.
"""

from __future__ import annotations

import pytest
from helpers import module_dht_fixtures
from readiness_helpers import (
    MICRO,
    TARGET,
    at_step,
    first_ready,
    plain_group,
    readiness_trainer,
)

from swarm.training.readiness import ShownWork

module_nodes, nodes = module_dht_fixtures(1)


@pytest.fixture
def trainer(nodes):
    return readiness_trainer(nodes, "readiness-redteam3")


def swarm_of(groups: int, size: int, weight: float, *, target: int, member_weights=None) -> ShownWork:
    """The round of ``g0p0``: ``groups`` groups of ``size`` that combined in a second tier, each member
    having signed ``weight`` (or, in ``g0p0``'s own group, ``member_weights``)."""
    certs = [
        plain_group(b"g%d" % g, [f"g{g}p{i}" for i in range(size)], size * weight) for g in range(groups)
    ]
    return ShownWork.of_round(
        step=1, members=[f"g0p{i}" for i in range(size)], weights=member_weights or [weight] * size,
        me="g0p0", target=target, groups=certs, group_id=b"g0",
    )  # fmt: skip


def everyone(groups: int, size: int):
    """Every other peer of the swarm, each holding as much as ``g0p0``."""
    return lambda own: {f"g{g}p{i}": own for g in range(groups) for i in range(size) if (g, i) != (0, 0)}


# --- 1. a groupmate of a group of two set the pace of every other group ---------------------------------


def test_a_groupmate_of_a_group_of_two_claiming_nothing_costs_no_more_than_publishing_nothing(trainer):
    """Four groups of two at the run's steady share (32 samples each). The peer's last groupmate took part
    in the round with its honest weight, and at this step its record claims 0 samples (what a slow or
    just-started peer's record says). The pace is the peer's own, held between the two members' ratios, so
    the other groups count at the peer's pace: it is ready at 40, as when the groupmate publishes nothing
    (before: 128, four times its share, while every other peer was ready at 32)."""
    peer = trainer.peer
    share, liar = TARGET // 8, "liar"
    groups = [
        plain_group(b"mine", [peer.peer_id, liar], 2.0 * share),
        *(plain_group(b"g%d" % g, [f"g{g}p0", f"g{g}p1"], 2.0 * share) for g in range(1, 4)),
    ]
    peer.shown = ShownWork.of_round(
        step=peer.step, members=[peer.peer_id, liar], weights=[share, share], me=peer.peer_id,
        target=TARGET, groups=groups, group_id=b"mine",
    )  # fmt: skip
    assert peer.shown.rest == 3 * 2 * share and peer.shown.weights == {liar: share}

    def others(own: int) -> dict[str, int]:
        return {f"g{g}p{i}": own for g in range(1, 4) for i in range(2)}

    while True:
        trainer._micro_step()
        at_step(peer, {**others(peer.samples), liar: 0})
        if not peer.wants_compute():
            break
    truthful = first_ready(peer.shown, lambda own: {**others(own), liar: own}, target=TARGET, micro=MICRO)
    silent = first_ready(peer.shown, others, target=TARGET, micro=MICRO)
    assert (truthful, silent) == (share, 40)
    assert peer.ready_for_round() and peer.samples == silent


def test_in_groups_of_two_a_groupmate_claiming_nothing_costs_the_peer_one_share_at_most_whatever_the_swarm():
    """The same in swarms of 4, 8 and 16 groups of two: the groupmate claiming nothing costs what its
    silence costs, less than one more share (before: the peer computed half the target, 4, 8 and 16 times
    its share)."""
    target = 1024
    for groups in (4, 8, 16):
        share = target // (2 * groups)
        shown = swarm_of(groups, 2, share, target=target)
        honest = everyone(groups, 2)
        assert first_ready(shown, honest, target=target, micro=MICRO) == share
        denied = first_ready(shown, lambda own, h=honest: {**h(own), "g0p1": 0}, target=target, micro=MICRO)
        silent = first_ready(
            shown, lambda own, h=honest: {k: v for k, v in h(own).items() if k != "g0p1"}, target=target,
            micro=MICRO,
        )  # fmt: skip
        assert denied == silent < 2 * share, (groups, denied, silent)


# --- 2. the other groups weighed at most their signers times the round's median, which the floor missed --


def test_a_groupmate_of_a_group_of_two_signing_a_sliver_of_weight_leaves_the_other_groups_allowance():
    """Four (or sixteen) groups of two at the steady share. The peer's groupmate signs 1e-9 for its part (a
    weight above 0, so it is not dropped): the round's lower median is then 1e-9, but each other group
    still weighs its signers at the round's floor, and the peer is ready at its share (before: 96 samples,
    three times its share; with 16 groups, 480, fifteen times)."""
    for groups, target in ((4, TARGET), (16, 1024)):
        share = target // (2 * groups)
        shown = swarm_of(groups, 2, share, target=target, member_weights=[share, 1e-9])
        assert shown.rest == (groups - 1) * 2 * shown.floor and shown.weights["g0p1"] > 0
        assert first_ready(shown, everyone(groups, 2), target=target, micro=MICRO) == share


def test_after_a_step_cut_to_one_micro_batch_a_swarm_of_several_groups_holds_the_target_at_the_next():
    """At the swarm's first step one record claiming the target starts every round after one micro-batch
    (documented); each round, and each group certificate of the second tier, then shows every member at 4
    samples. Each other group now weighs its signers at the round's floor (the target over the peers the
    round showed), so at the next step every peer is ready at its share and the step holds the target
    (before: 4 groups of 4 at target 256 computed 64 samples each, a batch of four times the target; 8
    groups of 4 at target 1024, 416 each: 13 times)."""
    for groups, size, target in ((4, 4, 256), (8, 4, 1024)):
        shown = swarm_of(groups, size, MICRO, target=target)
        assert shown.floor == target // (groups * size) and shown.rest == (groups - 1) * size * shown.floor
        own = first_ready(shown, everyone(groups, size), target=target, micro=MICRO)
        assert own == target // (groups * size) and groups * size * own == target
