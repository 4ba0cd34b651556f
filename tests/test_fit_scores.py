"""A sender whose input does not fit its own first micro-batch is replayed by the reducer the round's draw
names to score its fit, and banned (``SenderChecks._poor_fit``, ``swarm.averaging.scores.fits_poorly``).

A stale contribution (an older step's, the ``delayed_gradient`` attack) points where every sender's does,
so it does not stand out by cosine or norm, and before, only a validator's draw could reach it. Its fit to
the gradient of the sender's own first micro-batch at the round's state, a public fact, is what gives it
away. In process, with the real model, dataset, codec, signatures, ``SenderChecks`` and the coordinator's
``judge_contribution``; the world of ``tests/ownpart.py`` (a group of four, each member the reducer of its
own part, validators that practically never draw).
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from ownpart import (
    LIAR,
    MEMBERS,
    STEP,
    force_fit_draws,
    judge,
    make_world,
    nonce,
    one_round,
    record_replays,
    reducer_after_round,
    sender_checks,
    trained,
)

from lab.localswarm import tiny_run
from swarm.averaging.verification import own_part_evidence
from swarm.training import fitbudget, sendercheck
from swarm.training.contribution import (
    WrongContributionEvidence,
    fit_draw,
    flagged_senders,
    micro_gradient,
    recompute,
    state_model,
)

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("fit-scores-1", verify_probability=1e-9, sender_check_probability=1e-9)
#: The liar sends the honest contribution it computed this many steps before, at the state of then (the
#: round is at ``STEP``; the batches of the older step are those of ``STEP - 1``).
DELAY = 1


@pytest.fixture
def every_round(monkeypatch):
    """Reducers afford every fit their chunk's draw names them for, in every round (each member computes 2
    micro-batches here, so at the default ``FIT_SHARE`` they would score in a fifth of the rounds or less)."""
    monkeypatch.setattr(sendercheck, "FIT_SHARE", 100.0)


@pytest.fixture(scope="module")
def world():
    old, now, _ = trained(RUN, [DELAY])[DELAY]
    w = make_world(RUN, now)
    w.old = old
    return w


def _stale(w) -> list[torch.Tensor]:
    sent = list(w.honest)
    sent[LIAR] = recompute(w.run, w.old, w.members[LIAR], STEP - 1, 2, device="cpu")
    return sent


def _scorers(w, sent: list[torch.Tensor], sender: int) -> list[int]:
    """The reducers whose chunk's draw has them score ``sender``'s fit, when member ``i`` sent ``sent[i]``
    (``fit_draw``: a hash of the chunk's other signed inputs)."""
    return [
        p for p in range(MEMBERS)
        if p != sender and fit_draw(own_part_evidence(reducer_after_round(w, p, sent), 0), sender, 2)[0]
    ]  # fmt: skip


def _accusation(w, runner, sender: int, *, reveals: bool = True) -> WrongContributionEvidence:
    """The evidence reducer ``runner`` would file against ``sender`` for its fit."""
    evidence = own_part_evidence(runner, 0)
    item = next(x for x in evidence.inputs if x.sender_index == sender)
    return WrongContributionEvidence(
        prefix=evidence.prefix, group_id=evidence.group_id, members=evidence.members,
        commitments=evidence.commitments, part=evidence.part, chunk=evidence.chunk, reducers=evidence.reducers,
        item=item, entry=w.entries[sender], reveals=tuple(nonce(i) for i in range(MEMBERS)) if reveals else (),
        scored=evidence,
    )  # fmt: skip


def _filings(w, sent: list[torch.Tensor], monkeypatch) -> list[tuple[int, int, list]]:
    """(reducer, micro-batch, what it filed) for each reducer of another part than the liar's made to score
    the liar's fit against each of its two micro-batches."""
    found = []
    for part, micro in ((p, m) for p in range(MEMBERS) if p != LIAR for m in range(2)):
        force_fit_draws(monkeypatch, {(part, LIAR): micro})
        accused = []
        one_round(w, sender_checks(w, accused), reducer_after_round(w, part, sent))
        found.append((part, micro, accused))
    return found


def test_a_stale_sender_that_does_not_stand_out_is_replayed_by_its_fit_scorer_and_banned(
    world, every_round, monkeypatch
):
    """A reducer made to score the stale sender finds, in most (reducer, micro-batch) pairs, that its input
    fits that micro-batch worse than the other inputs do, replays it and files; the coordinator checks the
    fit again on the state it downloads, replays and bans the liar. Nothing else points at it: it stands
    out nowhere."""
    w = world
    sent = _stale(w)
    for part in range(MEMBERS):
        if part != LIAR:
            evidence = own_part_evidence(reducer_after_round(w, part, sent), 0)
            claims, odd = flagged_senders(
                RUN, evidence.inputs, evidence.checked_inputs(w.codec, w.numel), validator=part
            )  # fmt: skip
            assert LIAR not in claims + odd  # its cosine and norm are an honest sender's
    filings = _filings(w, sent, monkeypatch)
    filed = [(part, micro, accused) for part, micro, accused in filings if accused]
    assert len(filed) >= 3, filings  # most of the 6 pairs
    for part, micro, accused in filed:
        assert [a[0] for a in accused] == [w.members[LIAR]], (part, accused)
        lie = accused[0][1]
        assert lie.scored is not None and lie.scored.part == part
        force_fit_draws(monkeypatch, {(part, LIAR): micro})
        found, guilty = judge(w, lie, w.members[part])
        assert guilty == w.members[LIAR] and "public batch seeds" in found, (found, guilty)


def test_honest_senders_are_never_filed_and_a_fit_is_scored_only_where_the_chunks_draw_says(
    world, every_round, monkeypatch
):
    """Scoring a fit costs a micro-batch's gradient: each reducer scores only the senders its chunk's draw
    names. A fit is a pointer, not a verdict: an honest sender whose fit happens to be low costs that
    reducer a replay, which clears it, and nobody is filed."""
    w = world
    replayed = record_replays(monkeypatch)
    scored = 0
    for index in range(MEMBERS):
        accused = []
        checks = sender_checks(w, accused)
        one_round(w, checks, reducer_after_round(w, index, w.honest))
        assert accused == []
        named = [s for s in range(MEMBERS) if index in _scorers(w, w.honest, s)]
        cleared = {w.members[s] for s in named if w.members[s] in replayed}
        assert checks.cleared.keys() == cleared
        # It scores each named sender in turn and replays the first that fits poorly, if any.
        assert checks.fits == len(named) if not cleared else 1 <= checks.fits <= len(named)
        scored += checks.fits
    assert scored >= 1 and len(replayed) < scored


def test_the_coordinator_bans_whoever_puts_a_fit_it_may_not(world, every_round, monkeypatch):
    """A fit the chunk's draw did not ask of the accuser, or of an honest sender, is a false accusation: it
    bans the accuser. The draw needs no reveal: the same accusation without them is judged the same."""
    w = world
    sent = _stale(w)
    part, micro, accused = next(f for f in _filings(w, sent, monkeypatch) if f[2])
    force_fit_draws(monkeypatch, {(part, LIAR): micro})
    for reveals in (True, False):  # the scorer the draw names: the liar is banned
        put = _accusation(w, reducer_after_round(w, part, sent), LIAR, reveals=reveals)
        found, guilty = judge(w, put, w.members[part])
        assert guilty == w.members[LIAR], found

    other = next(i for i in range(MEMBERS) if i not in (LIAR, part))  # a reducer the draw did not name
    for reveals in (True, False):
        lie = _accusation(w, reducer_after_round(w, other, sent), LIAR, reveals=reveals)
        found, guilty = judge(w, lie, w.members[other])
        assert guilty == w.members[other] and "did not have" in found, found

    honest = other  # an honest sender, named for its fit: its fit and then its replay clear it
    force_fit_draws(monkeypatch, {(part, honest): 0})
    found, guilty = judge(w, _accusation(w, reducer_after_round(w, part, sent), honest), w.members[part])
    assert guilty == w.members[part], found


def test_a_reducer_spends_its_fit_share_of_its_own_micro_batches_on_fits(world, monkeypatch):
    """A fit costs a micro-batch's gradient. A member that computed 2 micro-batches for the round affords
    ``FIT_SHARE`` of them, fits and the honest replays they point to together: it scores a sender its chunk's
    draw names in a few rounds of 60, picked by its own randomness (here a fixed stream, so the count is
    exact), and never runs more than a round's credit ahead of its budget."""
    w = world
    stream = iter(range(10**6))
    monkeypatch.setattr(
        sendercheck.os, "urandom", lambda n: hashlib.sha256(b"%d" % next(stream)).digest()[:n]
    )
    scorer = next(p for s in range(MEMBERS) for p in _scorers(w, w.honest, s))
    checks = sender_checks(w, [])
    rounds, own = 60, 2
    for _ in range(rounds):
        one_round(w, checks, reducer_after_round(w, scorer, w.honest))
    earned = sendercheck.FIT_SHARE * own * rounds
    spent = earned - checks.fit_budget.credit  # fits, and the replays of honest senders they pointed to
    assert 0.4 * earned <= checks.fits <= spent <= earned + own, (checks.fits, spent, earned)


def test_honest_senders_that_fit_poorly_cost_a_member_no_more_than_its_fit_share():
    """The more micro-batches an honest input holds, the more often it fits one of them worse than the
    others' inputs do (2% of chunks at 2 micro-batches, 13-17% at 8 on the tiny model), and each such
    replay costs the whole step. Whatever that rate, fits and those replays together cost a member at most
    ``FIT_SHARE`` of its own micro-batches (and one replay ahead of it a sender); where the rate is low, it
    scores a fit in every round the budget allows."""
    for poor_rate, micro_batches in ((0.0, 8), (0.17, 8), (1.0, 8), (0.02, 2)):
        budget = fitbudget.FitBudget(sendercheck.FIT_SHARE)
        rng, fits, spent, rounds = random.Random(7), 0, 0.0, 2000
        for _ in range(rounds):
            budget.earn(micro_batches, ["sender"])  # one sender named for this member's fit a round
            if rng.random() < budget.afford("sender"):
                fits += 1
                cost = 1 + (
                    micro_batches if rng.random() < poor_rate else 0
                )  # the fit, and a clearing replay
                budget.spend("sender", cost)
                spent += cost
        earned = sendercheck.FIT_SHARE * micro_batches * rounds
        assert spent <= earned + 1 + micro_batches, (poor_rate, micro_batches, spent, earned)
        expected = min(1.0, sendercheck.FIT_SHARE * micro_batches) * rounds / (1 + poor_rate * micro_batches)
        assert fits >= 0.8 * min(expected, rounds), (poor_rate, micro_batches, fits, expected)


def test_a_sender_whose_honest_fits_are_poor_spends_its_own_fits_and_not_a_liars():
    """A heavy honest input fits one of its micro-batches more loosely, and a sender that reads the public
    seeds can tell beforehand where. Its clearing replays are paid out of its own account at the member:
    it puts its own fits there into debt, for at most ``FIT_DEBT_ROUNDS`` rounds that name it (a liar that
    buys the debt with one honest heavy round buys no more), and the fits of a liar named beside it go on
    at their rate."""
    budget = fitbudget.FitBudget(sendercheck.FIT_SHARE)
    budget.earn(2, ["heavy", "liar"])
    budget.spend("heavy", 1 + 32)  # its fit, and the replay of a 32 micro-batch step that cleared it
    silent = 0
    while budget.afford("heavy") == 0.0:
        budget.earn(2, ["heavy", "liar"])
        assert budget.afford("liar") > 0
        silent += 1
        assert silent <= 40
    assert fitbudget.FIT_DEBT_ROUNDS <= silent <= fitbudget.FIT_DEBT_ROUNDS + 1, silent
    saved = fitbudget.FIT_CREDIT_ROUNDS * sendercheck.FIT_SHARE * 2 / 2  # its share of 2, saved 4 rounds
    assert budget.afford("liar") == pytest.approx(saved)


def test_a_fits_gradient_is_taken_for_its_chunk_alone_with_the_same_values(world):
    """A reducer takes only the gradients of the parameters that hold its chunk (a shorter backward pass):
    the values are the whole gradient's there, and the model it reuses for the round's other fits is left
    with every parameter's gradient on."""
    w = world
    model, _ = state_model(w.run, w.tensors, "cpu")
    whole = micro_gradient(w.run, w.tensors, w.members[LIAR], STEP, 1, device="cpu", model=model)
    n = whole.numel()
    for lo, hi in ((0, 10), (n // 3, n // 3 + 5000), (n - 7, n)):
        chunk = micro_gradient(
            w.run, w.tensors, w.members[LIAR], STEP, 1, device="cpu", model=model, span=(lo, hi)
        )
        assert chunk.shape == (hi - lo,)
        torch.testing.assert_close(chunk, whole[lo:hi], rtol=1e-5, atol=1e-7)
    assert all(p.requires_grad for p in model.parameters())
