"""Lies that only the sender-check draw reaches, and how soon it reaches them at the run's default rates.

The draw's rate (``training.verify_probability`` and ``sender_check_probability``) decides how soon a
provable lie is banned only where nothing else points at the liar: the reducers' scores
(``swarm.averaging.scores.flagged``, every round) and fits (``fits_poorly``) do not depend on it. In
``every_step`` every honest input is a public fact (``swarm.training.replay``), so a liar knows every input of
every chunk before it signs and can check its own against every score and fit that any reducer could
compute, for every micro-batch the fit may draw. These tests build two such lies (``omniscient_alie`` and a
liar that stays inside every margin), show that nothing but the draw points at them and that a replay
convicts them, and measure the draw's rate against the figures docs/robustness.md gives. Same world as
``tests/test_fit_scores.py`` (``tests/ownpart.py``: a group of four, each member the reducer of its own part,
one chunk a part, validators that practically never draw; the round at ``STEP`` after four honest training
steps).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from ownpart import (
    LIAR,
    MEMBERS,
    STEP,
    WEIGHT,
    chunk_of,
    force_fit_draws,
    make_world,
    one_round,
    record_replays,
    reducer_after_round,
    sender_checks,
    trained,
)

from coordinator.accusations import run_layouts
from lab.localswarm import tiny_run
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.evidence import chunk_bounds, layout_chunk_values, split_bounds
from swarm.averaging.scores import fits_poorly
from swarm.averaging.validation import fair_weights
from swarm.averaging.verification import assignments, own_part_evidence
from swarm.byzantine.attacks import alie_z, make_attack
from swarm.config import RunConfig, TrainingConfig
from swarm.training import sendercheck
from swarm.training.contribution import WrongContributionEvidence, flagged_senders, micro_gradient
from swarm.training.picks import drawn_sender

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("draw-only-lies", verify_probability=1e-9, sender_check_probability=1e-9)
DEPTH = 4  # honest training steps before the round
DEFAULTS = TrainingConfig()
HIGHER = 0.25  # the sim's sender_check_probability (and the run's default before 0.1)


def _world(now: dict):
    w = make_world(RUN, now)
    # The gradient of each of the liar's two micro-batches: every reference its fit can be scored against.
    w.micro = [micro_gradient(RUN, w.tensors, w.members[LIAR], STEP, m, device="cpu") for m in range(2)]
    return w


@pytest.fixture(scope="module")
def world():
    _, now, _ = trained(RUN, [DEPTH])[DEPTH]
    return _world(now)


def _draw_reaches(verify: float, check: float, *, members: int = 4, colluders: tuple[int, ...] = (LIAR,),
                  rounds: int = 8000) -> float:  # fmt: skip
    """The share of ``rounds`` (each with a fresh draw) in which an honest validator's draw replays ``LIAR``
    in a chunk of the part it checks: the real ``assignments`` and ``drawn_sender``, every member a reducer."""
    hit = 0
    for r in range(rounds):
        seed = hashlib.sha256(b"draw-round-%d" % r).digest()
        found = False
        for validator in (v for v in range(members) if v not in colluders):
            for a in assignments(seed, members, validator, verify, [1] * members):
                others = [i for i in range(members) if i != validator]
                found = found or drawn_sender(seed, a.part, a.chunk, others, check) == LIAR
        hit += found
    return hit / rounds


def _sending(w, liar_sends: torch.Tensor) -> list[torch.Tensor]:
    sent = list(w.honest)
    sent[LIAR] = liar_sends
    return sent


def _part_view(w, sent: list[torch.Tensor], part: int) -> tuple[bool, int]:
    """(whether the liar stands out in ``part``'s chunk, as its reducer and any validator score it; in how
    many of the liar's micro-batches its fit there is poor, 0 for its own part, whose fits nobody scores)."""
    chunk = own_part_evidence(reducer_after_round(w, part, sent), 0)
    decoded = chunk.checked_inputs(w.codec, w.numel)
    scorer = part if part != LIAR else (part + 1) % MEMBERS
    claims, odd = flagged_senders(w.run, chunk.inputs, decoded, validator=scorer)
    if part == LIAR:
        return LIAR in claims + odd, 0
    lo, hi = chunk_of(w, part)
    return LIAR in claims + odd, sum(fits_poorly(decoded, LIAR, g[lo:hi]) for g in w.micro)


def _only_the_draw_reaches(w, sent: list[torch.Tensor], monkeypatch) -> list[str]:
    """Assert that nothing but the draw points at the liar sending ``sent[LIAR]``: no reducer or validator
    flags it in any part, no (reducer, micro-batch) fit is poor, and the real ``SenderChecks`` of each reducer,
    made to score the liar's fit against each of its micro-batches in turn, replays and files nothing. Return
    what ``WrongContributionEvidence.judge`` (a drawn validator's replay, and the coordinator's) finds in
    each part: the lie is provable wherever it is drawn."""
    for part in range(MEMBERS):
        assert _part_view(w, sent, part) == (False, 0), part
    monkeypatch.setattr(sendercheck, "FIT_SHARE", 100.0)  # every fit the draw names, every round
    replayed = record_replays(monkeypatch)
    for part in (p for p in range(MEMBERS) if p != LIAR):
        for micro in range(2):
            force_fit_draws(monkeypatch, {(part, LIAR): micro})
            accused = []
            checks = sender_checks(w, accused)
            one_round(w, checks, reducer_after_round(w, part, sent))
            assert checks.fits == 1 and accused == [] and replayed == [], (part, micro, accused, replayed)
    verdicts = []
    for part in range(MEMBERS):
        evidence = own_part_evidence(reducer_after_round(w, part, sent), 0)
        item = next(x for x in evidence.inputs if x.sender_index == LIAR)
        lie = WrongContributionEvidence(
            prefix=evidence.prefix, group_id=evidence.group_id, members=evidence.members,
            commitments=evidence.commitments, part=part, chunk=0, reducers=evidence.reducers, item=item,
            entry=w.entries[LIAR],
        )  # fmt: skip
        verdicts.append(lie.judge(w.run, w.tensors, w.codec, vector_numel=w.numel, device="cpu"))
    return verdicts


def _descent_kept(w, sent: list[torch.Tensor], part: int) -> float:
    """The run's rule's aggregate of ``part``'s chunk projected on the honest inputs' mean, over the honest
    aggregate's: 1.0 for an honest round, below for a round that moved against descent."""
    rule = get_aggregator(w.run.training.aggregator, w.run.training.aggregator_options)
    lo, hi = chunk_of(w, part)
    weights = fair_weights([WEIGHT] * MEMBERS)
    honest = rule(torch.stack([h[lo:hi] for h in w.honest]), weights, seed=1)
    attacked = rule(torch.stack([s[lo:hi] for s in sent]), weights, seed=1)
    mean = torch.stack([h[lo:hi] for h in w.honest]).mean(0)
    return float(attacked @ mean) / float(honest @ mean)


def test_a_lie_only_the_draw_reaches_waits_about_40_rounds_for_its_ban_at_the_run_defaults():
    """A lie that stands out nowhere and fits everywhere (the next two tests build two) is reached by the
    draw alone: an honest validator checks each part with ``verify_probability`` v and names a sender among
    the n - 1 others with ``sender_check_probability`` s. Summed over the parts, a lone liar is named with
    probability v s a round, whatever n (its own part: v s / (n - 1); each of the n - 1 others:
    v s (n - 2) / (n - 1)^2, since the liar never checks itself); with f colluders, v s (n - f) / (n - 1).
    The real draw at the run's defaults (0.25, 0.1): 0.025 a round, a ban in 40 rounds in expectation (16
    at 0.25, 0.25), 8% of such liars still unbanned after 100 rounds (0.15% at 0.25); 53 rounds for 2
    colluders of 5. A lie in one chunk of each part of the demo model (19 chunks a part in a group of 4) is
    drawn in 1 round of about 760. docs/robustness.md gives these figures."""
    v, s = DEFAULTS.verify_probability, DEFAULTS.sender_check_probability
    assert (v, s) == (0.25, 0.1)
    now, before = _draw_reaches(v, s), _draw_reaches(v, HIGHER)
    assert abs(now - v * s) < 0.006 and abs(before - v * HIGHER) < 0.01, (now, before)
    assert 1 / now > 33 and before / now > 2.0, (1 / now, 1 / before)
    assert (1 - now) ** 100 > 0.05 > 0.01 > (1 - before) ** 100
    colluding = _draw_reaches(v, s, members=5, colluders=(LIAR, 2))
    assert 1 / colluding > 45, 1 / colluding
    demo = run_layouts(RunConfig.demo())["demo"]
    bounds = split_bounds(demo, 4)
    chunks = len(chunk_bounds(bounds[1] - bounds[0], layout_chunk_values(4, 2))) - 1
    assert chunks >= 16 and chunks / now > 600, (chunks, chunks / now)


def test_omniscient_alie_stands_out_nowhere_fits_everywhere_and_only_the_draw_convicts_it(world, monkeypatch):
    """``omniscient_alie`` (swarm/byzantine/attacks.py) sends the honest peers' exact mean (plus z standard
    deviations; z = 0 in a group of 4 with 1 attacker, about 0.5 for 4 of 16): it points where the chunk's
    median does, its norm is the honest ones', and it holds 1/n of the liar's own batches, so its fit is
    above the others' median against each of its micro-batches. No reducer and no validator flags it, no
    fit is poor, and ``SenderChecks`` replay nothing; yet it is a provable lie in every part (the replay is
    far beyond the tolerance), so the draw bans it, in 40 rounds in expectation at the run's defaults."""
    w = world
    peers = torch.stack(w.honest)
    for z in (alie_z(4, 1), alie_z(16, 4)):
        attack = make_attack("omniscient_alie", {"z": z}, group_size=4, attackers=1)
        sent = _sending(w, attack.contribution(w.honest[LIAR], STEP, peers=peers))
        verdicts = _only_the_draw_reaches(w, sent, monkeypatch)
        assert all(v is not None and "beyond the tolerance" in v for v in verdicts), (z, verdicts)


def test_colluders_who_recompute_every_honest_input_cut_descent_within_every_margin(world, monkeypatch):
    """Every honest input of a round is a public fact, so a liar knows, before it signs, every score and
    every fit any reducer could compute of its input (for each micro-batch ``fit_draw`` may pick). It sends
    its honest gradient minus beta times the honest mean, in each part the largest beta (found by bisection
    against ``flagged_senders`` and ``fits_poorly``, with a 5% margin) that no score flags and no fit finds
    poor: beta 0.6-0.9 here. No reducer or validator flags it, no fit is poor, ``SenderChecks`` replay
    nothing, and the run's rule (CenteredClip) keeps 7-18% less descent in each part every round
    (``omniscient_ipm``, flagged in every part, is the control); only the draw convicts it."""
    w = world
    x = w.honest[LIAR].clone()
    betas = []
    for part in range(MEMBERS):
        lo, hi = chunk_of(w, part)
        own = w.honest[LIAR][lo:hi]
        down = torch.stack([h[lo:hi] for h in w.honest]).mean(0)
        direction = -down / down.norm() * own.norm()
        good, bad = 0.0, 4.0
        for _ in range(18):
            beta = (good + bad) / 2
            trial = x.clone()
            trial[lo:hi] = own + beta * direction
            if _part_view(w, _sending(w, trial), part) == (False, 0):
                good = beta
            else:
                bad = beta
        betas.append(0.95 * good)
        x[lo:hi] = own + betas[-1] * direction
    sent = _sending(w, x)
    assert sum(b >= 0.3 for b in betas) >= 3, betas
    verdicts = _only_the_draw_reaches(w, sent, monkeypatch)
    lied = [p for p in range(MEMBERS) if betas[p] >= 0.3]
    assert all(verdicts[p] is not None for p in lied), verdicts
    kept = [_descent_kept(w, sent, p) for p in lied]
    assert sum(k < 0.95 for k in kept) >= 3 and min(kept) < 0.9, kept
    ipm = make_attack("omniscient_ipm", group_size=4, attackers=1)
    flagged_ipm = _sending(w, ipm.contribution(w.honest[LIAR], STEP, peers=torch.stack(w.honest)))
    assert sum(_part_view(w, flagged_ipm, p)[0] for p in range(MEMBERS)) >= 3  # the control: it stands out


@pytest.fixture(scope="module")
def shallow_worlds():
    """The round after 1 and after 2 honest training steps (at 4, one part's fit catches the next lie)."""
    return [_world(now) for _, (_, now, _) in sorted(trained(RUN, [1, 2]).items())]


def test_a_liar_that_scales_its_own_gradient_down_stands_out_nowhere_and_only_the_draw_convicts_it(
    shallow_worlds, monkeypatch
):
    """0.6 times its own honest gradient, no other peer's batch read: its cosine with every chunk's median is
    an honest sender's, its norm is below the others' (no lower bound is scored: honest norms vary), and
    what it adds to the others' median still holds its own batches, so no fit is poor. A replay finds it
    0.4 away (relative L2), 40 times the tolerance. It pulls the aggregate less, never the wrong way, and
    is credited samples whose weight it did not put in: the draw's 40 rounds at the run defaults."""
    for w in shallow_worlds:
        sent = _sending(w, 0.6 * w.honest[LIAR])
        verdicts = _only_the_draw_reaches(w, sent, monkeypatch)
        assert all(v is not None and "beyond the tolerance" in v for v in verdicts), verdicts
