"""An every_step peer counts the samples other peers claim at its step only as far as work it saw.

Before, ``EveryStepSync.ready`` summed every record's claim: one admitted identity's record claiming the
target batch made every peer at that step start its round after one micro-batch of its own."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import KEYS, module_dht_fixtures
from readiness_helpers import plain_group

from lab.localswarm import tiny_run
from swarm.training.progress import PeerProgress
from swarm.training.readiness import CLAIM_GROWTH, ShownWork, counted_claims
from swarm.training.trainer import Trainer

module_nodes, nodes = module_dht_fixtures(1)


def test_claims_beside_a_round_count_as_far_as_it_showed_and_sybil_records_share_the_peers_own_samples():
    # A peer with no round behind it counts claims as made (its own round only is brought forward).
    assert sum(counted_claims({"a": 8, "b": 100}, own=8, shown=None, step=0)) == 108
    # A peer whose last round held "a" and "b" counts them up to what they signed there...
    shown = ShownWork.of_round(step=3, members=["me", "a", "b"], weights=[16, 16, 16], me="me", target=48)
    assert sorted(counted_claims({"a": 10, "b": 10**9}, own=8, shown=shown, step=3)) == [0, 10, 16]
    # ...and any number of records with no round behind them share one allowance: its own samples.
    claims = {"a": 16, "b": 16, **{f"sybil{i}": 256 for i in range(100)}}
    assert sum(counted_claims(claims, own=8, shown=shown, step=3)) == 16 + 16 + 8
    assert sum(counted_claims({"sybil": 10**18}, own=8, shown=shown, step=3)) == 8
    # Only at the step that round brought it to: after a download (or an adoption) claims count as made.
    assert sum(counted_claims({"a": 16, "sybil": 100}, own=4, shown=shown, step=4)) == 116


def test_a_member_counts_at_most_the_median_member_or_the_floor_and_nothing_once_its_input_was_dropped():
    # A liar that signed the whole batch in the last round is counted as the rule weighs it: the lower
    # median of the members' weights.
    shown = ShownWork.of_round(step=1, members=["me", "a", "liar"], weights=[16, 16, 256], me="me", target=48)
    assert shown.weights["liar"] == 16 and shown.own == 16 and shown.floor == 16
    assert counted_claims({"liar": 256}, own=4, shown=shown, step=1)[0] == int(CLAIM_GROWTH * 16)
    # One whose input this peer's part left out showed no work.
    dropped = ShownWork.of_round(
        step=1, members=["me", "a", "b"], weights=[16] * 3, me="me", target=48, dropped={"b"}
    )
    assert counted_claims({"b": 16}, own=4, shown=dropped, step=1)[:1] == [0]
    # A member that signed one micro-batch (a step cut short) still counts up to the floor: the target over
    # the round's peers.
    short = ShownWork.of_round(step=1, members=["me", "a", "b", "c"], weights=[4] * 4, me="me", target=256)
    assert short.floor == 64
    assert counted_claims({"a": 64, "b": 200}, own=64, shown=short, step=1)[:2] == [64, 64]


def test_the_other_groups_count_at_their_pace_and_at_most_their_signers_as_median_members():
    mine = plain_group(b"mine", ["me", "a"], 64.0)
    groups = [
        mine,
        plain_group(b"g2", ["c", "d"], 64.0),
        plain_group(b"liar", ["e", "f"], 10_000.0),  # one liar's raw weight in its group's certificate
        plain_group(b"again", ["c", "d"], 64.0),  # the same signers certifying a second group
        plain_group(b"mine", ["x", "y"], 10**300),  # another certificate under this peer's group ID
    ]
    shown = ShownWork.of_round(
        step=2, members=["me", "a"], weights=[32, 32], me="me", target=192, groups=groups, group_id=b"mine"
    )
    assert shown.rest == 64.0 + 2 * 32.0, "each group at most its signers as median members, each signer once"
    assert shown.floor == 192 / 6
    # At the pace of its last round (its members signed 32 each and now count 32), the other groups'
    # claims count up to their 128, whatever identities claim beside them.
    claims = {"a": 32, **{f"p{i}": 32 for i in range(4)}, **{f"sybil{i}": 256 for i in range(50)}}
    assert sum(counted_claims(claims, own=32, shown=shown, step=2)) == 32 + 128
    # Halfway through the step (they hold half what they signed), half of that.
    assert sum(counted_claims(claims | {"a": 16}, own=16, shown=shown, step=2)) == 16 + 64
    # A member claiming more counts as its weight and moves no pace: with "a" past its weight, the pace is
    # still this peer's own (held between the two members' ratios).
    assert sum(counted_claims(claims | {"a": 10**9}, own=16, shown=shown, step=2)) == 32 + 64


@pytest.fixture
def trainer(nodes):
    torch.set_num_threads(1)
    run = tiny_run("readiness")
    dht = nodes[0]
    me = dht.peer_id.to_base58()
    return Trainer(run, dht, peer_id=me, signing_key=KEYS[me])


def test_one_record_claiming_the_whole_batch_no_longer_starts_a_peers_round_after_one_micro_batch(trainer):
    """A real peer whose last round held two groupmates: a Sybil's record at its step claiming the target
    batch counts no more than the peer's own samples, so the peer computes on until its groupmates' and
    its own samples reach the batch (before: ready after its first micro-batch)."""
    peer, run = trainer.peer, trainer.peer.config
    target, micro = run.training.target_batch_size, run.training.micro_batch_size
    now = time.time()
    mates = [PeerProgress(f"mate{i}", 0, 0, 1.0, peer.state_hash, now) for i in range(2)]
    share = target / 3
    peer.shown = ShownWork.of_round(
        step=peer.step,
        members=[peer.peer_id, *(m.peer_id for m in mates)],
        weights=[share] * 3,
        me=peer.peer_id,
        target=target,
    )
    sybil = PeerProgress("sybil", 0, target, 1.0, peer.state_hash, now)
    peer.progress_view.peers = {p.peer_id: p for p in [*mates, sybil]}
    peer.progress_view.count = peer._step_view + 1  # a view fetched after this step began
    trainer._micro_step()
    assert peer.samples == micro
    assert not peer.ready_for_round() and peer.wants_compute(), "one record decided the step"
    # Its groupmates computing as it does (their claims growing with its own): the batch is reached by the
    # three of them, the Sybil adding at most the peer's own samples.
    while peer.wants_compute():
        trainer._micro_step()
        for m in mates:
            peer.progress_view.peers[m.peer_id] = PeerProgress(
                m.peer_id, 0, peer.samples, 1.0, peer.state_hash, now
            )
        assert peer.samples <= target
    assert peer.ready_for_round()
    assert 3 * peer.samples >= target / 2, "the Sybil at most halved the step's batch"
    assert 4 * peer.samples >= target, "counted: its own, its two groupmates', and at most its own again"
