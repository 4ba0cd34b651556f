"""Reducers score the inputs of their own part: a sender whose input stands out is replayed by two reducers
a round, with no validator draw (``SenderChecks._own_part``, ``replays_own_part``), and a sender whose
replay found it honest is replayed again for standing out only in a share of the next ``CLEARED_ROUNDS``
rounds (``still_replayed``).

In process, with the real model, dataset, codec, signatures, ``SenderChecks`` and the coordinator's
``judge_contribution``. The world: a tiny run whose validators practically never draw a part or a sender
(so only a reducer's scores of its own part replay anyone), a group of four, each member the reducer of
its own part, holding the signed inputs of that part's one chunk and its own signed aggregate over them.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from ownpart import (
    LIAR,
    MEMBERS,
    judge,
    make_world,
    nonce,
    one_round,
    record_replays,
    reducer_after_round,
    sender_checks,
    signed_input,
)

from lab.localswarm import tiny_run
from swarm.training import sendercheck
from swarm.training.sendercheck import CLEARED_ROUNDS, replays_own_part, still_replayed

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("own-part-scores", verify_probability=1e-9, sender_check_probability=1e-9)


@pytest.fixture(scope="module")
def world():
    return make_world(RUN)


def test_two_reducers_a_round_replay_a_liar_that_stands_out_in_their_own_parts_and_the_coordinator_bans_it(
    world, monkeypatch
):
    """Before, only a member drawn to validate a part scored its inputs (``verify_probability``, 0.25 by
    default, a part each), so a liar that stands out in every chunk was replayed only in rounds whose draw
    gave some honest member a part holding it. Now every reducer scores its own part's drawn chunk, and
    the round's draw names two reducers (never the liar) to replay it: the liar is filed against at once."""
    w = world
    # Fits off: a reducer the draw does not name here may still score the liar's fit (by its own randomness,
    # ``tests/test_fit_scores.py``) and replay it for a poor one.
    monkeypatch.setattr(sendercheck, "FIT_SHARE", 0.0)
    sent = [-w.honest[i] if i == LIAR else w.honest[i] for i in range(MEMBERS)]
    designated = replays_own_part(w.seed, reducer_after_round(w, 0, sent), LIAR)
    assert len(designated) == 2 and set(designated) <= {0, 2, 3}
    filed = {}
    for index in (0, 2, 3):  # every honest reducer, each holding its own part's inputs
        accused = []
        checks = sender_checks(w, accused)
        one_round(w, checks, reducer_after_round(w, index, sent))
        filed[index] = accused
        assert checks.checked == (1 if index in designated else 0), index
    assert all([a[0] for a in filed[i]] == [w.members[LIAR]] for i in designated)
    assert not any(filed[i] for i in (0, 2, 3) if i not in designated)
    first = designated[0]
    lie = filed[first][0][1]
    assert lie.scored is not None and lie.scored.part == first

    found, guilty = judge(w, lie, w.members[first])
    assert guilty == w.members[LIAR] and "public batch seeds" in found, (found, guilty)


def test_the_designated_reducer_is_never_the_sender_nor_a_member_that_reduces_nothing(world):
    runner = reducer_after_round(world, 0, world.honest)
    runner.reduces = lambda part: part != 3  # member 3 cannot be dialed: it reduces no part
    picks = {s: set() for s in range(MEMBERS)}
    for n in range(200):
        seed = hashlib.sha256(b"seed-%d" % n).digest()
        for sender in range(MEMBERS):
            named = replays_own_part(seed, runner, sender)
            assert len(named) == min(2, len({0, 1, 2} - {sender})) == len(set(named)), (sender, named)
            picks[sender].update(named)
    for sender, picked in picks.items():
        assert picked == {0, 1, 2} - {sender}, (sender, picked)  # each one that may, over the draws


