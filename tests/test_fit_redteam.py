"""Regression tests from an attacker's read of the fit scores (a reducer scores a sender's fit to one of its own
micro-batches and replays one that fits worse than the others: ``SenderChecks._poor_fit``,
``swarm.averaging.scores.fits_poorly``, and the coordinator's ``check_fit_scorer`` / ``check_fits_poorly`` in
``judge_contribution``). Each test checks that a defect of the first version of the fit (ae12409 and
aab23b6: scored against the sender's first micro-batch, by one scorer the round's reveals named) is gone;
its docstring says what the attack was. In process, with the real
model, dataset, codec, signatures, ``SenderChecks`` and the coordinator's ``judge_contribution`` (the world of
``tests/ownpart.py``: a group of four, each member the reducer of its own part, one chunk a part; validators
that practically never draw, so only the reducers' own-part checks, and now the fit, replay anyone). The
round is at ``STEP``; ``old`` is the state one step before it, as in ``tests/test_fit_scores.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

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
    reducer_after_round,
    sender_checks,
    trained,
)

import coordinator.contributions as contributions
import swarm.training.sendercheck as sendercheck
from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from swarm.averaging.scores import fits_poorly
from swarm.averaging.verification import own_part_evidence
from swarm.training.contribution import (
    WrongContributionEvidence,
    fit_draw,
    fit_micro_batches,
    micro_gradient,
    recompute,
)

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("fit-redteam-3", verify_probability=1e-9, sender_check_probability=1e-9)


@pytest.fixture
def afforded(monkeypatch):
    """Reducers afford every fit their chunk's draw names them for, in every round (each member scores its
    named senders with probability ``FIT_SHARE`` times its own micro-batches over their number; a member of
    a diloco run with windows of H >= 10 inner steps affords them all; here each computes 2, so the share
    is raised to make every round one of those in which it scores)."""
    monkeypatch.setattr(sendercheck, "FIT_SHARE", 100.0)


@pytest.fixture(scope="module")
def world():
    """The world at ``STEP`` (one step of training on from the run's model), and ``old``, the state of the
    step before it, at which a stale sender computed what it sends again."""
    old, now, _ = trained(RUN, [1])[1]
    w = make_world(RUN, now)
    w.old = old
    return w


def _stale(w) -> torch.Tensor:
    """The liar's honest contribution of the step before (two micro-batches at the old state)."""
    return recompute(w.run, w.old, w.members[LIAR], STEP - 1, 2, device="cpu")


def _sending(w, liar_sends: torch.Tensor) -> list[torch.Tensor]:
    sent = list(w.honest)
    sent[LIAR] = liar_sends
    return sent


def _draws(w, sent: list[torch.Tensor], sender: int) -> dict[int, int]:
    """Reducer -> the micro-batch it scores ``sender``'s fit against, for the reducers whose chunk's draw has
    them score it (``fit_draw``)."""
    found = {}
    for part in range(MEMBERS):
        if part != sender:
            scores, micro = fit_draw(own_part_evidence(reducer_after_round(w, part, sent), 0), sender, 2)
            if scores:
                found[part] = micro
    return found


def _evidence(w, runner, sender: int, *, reveals: bool = True, scored=None) -> WrongContributionEvidence:
    """The evidence the reducer ``runner`` would file against ``sender`` with its own part's chunk."""
    chunk = own_part_evidence(runner, 0) if scored is None else scored
    item = next(x for x in chunk.inputs if x.sender_index == sender)
    return WrongContributionEvidence(
        prefix=chunk.prefix, group_id=chunk.group_id, members=chunk.members, commitments=chunk.commitments,
        part=chunk.part, chunk=chunk.chunk, reducers=chunk.reducers, item=item, entry=w.entries[sender],
        reveals=tuple(nonce(i) for i in range(MEMBERS)) if reveals else (), scored=chunk,
    )  # fmt: skip


def test_a_stale_sender_that_recomputes_only_its_first_micro_batch_fails_the_fit_against_another(
    world, afforded, monkeypatch
):
    """Was MEDIUM. The fit was scored against the sender's *first* micro-batch, which it knows in advance: a
    stale sender recomputed only that one and swapped it into its old contribution (``stale + (g1_now -
    g1_old) / k``, 1/k of the work) and passed every fit. Now the micro-batch is one of its signed k, picked
    by a hash of the chunk's other signed inputs (``fit_draw``), which it cannot know when it signs: the
    adjusted input fits its first micro-batch but not its second, and a scorer whose draw picks the second
    replays it and files."""
    w = world
    liar = w.members[LIAR]
    g0_now = micro_gradient(w.run, w.tensors, liar, STEP, 0, device="cpu")
    g0_old = micro_gradient(w.run, w.old, liar, STEP - 1, 0, device="cpu")
    g1_now = micro_gradient(w.run, w.tensors, liar, STEP, 1, device="cpu")
    adjusted = _stale(w) + (g0_now - g0_old) / 2
    sent = _sending(w, adjusted)
    for part in range(MEMBERS):
        if part == LIAR:
            continue
        runner = reducer_after_round(w, part, sent)
        decoded = own_part_evidence(runner, 0).checked_inputs(w.codec, w.numel)
        lo, hi = runner.chunk_range(part, 0)
        assert not fits_poorly(decoded, LIAR, g0_now[lo:hi]), part  # the micro-batch it adapted to
        assert fits_poorly(decoded, LIAR, g1_now[lo:hi]), part  # the one it did not

    # Whichever reducer's draw picks the second micro-batch files against it: here, forced to.
    scorer = next(p for p in range(MEMBERS) if p != LIAR)
    force_fit_draws(monkeypatch, {(scorer, LIAR): 1})
    accused = []
    one_round(w, sender_checks(w, accused), reducer_after_round(w, scorer, sent))
    assert [a[0] for a in accused] == [liar], accused
    found, guilty = judge(w, accused[0][1], w.members[scorer])
    assert guilty == liar, found


def test_the_micro_batch_a_fit_is_scored_against_and_its_scorers_follow_the_other_signed_inputs():
    """The sender cannot know which micro-batch, or which reducers: across rounds (other signatures of the
    other inputs) each micro-batch of 4 is drawn about as often, and each of 3 reducers scores a sender in
    about a third of the rounds (fixed signatures here, so the counts are exact)."""
    w = make_world(RUN)
    picks, scorers = [0] * 4, [0] * MEMBERS
    for n in range(240):
        chunk = own_part_evidence(reducer_after_round(w, 0, w.honest), 0)
        inputs = tuple(
            dataclasses.replace(x, signature=hashlib.sha512(b"%d-%d" % (n, x.sender_index)).digest())
            for x in chunk.inputs
        )
        chunk = dataclasses.replace(chunk, inputs=inputs)
        scores, micro = fit_draw(chunk, LIAR, 4)
        picks[micro] += 1
        scorers[0] += scores
    assert all(40 <= c <= 80 for c in picks), picks
    assert 50 <= scorers[0] <= 110, scorers
    # In diloco only the window's first inner step is scored (another's batch is taken some steps in).
    diloco = tiny_run("fit-redteam-diloco", sync="diloco", inner_steps=4)
    assert fit_micro_batches(diloco, 16.0) == 1 and fit_micro_batches(RUN, 16.0) == 4


def test_a_stale_sender_that_withholds_its_reveal_from_its_scorer_is_scored_all_the_same(
    world, afforded, monkeypatch
):
    """Was MEDIUM. The scorer was named by the round's reveals; a sender sees every reveal before it sends
    its own, so it withheld its reveal from its scorer alone, which then scored one sender it picked (the
    liar in one round of R - 1). Now the scorer follows the chunk's other signed inputs, not the reveals:
    without every reveal the same reducers score it and file."""
    w = world
    liar = w.members[LIAR]
    sent = _sending(w, _stale(w))
    filed = 0
    for scorer, micro in ((p, m) for p in range(MEMBERS) if p != LIAR for m in range(2)):
        force_fit_draws(monkeypatch, {(scorer, LIAR): micro})  # a reducer the chunk's draw names
        accused = []
        one_round(w, sender_checks(w, accused), reducer_after_round(w, scorer, sent))
        blind = reducer_after_round(w, scorer, sent, heard=set(range(MEMBERS)) - {LIAR})
        assert blind.shared_seed is None
        unrevealed = []
        one_round(w, sender_checks(w, unrevealed), blind)
        assert [a[0] for a in unrevealed] == [a[0] for a in accused], (scorer, accused, unrevealed)
        for _, lie, _ in unrevealed:
            found, guilty = judge(w, lie, w.members[scorer])
            assert guilty == liar, found
            filed += 1
    assert filed >= 1


def test_a_fit_the_coordinator_cannot_compute_in_time_bans_nobody(world, afforded, monkeypatch):
    """Was MEDIUM. ``judge_contribution`` turned any SwarmError of ``check_fits_poorly`` into "the evidence
    does not hold", banning the accuser, and ``ReplayTooLong`` (the deadline) is one: a coordinator whose
    CPU could not compute one micro-batch's gradient in its budget banned the honest reducer that proved a
    stale liar. Now a fit it cannot compute bans nobody, as a replay it cannot run."""
    w = world
    sent = _sending(w, _stale(w))
    accused = []
    for scorer, micro in ((p, m) for p in range(MEMBERS) if p != LIAR for m in range(2)):
        # A reducer whose draw scores the liar against a micro-batch its stale input fits poorly.
        force_fit_draws(monkeypatch, {(scorer, LIAR): micro})
        one_round(w, sender_checks(w, accused), reducer_after_round(w, scorer, sent))
        if accused:
            break
    assert [a[0] for a in accused] == [w.members[LIAR]]
    lie = accused[0][1]

    monkeypatch.setattr(contributions, "REPLAY_TIMEOUT_S", 1e-6)
    found, guilty = judge(w, lie, w.members[scorer])
    assert guilty is None and "could not score the fit" in found, (found, guilty)


def test_a_fit_put_by_another_reducer_or_with_a_forged_chunk_is_refused_before_any_download(
    world, monkeypatch
):
    """Was LOW. ``check_fit_scorer`` let any reducer of the part through to the state download once it
    stripped the reveals, and the scored chunk's signatures were checked only after it: a member put any
    honest groupmate's fit, never served the state and held the coordinator's one judging turn for the
    download's timeout, banned by nobody. Now the chunk is checked first and the scorer is the chunk's
    draw, reveals or none: such an accusation bans its accuser at once, and nothing is downloaded."""
    w = world
    victim = next(i for i in range(MEMBERS) if i != LIAR)
    scorer, accuser = (i for i in range(MEMBERS) if i != victim and i != LIAR)
    force_fit_draws(monkeypatch, {(scorer, victim): 0})  # the draw names another reducer than the accuser
    runner = reducer_after_round(w, accuser, w.honest)
    chunk = own_part_evidence(runner, 0)
    forged = dataclasses.replace(chunk, output_signature=bytes(64))
    for evidence in (
        _evidence(w, runner, victim),
        _evidence(w, runner, victim, reveals=False),
        _evidence(w, runner, victim, reveals=False, scored=forged),
    ):
        withheld = _Withheld()
        found, guilty = _judge(w, evidence, accuser, withheld, timeout_s=30.0)
        assert guilty == w.members[accuser] and not withheld.asked, found


class _Withheld:
    """An accuser that never serves the state; records whether it was asked for it."""

    def __init__(self):
        self.asked = False

    async def fetch(self, holder, step, state_hash):
        self.asked = True
        await asyncio.sleep(3600)


def _judge(w, lie, accuser: int, states, *, timeout_s: float = 30.0) -> tuple[str, str | None]:
    async def scenario():
        return await judge_contribution(
            w.run, lambda: run_layouts(w.run), lie.to_bytes(), lie.accused, w.members[accuser],
            states=states, judging=asyncio.Lock(), timeout_s=timeout_s,
        )  # fmt: skip

    return asyncio.run(scenario())
