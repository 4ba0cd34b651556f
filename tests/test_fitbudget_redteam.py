"""What an attacker that reads the code could get from the fit budget (``swarm.training.fitbudget.FitBudget``), and what it
gets now: a reducer's fits (``SenderChecks._poor_fit``) and the replays they point to that convict nobody
draw on ``FIT_SHARE`` of its own micro-batches, one account per sender. Each test says what the attacker
does, what it gained when the budget was one account for all senders, and what it gets now. In process, with the real model, dataset, codec, signatures and
``SenderChecks`` (the world of ``tests/ownpart.py``: a group of four, each member the reducer of its own part,
one chunk a part, validators that practically never draw, so only the reducers' own-part checks and fits
replay anyone). The round is at ``STEP``, two steps of training on from the run's model; ``old`` is the
state one step before it, at which a stale sender computed what it sends again.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from ownpart import (
    LIAR,
    MEMBERS,
    STEP,
    chunk_of,
    force_fit_draws,
    honest_but,
    make_world,
    one_round,
    pick_every_affordable,
    record_replays,
    reducer_holding,
    sender_checks,
    signed_input,
    trained,
    weighted_round,
)

import swarm.training.sendercheck as sendercheck
from lab.localswarm import tiny_run
from swarm.training.contribution import WrongContributionEvidence, recompute

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("fitbudget-redteam", verify_probability=1e-9, sender_check_probability=1e-9)
#: The reducer whose budget is drained, and the sender that drains it: at ``STEP`` the honest contribution
#: of ``HEAVY`` over ``HEAVY_MICRO`` micro-batches (the most the tiny run's target batch of 8 allows is 8)
#: fits its micro-batch ``POOR_MICRO`` worse than the other inputs to part ``SCORER`` do (by 0.07): a poor
#: fit that its replay clears.
SCORER, HEAVY, HEAVY_MICRO, POOR_MICRO = 0, 2, 4, 2
#: The micro-batch of the stale liar's that its stale input to part ``SCORER`` fits poorly.
STALE_MICRO = 1


@pytest.fixture(scope="module")
def world():
    old, now, _ = trained(RUN, [2])[2]
    w = make_world(RUN, now)
    w.old = old
    w.heavy = recompute(RUN, w.tensors, w.members[HEAVY], STEP, HEAVY_MICRO, device="cpu")
    w.stale = recompute(RUN, old, w.members[LIAR], STEP - 1, 2, device="cpu")
    return w


@pytest.fixture
def always_picks(monkeypatch):
    pick_every_affordable(monkeypatch)


def _heavy_round(w) -> tuple[list, list[float]]:
    return honest_but(w, HEAVY, w.heavy, HEAVY_MICRO * RUN.training.micro_batch_size)


def _stale_round(w) -> tuple[list, list[float]]:
    return honest_but(w, LIAR, w.stale)


def test_one_honest_heavy_sender_whose_fit_is_poor_spends_its_own_fits_and_not_the_liars(
    world, always_picks, monkeypatch
):
    """A colluder computes the most micro-batches a step holds, honestly, and sends them: the more
    micro-batches an input holds, the more often its honest fit to one of them is poor, and it can work out
    beforehand, from public seeds and the honest groupmates' public gradients, at which reducers and
    micro-batches it is. The scorer that draws such a pair replays it, clears it, and pays the whole replay.
    With one budget for all senders, one replay of 4 micro-batches put a member that computes 2 a round 32
    rounds in debt, and a stale liar its chunk's draw named in every one of them went unscored until the
    33rd. Now the replay comes out of the colluder's own account: the liar is scored, and filed, in the
    first round its draw names it, as by a reducer with a fresh budget."""
    w = world
    liar = w.members[LIAR]

    # The drain: the colluder's honest heavy input, drawn at a micro-batch it fits poorly.
    replayed = record_replays(monkeypatch)
    force_fit_draws(monkeypatch, {(SCORER, HEAVY): POOR_MICRO})
    accused = []
    checks = sender_checks(w, accused)
    one_round(w, checks, *weighted_round(w, SCORER, *_heavy_round(w)))
    earned = sendercheck.FIT_SHARE * 2  # the reducer computed 2 micro-batches
    assert accused == [] and replayed == [w.members[HEAVY]] and checks.fits == 1
    assert w.members[HEAVY] in checks.cleared  # the replay found it honest
    # Its fit and its replay (1 + 4) are charged to its own account.
    assert checks.fit_budget.accounts[w.members[HEAVY]] == pytest.approx(earned - 1 - HEAVY_MICRO)

    # The next round the draw names the stale liar for this reducer: it is scored and filed.
    force_fit_draws(monkeypatch, {(SCORER, LIAR): STALE_MICRO})
    one_round(w, checks, *weighted_round(w, SCORER, *_stale_round(w)))
    assert [a[0] for a in accused] == [liar] and checks.fits == 2, (accused, checks.fits)


def test_two_rounds_checked_at_once_each_pay_for_their_own_fits(world, monkeypatch):
    """A round's checks run as their own task (``Averager._verify_later``; ``MAX_PENDING`` copies,
    ``MAX_REPLAYS_DUE`` replays), so two rounds' fits may be scored at once. The budget was charged what
    ``self.fits`` grew by while a round's scoring thread ran, so each round paid for the other's fits too,
    and the member scored fewer fits than ``FIT_SHARE`` pays for. Now each round charges the fits its own
    thread scored: two rounds, one fit each, two micro-batches."""
    w = world
    force_fit_draws(monkeypatch, {(SCORER, LIAR): 0})
    monkeypatch.setattr(sendercheck, "FIT_SHARE", 100.0)  # each round affords its one fit
    meet = threading.Barrier(2, timeout=60)
    real = WrongContributionEvidence.fit_is_poor

    def overlapping(self, *args, **kwargs):  # both rounds' scoring threads are at their fit at once
        meet.wait()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WrongContributionEvidence, "fit_is_poor", overlapping)
    checks = sender_checks(w, [])
    sent = list(w.honest)
    lo, hi = chunk_of(w, SCORER)
    inputs = [signed_input(w, i, SCORER, w.codec.encode_contribution(sent[i][lo:hi])) for i in range(MEMBERS)]
    runner = reducer_holding(w, SCORER, inputs, [v[lo:hi] for v in sent])

    async def scenario():
        await checks.keep(runner, w.entries)
        first = asyncio.create_task(checks.check(runner, []))
        await asyncio.sleep(0)  # it takes its round's state copy
        await checks.keep(runner, w.entries)
        second = asyncio.create_task(checks.check(runner, []))
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    earned = 2 * 100.0 * 2  # two rounds of 2 micro-batches each, under the cap
    spent = earned - checks.fit_budget.credit
    assert checks.fits == 2 and checks.outliers == 0  # two fits, no replay
    assert spent == pytest.approx(2), (spent, checks.fits)


def test_a_replay_a_poor_fit_points_to_that_runs_out_of_time_is_paid_for_and_not_run_again(
    world, always_picks, monkeypatch
):
    """A replay that raises (its sender's signed claim takes longer than the reducer's ``JUDGING_BUDGET_S``
    to replay, as a long diloco window or a whole step's micro-batches may on a slower device; a replay that
    is not finite) ran, up to that budget. It used to count as a replay that never ran: the budget was
    charged the fit alone and the sender was not cleared, so every later fit the draw named for it pointed
    to the same replay again, a full judging budget per fit while ``FIT_SHARE`` counted one micro-batch.
    Now it is paid out of the sender's account like a replay that cleared it, which puts that account in
    debt: three rounds named for its fit, one replay. Here a replay that runs past its deadline at once
    stands for one that ran to it."""
    w = world
    monkeypatch.setattr(sendercheck, "JUDGING_BUDGET_S", -1.0)  # the deadline has passed when it starts
    force_fit_draws(monkeypatch, {(SCORER, HEAVY): POOR_MICRO})
    replayed = record_replays(monkeypatch)
    accused = []
    checks = sender_checks(w, accused)
    for _ in range(3):
        one_round(w, checks, *weighted_round(w, SCORER, *_heavy_round(w)))
    assert replayed == [w.members[HEAVY]] and accused == [] and checks.fits == 1
    earned = sendercheck.FIT_SHARE * 2 * 3
    assert checks.fit_budget.accounts[w.members[HEAVY]] == pytest.approx(earned - 1 - HEAVY_MICRO)
