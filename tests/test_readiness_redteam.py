"""Ways an every_step peer was made to start its round far short of the target batch, or to crash or lag,
through what ``swarm.training.readiness`` counted of the claims at its step; each test asserts the bound
that now holds (each failed on the rule's first version: an allowance of twice the other groups' certified
weight, groups weighed at the median group's, and no round counted as the peer's own samples).
"""

from __future__ import annotations

import math

import pytest
from helpers import module_dht_fixtures
from readiness_helpers import (
    DIGEST,
    MICRO,
    TARGET,
    at_step,
    keys,
    readiness_trainer,
    signed_group,
)

from swarm.averaging.tiercert import (
    certificate,
    certificate_shape_misfit,
)
from swarm.training.readiness import ShownWork, counted_claims

module_nodes, nodes = module_dht_fixtures(1)


@pytest.fixture
def trainer(nodes):
    return readiness_trainer(nodes, "readiness-redteam")


def mates_of(peer, count: int, weight: float, *, groups=(), group_id=b"mine") -> list[str]:
    """Give ``peer`` a last round with ``count`` groupmates, each (and itself) at ``weight``."""
    mates = [f"mate{i}" for i in range(count)]
    peer.shown = ShownWork.of_round(
        step=peer.step, members=[peer.peer_id, *mates], weights=[weight] * (count + 1), me=peer.peer_id,
        target=TARGET, groups=list(groups), group_id=group_id,
    )  # fmt: skip
    return mates


# --- 1. the other groups' allowance held their whole work a second time ---------------------------------


def test_in_a_swarm_of_two_groups_one_record_claiming_the_batch_adds_nothing_to_the_other_groups_pace(
    trainer,
):
    """Two honest groups of four at the run's steady share (32 samples each: 8 x 32 = the target). The
    other group's peers count at the pace of the peer's own group, so one Sybil record claiming the target
    adds nothing: the peer starts its round when its group holds its usual share, as without the record."""
    peer = trainer.peer
    share = TARGET // 8
    groups = [signed_group(b"mine", keys(4), 4.0 * share), signed_group(b"other", keys(4), 4.0 * share)]
    mates = mates_of(peer, 3, share, groups=groups)
    assert peer.shown.rest == 4 * share
    trainer._micro_step()
    others = {f"other{i}": peer.samples for i in range(4)}  # the other group computes at the same pace
    at_step(peer, {**{m: peer.samples for m in mates}, **others, "sybil": TARGET})
    assert peer.samples == MICRO and not peer.ready_for_round() and peer.wants_compute()
    honest = {**{m: MICRO for m in mates}, **others}
    with_sybil = counted_claims({**honest, "sybil": TARGET}, own=MICRO, shown=peer.shown, step=peer.step)
    assert sum(with_sybil) == sum(counted_claims(honest, own=MICRO, shown=peer.shown, step=peer.step))
    while peer.wants_compute():
        trainer._micro_step()
        at_step(
            peer,
            {**{m: peer.samples for m in mates}, **others, "sybil": TARGET}
            | {o: peer.samples for o in others},
        )
    assert 8 * peer.samples >= TARGET, "the step's batch: the target"


def test_in_a_multi_group_swarm_a_sybil_record_at_every_step_leaves_every_steps_batch_at_the_target():
    """Steps of the counting rule, each peer computing at the same pace, with one Sybil record at every
    step claiming the target: every step's batch is the target (before: one micro-batch per peer at every
    other step)."""

    def step_batches(groups: int, size: int, steps: int) -> list[int]:
        prev, batches = TARGET // (groups * size), []
        for s in range(steps):
            certs = [
                certificate(b"g%d" % g, [f"g{g}p{i}" for i in range(size)], float(size * prev), DIGEST,
                            dict.fromkeys(range(size), b"signed"))
                for g in range(groups)
            ]  # fmt: skip
            shown = ShownWork.of_round(
                step=s, members=[f"g0p{i}" for i in range(size)], weights=[prev] * size, me="g0p0",
                target=TARGET, groups=certs, group_id=b"g0",
            )  # fmt: skip
            own = 0
            while True:
                own += MICRO
                claims = {f"g{g}p{i}": own for g in range(groups) for i in range(size) if (g, i) != (0, 0)}
                if (
                    own + sum(counted_claims({**claims, "sybil": TARGET}, own=own, shown=shown, step=s))
                    >= TARGET
                ):
                    break
            batches.append(groups * size * own)
            prev = own
        return batches

    for groups, size in ((2, 4), (4, 8)):
        batches = step_batches(groups, size, 6)
        assert all(TARGET <= b < TARGET + groups * size * MICRO for b in batches), batches


