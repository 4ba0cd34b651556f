"""False weight claims beside other senders, at a validator: how many times it scores a chunk, and where a
claim stands in its filing queue (``SenderChecks.check``), in the world of ``tests/ownpart.py`` (a group of
four, each member the reducer of its own part's one chunk), with member 0 as the validator of the other
three parts.

A claim is judged without a replay, so it takes no stand-out replay from a liar beside it. A first version
of that rule scored a chunk holding a claim three times (the scoring, the claim's pre-check, the scoring
again without claims) and went on scoring every chunk, filing the same decoy once per chunk when the
coordinator answered in between; and it filed every claim as it was found, ahead of the replays, so two
decoys' claims could fill the filing queue and leave a liar the round's draw had caught only avoided. Now
each chunk is scored once for both (``_outlier``), and at most one claim a round is filed, after the
replays.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from ownpart import MEMBERS, STEP, WEIGHT, chunk_of, make_world, reducer_holding, round_draw, signed_input

from coordinator.accusations import run_layouts
from lab.localswarm import tiny_run
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    chunk_bounds,
    layout_chunk_values,
    split_bounds,
)
from swarm.averaging.verification import Assignment, assignments, own_part_evidence
from swarm.training import filings, sendercheck
from swarm.training.picks import drawn_sender
from swarm.training.sendercheck import MAX_SCORED_CHUNKS, SenderChecks

pytestmark = pytest.mark.timeout(300)

VALIDATOR = 0
FALSE_WEIGHT = 1e6
QUIET = tiny_run("claim-slot-review", verify_probability=1e-9, sender_check_probability=1e-9)


def _drawn_run():
    """A run whose round (the world's fixed members and nonces) draws member 0 to validate chunk 0 of part 3,
    so that the sender the draw names there is filed by the draw."""
    numel = None
    for k in range(200):
        run = tiny_run(f"claim-slot-review-drawn-{k}", verify_probability=1.0, sender_check_probability=1.0)
        numel = numel or run_layouts(run)[run.run_id.replace(".", "_")]
        values = layout_chunk_values(MEMBERS, get_codec(run.training.compression).bytes_per_value)
        bounds = split_bounds(numel, MEMBERS)
        chunks = [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(MEMBERS)]
        seed = round_draw(run)[-1]
        if Assignment(3, 0) in assignments(seed, MEMBERS, VALIDATOR, 1.0, chunks):
            return run
    raise AssertionError("no run id found")


def _inputs(w, part: int, sent: dict[int, torch.Tensor], claims: set[int]) -> list[SignedInput]:
    """Every member's signed input to ``part`` of ``sent``; those of ``claims`` signed for a million samples."""
    lo, hi = chunk_of(w, part)
    return [
        signed_input(
            w, i, part, w.codec.encode_contribution(v[lo:hi]), weight=FALSE_WEIGHT if i in claims else WEIGHT
        )
        for i, v in sent.items()
    ]


def _reducer(w, part, sent, claims, heard):
    lo, hi = chunk_of(w, part)
    return reducer_holding(
        w, part, _inputs(w, part, sent, claims), [v[lo:hi] for v in sent.values()], heard=heard
    )


def _round(w, checks: SenderChecks, runner, outcomes) -> None:
    async def scenario():
        await checks.keep(runner, w.entries)
        assert runner.group_id in checks.pending
        await checks.check(runner, outcomes)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def quiet():
    return make_world(QUIET)


@pytest.fixture(scope="module")
def drawn():
    return make_world(_drawn_run())


def test_a_decoy_claiming_in_every_part_is_scored_once_a_chunk_and_filed_once(quiet, monkeypatch):
    """The decoy (member 3) signs a million samples into every part and withholds its reveal, so validator 0
    checks every other part and holds no shared draw; nobody stands out. Validator 0 decodes each of the
    chunks it checked, and its own, once, and the claim once more to check its evidence before filing (5,
    where the first version of the rule decoded 12), and files the decoy once, though the coordinator
    answers each filing at once."""
    w = quiet
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))  # no fit is scored
    decoded = Counter()
    real = BadAggregateEvidence.checked_inputs

    def counting(self, *args, **kwargs):
        decoded[self.part] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(BadAggregateEvidence, "checked_inputs", counting)
    decoy = 3
    heard = set(range(MEMBERS)) - {decoy}
    sent = {i: w.honest[i] for i in range(MEMBERS)}
    outcomes = [
        SimpleNamespace(evidence=own_part_evidence(_reducer(w, part, sent, {decoy}, heard), 0))
        for part in range(1, MEMBERS)
    ]
    runner = _reducer(w, VALIDATOR, sent, {decoy}, heard)
    filed = []

    async def accuse(peer, lie, verdict):  # answered at once (the decoy already banned by another member)
        filed.append(peer)

    checks = SenderChecks(w.run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)
    _round(w, checks, runner, outcomes)
    assert len(outcomes) + 1 <= MAX_SCORED_CHUNKS + 1
    assert sum(decoded.values()) == len(outcomes) + 1 + 1, decoded
    assert filed == [w.members[decoy]], filed


def test_claims_in_earlier_chunks_do_not_take_the_filing_place_of_a_drawn_liar(drawn, monkeypatch, caplog):
    """Every reveal is in; the round's draw names a sender in each chunk validator 0 checks. The sender drawn
    in part 3 sent part 3 its gradient reversed; the two other members each signed a false weight into one of
    parts 1 and 2. With one accusation fewer able to wait (as when an earlier one still waits its turn), the
    drawn liar, proven by the round's draw, is filed first and one claim after it; the other claim waits
    for another round (or another member)."""
    w = drawn
    caplog.set_level(logging.INFO, logger=sendercheck.__name__)
    monkeypatch.setattr(filings, "MAX_FILINGS", filings.MAX_FILINGS - 1)
    # the round's draw made member 0 a validator of part 3 (``_drawn_run``); the chunks of parts 1 and 2 it
    # scores are evidence that needs no draw
    candidates = [i for i in range(MEMBERS) if i != VALIDATOR]
    liar = drawn_sender(w.seed, 3, 0, candidates, 1.0)
    decoys = [i for i in candidates if i != liar]
    heard = set(range(MEMBERS))
    honest = {i: w.honest[i] for i in range(MEMBERS)}
    lying = {**honest, liar: -w.honest[liar]}
    outcomes = [
        SimpleNamespace(evidence=own_part_evidence(_reducer(w, 1, honest, {decoys[0]}, heard), 0)),
        SimpleNamespace(evidence=own_part_evidence(_reducer(w, 2, honest, {decoys[1]}, heard), 0)),
        SimpleNamespace(evidence=own_part_evidence(_reducer(w, 3, lying, set(), heard), 0)),
    ]
    runner = _reducer(w, VALIDATOR, honest, set(), heard)
    suspected = []

    async def scenario():
        never = asyncio.Event()

        async def accuse(peer, lie, verdict):  # the coordinator still judges
            await never.wait()

        checks = SenderChecks(
            w.run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse,
            suspect=lambda peer, reason: suspected.append(peer),
        )  # fmt: skip
        await checks.keep(runner, w.entries)
        assert runner.group_id in checks.pending
        await checks.check(runner, outcomes)
        queued = [f.accused for f in checks.accusations.waiting]
        checks.close()
        return queued

    queued = asyncio.run(scenario())
    assert w.members[liar] in suspected, suspected  # caught by the draw's replay
    assert queued[0] == w.members[liar] and len(queued) == 2 and queued[1] in [w.members[d] for d in decoys]
