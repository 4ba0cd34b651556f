"""What an attacker that reads the code gets from the fit budget's accounts (``swarm.training.fitbudget.FitBudget``): a
reducer's fits (``SenderChecks._poor_fit``) and the replays they point to that convict nobody are paid out of
one account per sender, a sender whose account is in debt is not scored (``afford`` 0) until the rounds that
name it for that reducer's fit have paid the debt back, for at most ``FIT_DEBT_ROUNDS`` of them (the rest is
then forgiven), and a new sender's account owes nothing. A liar buys at most that many rounds of lies no fit of that reducer
looks at with one honest round; a fresh identity costs a member one replay of its own honest step. In process, with the real model, dataset,
codec, signatures and ``SenderChecks`` (the world of ``tests/ownpart.py``: a group of four, each member the
reducer of its own part, one chunk a part, validators that practically never draw, so only the reducers'
own-part checks and fits replay anyone). The round is at ``STEP``, two steps of training on from the run's
model; ``old`` is the state one step before it, at which a stale sender computed what it sends again.
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ownpart import (
    MEMBERS,
    STEP,
    WEIGHT,
    chunk_of,
    force_fit_draws,
    honest_but,
    make_world,
    nonce,
    one_round,
    pick_every_affordable,
    record_replays,
    sender_checks,
    trained,
    weighted_round,
)

import swarm.training.sendercheck as sendercheck
from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.evidence import draw_seed, round_digest
from swarm.averaging.scores import fit
from swarm.training import fitbudget
from swarm.training.contribution import micro_gradient, recompute

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("fitbudget-redteam", verify_probability=1e-9, sender_check_probability=1e-9)
#: The reducer whose fits the liar escapes, and the liar: at ``STEP`` the liar's honest contribution over
#: ``HEAVY_MICRO`` micro-batches fits its micro-batch ``POOR_MICRO`` worse than the other inputs to part
#: ``SCORER`` do (by 0.07; an honest input's fit is poor more often the more micro-batches it holds), a poor
#: fit that its replay clears; its stale contribution over two micro-batches (computed at ``old``) fits its
#: micro-batch ``STALE_MICRO`` worse than the others do, and does not stand out.
SCORER, SELF, HEAVY_MICRO, POOR_MICRO, STALE_MICRO = 0, 2, 4, 2, 1


@pytest.fixture(scope="module")
def world():
    old, now, _ = trained(RUN, [2])[2]
    w = make_world(RUN, now)
    w.heavy = recompute(RUN, w.tensors, w.members[SELF], STEP, HEAVY_MICRO, device="cpu")
    w.stale = recompute(RUN, old, w.members[SELF], STEP - 1, 2, device="cpu")
    return w


@pytest.fixture
def always_picks(monkeypatch):
    pick_every_affordable(monkeypatch)


def _heavy_round(w) -> tuple[list, list[float]]:
    return honest_but(w, SELF, w.heavy, HEAVY_MICRO * RUN.training.micro_batch_size)


def _stale_round(w) -> tuple[list, list[float]]:
    return honest_but(w, SELF, w.stale)


@pytest.mark.parametrize("beside", [(), (3,)], ids=["named-alone", "named-beside-another"])
def test_a_liar_whose_honest_heavy_fit_was_replayed_once_lies_unscored_by_that_reducer_for_at_most_the_debt_floor(
    world, always_picks, monkeypatch, beside
):
    """The liar first computes, honestly, the most micro-batches it likes and sends them: the more an input
    holds, the more often its honest fit to one of them is poor (17% of chunks at 8 micro-batches on the tiny
    model), and with the chunk's other senders but the reducer colluding it can compute the chunk's draw
    (``fit_draw``) and the fits, and know when one is. The reducer that scores such a poor fit replays it,
    clears it, and charges the whole replay to the liar's own account: 1 + ``HEAVY_MICRO`` micro-batches,
    against the 0.15 a round it earns (``FIT_SHARE`` of the reducer's 2 micro-batches, split among the
    senders the round names for its fit). From then on the liar sends stale inputs that do not stand out:
    an account in debt affords no fit, so the reducer scores none of them until the rounds whose draw names
    the liar have paid the debt back. Named alone: 4.85 / 0.15 = 33 such rounds after the ``CLEARED_ROUNDS``
    for which the replay cleared it, 40 rounds of lies none of this reducer's fits look at, where the
    clearance alone spares 8 and even then scores it in ``CLEARED_REPLAY_SHARE`` of them (the debt knows no
    such share). Named beside one other sender (a colluder, or anyone): the repayment halves, 72 rounds.
    With one account for all, the same debt was repaid at the whole 0.15 by every round in which the
    reducer named anyone: 40 rounds alone, 32 beside another (though then it spared that other too). At 8
    micro-batches the debt is 9 micro-batches; only rounds that name the liar at that reducer repay it
    (about one in three in a group of 4, fewer where the two rarely meet), so the reducer stays blind to it
    that many more rounds. The same heavy round, sent to every part, buys this at each reducer that scores
    one of its poor fits; only the stand-out scores and the validators' draw still reach its lies. A
    reducer whose account of the liar is not in debt scores and files the same stale input at once. Now
    the rest of a debt is forgiven ``FIT_DEBT_ROUNDS`` (16) rounds that name the sender after it began: the
    liar's lies go unscored by that reducer's fits for at most 16 rounds that name it, alone or beside
    another."""
    w = world
    liar = w.members[SELF]
    replayed = record_replays(monkeypatch)
    accused = []
    checks = sender_checks(w, accused)

    # The honest heavy round: the poor fit is scored, the replay clears the liar, and its account pays.
    force_fit_draws(monkeypatch, {(SCORER, SELF): POOR_MICRO})
    one_round(w, checks, *weighted_round(w, SCORER, *_heavy_round(w)))
    earn = sendercheck.FIT_SHARE * WEIGHT / RUN.training.micro_batch_size  # the reducer's 2 micro-batches
    assert replayed == [liar] and accused == [] and checks.fits == 1
    debt = -checks.fit_budget.accounts[liar]
    assert debt == pytest.approx(1 + HEAVY_MICRO - earn)

    # Then it lies every round, and every round the draw names it for this reducer's fit (and ``beside``,
    # honest senders whose fits are not poor, that share the round's earnings with it).
    force_fit_draws(monkeypatch, {(SCORER, SELF): STALE_MICRO, **{(SCORER, i): 0 for i in beside}})
    each = earn / (1 + len(beside))
    unscored = 0
    while liar not in {a[0] for a in accused} and unscored < 200:
        before = checks.fits
        one_round(w, checks, *weighted_round(w, SCORER, *_stale_round(w)))
        if liar not in {a[0] for a in accused}:
            unscored += 1
            assert replayed == [liar], replayed  # no fit of it, so no replay of it
        else:  # the first fit of it once the debt is paid back finds the lie, as one in any round would have
            assert checks.fits > before and replayed == [liar, liar]
    assert unscored <= fitbudget.FIT_DEBT_ROUNDS + 1, (unscored, debt, each)
    assert [a[0] for a in accused] == [liar], accused

    fresh = sender_checks(w, caught := [])
    one_round(w, fresh, *weighted_round(w, SCORER, *_stale_round(w)))
    assert fresh.fits == 1 and [a[0] for a in caught] == [liar], caught


def test_two_rounds_checked_at_once_score_a_sender_once_and_replay_it_once(world, always_picks, monkeypatch):
    """Checks of two rounds run at once when replays are slower than rounds (``MAX_PENDING``,
    ``MAX_REPLAYS_DUE``; a sender's heavy replay makes them so). Each round decided whom its fits score from
    the account as it stood before the other round had paid, so a sender whose account afforded one fit was
    scored in both, and each poor fit pointed to a replay of its whole claim: two replays ahead of its
    account, which doubled the rounds a liar that put its own account in debt on purpose (the test above)
    then went unscored. Now a fit is paid when its sender is picked, and a sender whose replay is due is not
    picked again: one fit, one replay."""
    w = world
    liar = w.members[SELF]
    force_fit_draws(monkeypatch, {(SCORER, SELF): POOR_MICRO})
    replayed = record_replays(monkeypatch)
    accused = []
    checks = sender_checks(w, accused)
    runner, entries = weighted_round(w, SCORER, *_heavy_round(w))

    async def scenario():
        await checks.keep(runner, entries)
        first = asyncio.create_task(checks.check(runner, []))
        await asyncio.sleep(0)  # it takes its round's state copy
        await checks.keep(runner, entries)
        second = asyncio.create_task(checks.check(runner, []))
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    assert checks.fits == 1 and replayed == [liar] and accused == []


#: A run whose sender tolerance is 0.05, as every bf16 run's is (``swarm.config.sender_tolerance``).
RUN_LOOSE = tiny_run(
    "fitbudget-redteam", verify_probability=1e-9, sender_check_probability=1e-9, sender_check_tolerance=0.05
)
#: Throwaway identities, each of which takes the place of member ``SELF`` for one round.
SYBILS = 3
#: How far, as a share of its norm, a sybil moves its honest chunk (within the tolerance, and the reducer's
#: ``ACCUSE_MARGIN`` beyond it).
NUDGE = 0.045


def _sybil(w, k: int):
    """The world with member ``SELF`` a fresh identity (its key, its group entry, the round's digest and
    draw), and that identity's input to part ``SCORER``: its honest contribution over all 8 micro-batches a
    step holds, its chunk of part ``SCORER`` nudged against the direction of its micro-batches' gradients
    (all computable from public seeds and the honest groupmates' public gradients), so that its fit to
    several of them is poor; with how far below the others' median its fit to each of them lies."""
    key = SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"fit-sybil-%d" % k).digest()))
    keys = list(w.keys)
    keys[SELF] = key
    members = tuple(x.peer_id for x in keys)
    digest = round_digest(w.prefix, w.group_id, members, w.commits)
    seed = draw_seed(digest, [nonce(i) for i in range(MEMBERS)])
    s = SimpleNamespace(**{**vars(w), "run": RUN_LOOSE, "keys": keys, "members": members, "digest": digest})
    s.seed = seed
    micro = RUN_LOOSE.training.target_batch_size // RUN_LOOSE.training.micro_batch_size
    honest = recompute(RUN_LOOSE, w.tensors, key.peer_id, STEP, micro, device="cpu")
    lo, hi = chunk_of(w, SCORER)
    grads = [
        micro_gradient(RUN_LOOSE, w.tensors, key.peer_id, STEP, m, device="cpu", span=(lo, hi))
        for m in range(micro)
    ]  # fmt: skip
    rows = [v[lo:hi] for v in w.honest]
    rows[SELF] = honest[lo:hi]
    common = torch.stack(rows).median(0).values.double()
    away = torch.zeros(hi - lo, dtype=torch.float64)
    for g in grads:
        g = g.double()
        away -= torch.sign(g - (g @ common) / (common @ common) * common)
    row = honest[lo:hi].double()
    sent = honest.clone()
    sent[lo:hi] = (row + NUDGE * row.norm() * away / away.norm()).float()
    decoded = [
        w.codec.decode_contribution(w.codec.encode_contribution(v[lo:hi]), hi - lo, sender="")
        for v in w.honest
    ]
    decoded[SELF] = w.codec.decode_contribution(w.codec.encode_contribution(sent[lo:hi]), hi - lo, sender="")
    below = []  # how far its fit to each micro-batch lies below the others' median (negative: poor)
    for g in grads:
        fits = fit(decoded, g)
        below.append(fits[SELF] - sorted(f for i, f in enumerate(fits) if i != SELF)[(MEMBERS - 2) // 2])
    return s, sent, micro, below


def test_each_fresh_identity_costs_a_member_one_replay_of_its_own_honest_step_and_then_owes_it(
    world, always_picks, monkeypatch
):
    """Each account starts with nothing owed, and one that affords a fit at all pays for the whole replay
    its poor fit points to only after the fact, out of its own later rounds: every sender gets one replay
    ahead at every member. A fresh identity is one key. The attacker sends, each round from a new one, an
    honest contribution over the most micro-batches a step holds, nudged within the run's tolerance (0.05,
    a bf16 run's) against its own micro-batches' gradients, which makes its fit poor at several of them
    (none of these identities' honest inputs fits poorly here; nudged, a quarter or more of their
    micro-batches do). The reducer whose draw names it scores it, replays 8 micro-batches, clears it, and
    books the debt on an account nobody repays: three rounds, three identities, 27 micro-batches of fits
    and replays against the 0.45 the reducer earned in them, where one account for all held the cost to
    ``FIT_SHARE`` and one replay. Without the always-picking randomness here a fresh account is scored
    with probability 0.15 (its first round's earnings), so a member named only for such identities spends
    0.15 x (1 + 8 x their poor share) a round, several times ``FIT_SHARE``. Left so, and bounded: each
    identity computes a whole step of honest work for the one replay it costs a member, after which its
    account there is in debt and a second such round of it is not scored."""
    w = world
    replayed = record_replays(monkeypatch)
    accused = []
    checks = sender_checks(SimpleNamespace(**{**vars(w), "run": RUN_LOOSE}), accused)
    sybils = []
    for k in range(SYBILS):
        s, sent_self, micro, below = _sybil(w, k)
        poor = [m for m, b in enumerate(below) if b < 0]
        assert len(poor) >= 2 and min(below) < -0.02, below  # poor at several of its micro-batches
        force_fit_draws(monkeypatch, {(SCORER, SELF): below.index(min(below))})
        weight = micro * RUN_LOOSE.training.micro_batch_size
        one_round(s, checks, *weighted_round(s, SCORER, *honest_but(w, SELF, sent_self, weight)))
        sybils.append(s.members[SELF])
    assert replayed == sybils and accused == [] and checks.fits == SYBILS
    assert all(checks.fit_budget.afford(sybil) == 0.0 for sybil in sybils)