def test_an_honest_sender_made_to_stand_out_is_replayed_once_then_seldom_for_a_while(world, monkeypatch):
    """Colluders that move a chunk's median can make an honest sender stand out among a reducer's inputs.
    Its replay clears it; without a memory of that, the same colluders would cost its designated reducers
    a replay (a step, or a window) in every round. In the next ``CLEARED_ROUNDS`` rounds it is replayed
    for standing out only where the round's draw says so (``still_replayed``), here in none of them."""
    w = world
    target = 2
    # Members 1 and 3 send the target's gradient reversed: the median follows them, the target stands out.
    sent = [w.honest[0], -w.honest[target], w.honest[target], -w.honest[target]]
    reducer = 0
    seeds = (hashlib.sha256(b"round-%d" % n).digest() for n in range(400))
    seed = next(
        d
        for d in seeds
        if reducer in replays_own_part(d, reducer_after_round(w, 0, sent), target)
        and not still_replayed(d, target)
    )

    def runner():
        r = reducer_after_round(w, reducer, sent)
        r.shared_seed = seed
        return r

    replayed = record_replays(monkeypatch)
    accused = []
    checks = sender_checks(w, accused)
    one_round(w, checks, runner())
    assert replayed == [w.members[target]] and accused == []  # replayed, found honest, nobody filed
    for _ in range(CLEARED_ROUNDS):
        one_round(w, checks, runner())
    assert replayed.count(w.members[target]) == 1, replayed
    one_round(w, checks, runner())  # the memory has run out
    assert replayed.count(w.members[target]) == 2, replayed


@pytest.mark.parametrize("reveals", ["all", "withheld"])
def test_a_sender_whose_signed_input_does_not_decode_is_banned_without_a_draw(world, reveals, monkeypatch):
    """A reducer refuses an input with non-finite values (the ``nan`` attack) and, before, nobody could
    file it: the refused input was in no chunk's evidence, and only a drawn sender's could be filed. The
    reducer now keeps each sender's first validly signed input that does not decode
    (``PartReducer.undecodable``); one the draw names for that sender (any, without every reveal) replays
    the sender and files, with no draw (``WrongContributionEvidence.undecodable``), and the coordinator
    bans the sender once its own replay shows the input is not what its batch seeds give. (Without every
    reveal a reducer replays it by its own randomness, as often as the draw would name it,
    ``tests/test_decoy_filings.py``; here that randomness picks it.)"""
    w = world
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))
    heard = set(range(MEMBERS)) if reveals == "all" else set(range(MEMBERS)) - {LIAR}
    probe = reducer_after_round(w, 0, w.honest)
    reducer = replays_own_part(w.seed, probe, LIAR)[0] if reveals == "all" else 0
    runner = reducer_after_round(w, reducer, w.honest)
    if reveals == "withheld":
        runner.shared_seed, runner.reveals = None, {i: nonce(i) for i in heard}
    lo, hi = runner.chunk_range(reducer, 0)
    nan = w.codec.encode_contribution(torch.full((hi - lo,), float("nan")))
    runner.reducer.undecodable = {LIAR: (0, signed_input(w, LIAR, reducer, nan))}
    accused = []
    checks = sender_checks(w, accused)
    one_round(w, checks, runner)
    assert [a[0] for a in accused] == [w.members[LIAR]], accused
    lie, verdict = accused[0][1], accused[0][2]
    assert "does not decode" in verdict and lie.scored is None
    assert bool(lie.reveals) == (reveals == "all")

    found, guilty = judge(w, lie, w.members[reducer])
    assert guilty == w.members[LIAR] and "does not decode" in found, (found, guilty)
    # An input that decodes, filed the same way with no draw behind it, does not hold: the accuser pays.
    decodes = w.codec.encode_contribution(w.honest[LIAR][lo:hi])
    honest = dataclasses.replace(lie, item=signed_input(w, LIAR, reducer, decodes))
    found, guilty = judge(w, honest, w.members[reducer])
    assert guilty == w.members[reducer] and "does not hold" in found, (found, guilty)