# --- 2. a group certificate's weight holds its members' raw claims, not what the rule credits ----------


def test_a_liar_in_most_groups_weighs_its_group_no_more_than_its_signers_as_median_members(trainer):
    """Three groups of four; in two of them one admitted member signed the whole target as its weight (a
    minority of its group: the robust rule credits it as the median member), and its honest groupmates
    attest the group's total signed weight, the liar's claim in it. Each such group counts as at most its
    four signers at the peer's own median member, so after a step of one micro-batch per peer the peer
    computes on until the step holds the target at the pace its own group shows."""
    peer = trainer.peer
    prev = MICRO  # the last step was one micro-batch per peer
    lying = math.fsum([prev, prev, prev, peer.averager.max_weight])  # facts.weight of its group
    groups = [
        signed_group(b"mine", keys(4), 4.0 * prev),
        signed_group(b"g2", keys(4), lying),
        signed_group(b"g3", keys(4), lying),
    ]
    mates = mates_of(peer, 3, prev, groups=groups)
    assert peer.shown.rest == 2 * 4 * peer.shown.floor, "each as its four signers at the round's floor"
    trainer._micro_step()
    others = {f"g{g}p{i}": MICRO for g in (2, 3) for i in range(4)}
    at_step(peer, {**{m: MICRO for m in mates}, **others, "g2p3": TARGET})  # the liar's own record
    assert not peer.ready_for_round()
    while peer.wants_compute():
        trainer._micro_step()
        n = peer.samples
        at_step(peer, {**{m: n for m in mates}, **{o: n for o in others}, "g2p3": TARGET})
    assert 12 * peer.samples >= TARGET


# --- 3. made-up groups of Sybil identities counted as groups at the median group's weight ---------------


def test_a_made_up_group_in_the_second_tier_counts_as_its_signers_only(trainer):
    """A swarm of one honest group of four at the steady share (64 each). Two admitted Sybil identities
    certify a made-up group of their own and join the honest group's second tier: they count as two median
    members (before: as a whole group, and one record then started the peer's round after a micro-batch)."""
    peer = trainer.peer
    share = TARGET // 4
    groups = [signed_group(b"mine", keys(4), 4.0 * share), signed_group(b"made-up", keys(2), 1e6)]
    mates = mates_of(peer, 3, share, groups=groups)
    assert peer.shown.rest == 2 * share
    trainer._micro_step()
    at_step(peer, {**{m: peer.samples for m in mates}, "sybil": TARGET})
    assert not peer.ready_for_round()
    while peer.wants_compute():
        trainer._micro_step()
        at_step(peer, {**{m: peer.samples for m in mates}, "sybil": TARGET})
    assert (4 + 2) * peer.samples >= TARGET, "its group, and the two identities as median members"


