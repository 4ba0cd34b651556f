"""An attacker's read of reducers scoring their own part (10612fb: ``SenderChecks._own_part``,
``replays_own_part``, the ``cleared`` book) found three ways in; each test here showed one on 10612fb
(asserting the bad outcome) and now checks its fix. In process, with the real model, dataset, codec,
signatures and ``SenderChecks`` (the world of ``tests/ownpart.py``).

The world: a tiny run whose validators practically never draw a part or a sender (the regime the commit
was made for: only a reducer's scores of its own part replay anyone), a group of four, each member the
reducer of its own part (one chunk), holding every member's signed input to it and its own signed
aggregate. Member ``LIAR`` sends its gradient reversed in the rounds it lies: it stands out in every part.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from ownpart import LIAR, MEMBERS, make_world, one_round, record_replays, reducer_after_round, sender_checks

import swarm.training.sendercheck as sendercheck
from lab.localswarm import tiny_run
from swarm.averaging.verification import own_part_evidence
from swarm.training.contribution import flagged_senders
from swarm.training.sendercheck import CLEARED_REPLAY_SHARE, CLEARED_ROUNDS, replays_own_part, still_replayed

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("own-part-redteam", verify_probability=1e-9, sender_check_probability=1e-9)


@pytest.fixture(scope="module")
def world():
    return make_world(RUN)


def _stands_out(w, runner, sender: int) -> bool:
    """Whether ``sender``'s input stands out among those the reducer ``runner`` aggregated (its drawn chunk)."""
    evidence = own_part_evidence(runner, 0)
    claims, odd = flagged_senders(
        RUN, evidence.inputs, evidence.checked_inputs(w.codec, w.numel), validator=runner.index
    )  # fmt: skip
    return sender in claims + odd


def _lying(w) -> list[torch.Tensor]:
    return [-w.honest[i] if i == LIAR else w.honest[i] for i in range(MEMBERS)]


def test_a_liar_that_withholds_its_reveal_from_a_designated_reducer_is_still_replayed_there(
    world, monkeypatch
):
    """Was MEDIUM. A reducer receives every groupmate's reveal before it sends its own, so the liar could
    compute the round's seed and the reducer ``replays_own_part`` named to replay it, and send its reveal
    to every member but that one. The others deferred to the designation; the designated one, without
    the seed, designated from its own randomness and picked itself in about one round in R - 1, so the
    liar that stands out in every chunk went unreplayed at no cost. Now a member without every reveal
    does not defer to a designation it cannot compute: any sender that stands out may be replayed."""
    w = world
    sent = _lying(w)
    for designated in replays_own_part(w.seed, reducer_after_round(w, 0, sent), LIAR):
        blind = reducer_after_round(w, designated, sent, heard=set(range(MEMBERS)) - {LIAR})
        assert blind.shared_seed is None and _stands_out(w, blind, LIAR)
        for n in range(3):  # whatever its own randomness draws
            own_draw = hashlib.sha256(b"own-draw-%d" % n).digest()
            monkeypatch.setattr(sendercheck, "os", SimpleNamespace(urandom=lambda k, d=own_draw: d[:k]))
            accused = []
            checks = sender_checks(w, accused)
            one_round(w, checks, blind)
            assert checks.checked == 1 and [a[0] for a in accused] == [w.members[LIAR]], (designated, n)


def test_one_colluding_reducer_named_by_the_draw_cannot_shield_a_liar_from_every_honest_one(world):
    """Was LOW. One reducer a round replayed a sender that stands out in the reducers' own parts; when the
    draw named a colluder it replayed nothing, and every honest reducer deferred to it. Now the draw names
    two (``OWN_PART_REPLAYERS``), so one colluder among them leaves an honest one that replays and files."""
    w = world
    sent = _lying(w)
    designated = replays_own_part(w.seed, reducer_after_round(w, 0, sent), LIAR)
    assert len(set(designated)) == 2 and LIAR not in designated
    for colluder in designated:
        filed = []
        for index in [i for i in range(MEMBERS) if i not in (LIAR, colluder)]:
            accused = []
            one_round(w, sender_checks(w, accused), reducer_after_round(w, index, sent))
            filed += [a[0] for a in accused]
        assert filed == [w.members[LIAR]], colluder  # the other designated reducer, and only it


def test_a_liar_cleared_by_one_honest_round_is_still_replayed_when_the_draw_says(world, monkeypatch):
    """Was LOW. Colluders that hold a chunk's median made the liar's honest input stand out; its replay
    booked it as cleared for ``CLEARED_ROUNDS`` rounds, in which it then lied, standing out, unreplayed
    at that reducer. Now a cleared sender that stands out is still replayed in the share
    ``CLEARED_REPLAY_SHARE`` of rounds the round's draw picks (fixed only after every input is signed), so
    the liar cannot count on the book; an honest sender made to stand out costs that share of a replay."""
    w = world
    shares = [still_replayed(hashlib.sha256(b"share-%d" % n).digest(), LIAR) for n in range(2000)]
    assert abs(sum(shares) / len(shares) - CLEARED_REPLAY_SHARE) < 0.05

    def runner(index, sent, seed):
        r = reducer_after_round(w, index, sent)
        r.shared_seed = seed  # scored evidence needs no draw: any seed files as the round's would
        return r

    h = replays_own_part(w.seed, reducer_after_round(w, 0, w.honest), LIAR)[0]  # an honest one it names
    colluders = [i for i in range(MEMBERS) if i not in (LIAR, h)]
    seeds = [hashlib.sha256(b"round-%d" % n).digest() for n in range(400)]
    seeds = [d for d in seeds if h in replays_own_part(d, reducer_after_round(w, h, w.honest), LIAR)]
    skip = [d for d in seeds if not still_replayed(d, LIAR)]
    hit = next(d for d in seeds if still_replayed(d, LIAR))
    replayed = record_replays(monkeypatch)
    # Round 1: the liar is honest; its colluders move the median so that it stands out at H: cleared.
    looks = [(-w.honest[LIAR] if i in colluders else w.honest[i]) for i in range(MEMBERS)]
    accused = []
    checks = sender_checks(w, accused)
    one_round(w, checks, runner(h, looks, skip[0]))
    assert replayed == [w.members[LIAR]] and accused == [] and w.members[LIAR] in checks.cleared
    # Then it lies: rounds whose draw spares a cleared sender skip it (what bounds the colluders' cost)...
    lies = _lying(w)
    for seed in skip[1 : CLEARED_ROUNDS // 2]:
        one_round(w, checks, runner(h, lies, seed))
    assert replayed == [w.members[LIAR]] and accused == []
    # ...and the first whose draw replays it anyway convicts it.
    one_round(w, checks, runner(h, lies, hit))
    assert replayed == [w.members[LIAR]] * 2 and [a[0] for a in accused] == [w.members[LIAR]]