def test_made_up_groups_sharing_their_members_count_each_signer_once():
    """Three identities certify two made-up groups (the third signs both): the second certificate holds no
    majority of signers not counted before, so it adds nothing."""
    a, b, c = keys(3)
    honest = [signed_group(b"mine", keys(4), 64.0), signed_group(b"other", keys(4), 64.0)]
    made_up = [signed_group(b"s1", [a, c], 1e6), signed_group(b"s2", [b, c], 1e6)]
    without = ShownWork.of_round(
        step=0, members=["me", "x"], weights=[32, 32], me="me", target=TARGET, groups=honest, group_id=b"mine"
    )
    with_them = ShownWork.of_round(
        step=0,
        members=["me", "x"],
        weights=[32, 32],
        me="me",
        target=TARGET,
        groups=honest + made_up,
        group_id=b"mine",
    )
    # Each counted signer weighs one member (here the floor: the target over the peers shown), "c" once.
    assert without.rest == 4 * without.floor and with_them.rest == (4 + 2) * with_them.floor


# --- 4. certified weights that overflowed crashed the peer ------------------------------------------------


def test_huge_certified_weights_are_bounded_when_the_round_is_recorded():
    """Well-formed certificates (finite weights >= 0) of made-up groups that are most of the tier, at 1e308:
    the sum overflowed in ``ShownWork.of_round``, which runs in ``TrainingPeer._round`` after the commit."""
    groups = [
        signed_group(b"mine", keys(2), 64.0),
        signed_group(b"s1", keys(2), 1e308),
        signed_group(b"s2", keys(2), 1e308),
    ]
    for g in groups:
        assert certificate_shape_misfit({"group": g}, signer=g["members"][0]) is None
    shown = ShownWork.of_round(
        step=0, members=["me", "x"], weights=[32, 32], me="me", target=TARGET, groups=groups, group_id=b"mine"
    )
    assert shown.rest == 2 * 2 * shown.floor


def test_a_made_up_group_certified_under_the_peers_own_group_id_counts_for_nothing(trainer):
    """One made-up certificate carrying the peer's own group's ID at 1e308: ``int`` of twice it raised in
    ``counted_claims``, so ``TrainingPeer.wants_compute`` raised at every turn of the loop."""
    peer = trainer.peer
    groups = [
        signed_group(b"mine", keys(2), 64.0),
        signed_group(b"s1", keys(2), 1e308),
        signed_group(b"mine", keys(2), 1e308),  # another group's certificate under the same ID
    ]
    mates_of(peer, 1, 32, groups=groups)
    assert peer.shown.rest == 2 * peer.shown.floor
    trainer._micro_step()
    at_step(peer, {"mate0": MICRO, "sybil": 10**18})
    assert peer.wants_compute() and not peer.ready_for_round()


# --- 5. a peer with no round behind it lagged the peers that had one --------------------------------------


def test_a_peer_with_no_round_behind_it_is_ready_with_the_peers_at_its_step(trainer):
    """Four peers that averaged together last step hold a steady share; a peer that joined (or caught up
    by a download: ``shown`` is set by applied rounds only) counted
    their claims together as at most its own samples and computed on to half the target, missing their
    round. It now counts claims as made, and is ready with them."""
    peer = trainer.peer
    assert peer.shown is None
    share = -(-TARGET // 5)  # 52: where the four start (own + 3 groupmates + the newcomer's claim)
    four = [f"veteran{i}" for i in range(4)]
    seen = ShownWork.of_round(
        step=peer.step, members=four, weights=[TARGET // 4] * 4, me=four[0], target=TARGET
    )
    veteran_counts = counted_claims(
        {**{v: share for v in four[1:]}, peer.peer_id: share}, own=share, shown=seen, step=peer.step
    )
    assert share + sum(veteran_counts) >= TARGET, "a veteran is ready at a fifth of the target"
    while peer.samples < share:
        trainer._micro_step()
    at_step(peer, {v: share for v in four})
    assert peer.ready_for_round() and not peer.wants_compute(), "the newcomer, with as much, is too"
    # A round of an earlier step (a download past it) is not believed either.
    old = ShownWork.of_round(step=0, members=["me", *four], weights=[TARGET // 5] * 5, me="me", target=TARGET)
    assert sum(counted_claims({v: share for v in four}, own=share, shown=old, step=1)) == 4 * share
