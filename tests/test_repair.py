"""A part whose reducer does not deliver it is re-reduced (or relayed) by its substitute in the same round.

Three real averagers, each with its own DHT process. Roles go by position in the group (every peer
lists the members in the same order): member 0 reduces part 0 and withholds it, member 1 is part 0's
substitute. Before, such a round was incomplete for every peer that the reducer failed.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.averager import Averager, AveragingServicer
from swarm.averaging.evidence import BadAggregateEvidence, parse_evidence, split_bounds
from swarm.averaging.reducer import PartReducer
from swarm.averaging.verification import Assignment, check_reducer
from swarm.byzantine.attacks import make_attack

pytestmark = pytest.mark.timeout(180)

NUMEL = 30_011


class WithholdingReducer(PartReducer):
    """Member 0, as reducer of part 0, takes the chunks of the round's ``withhold_from`` and returns nothing."""

    async def serve(self, first, stream, sender):
        if self.round.index == 0 and sender in self.round.withhold_from:
            await self.consume(sender, first, stream)
            return
        async for message in super().serve(first, stream, sender):
            yield message


class Roles(ButterflyAllReduce):
    """The run's all-reduce, but member 0 returns part 0 to none of ``withhold_from``, and member 1
    (part 0's substitute) shifts every aggregate it signs when ``liar`` is set."""

    withhold_from: frozenset[int] = frozenset({1, 2})
    liar = False
    reducer_type = WithholdingReducer

    def __init__(self, settings, **kwargs):
        super().__init__(settings, **kwargs)
        if self.index == 1 and self.liar:
            self.hooks = make_attack("bad_reducer", group_size=3, attackers=1)


class LyingSubstitute(Roles):
    liar = True


class WithholdsFromOne(Roles):
    withhold_from = frozenset({2})


class WithholdsFromTheSubstitute(Roles):
    withhold_from = frozenset({1})


def run_round(peers, runner_type, vectors, averaging_timeout_s: float = 8.0):
    """One round among the three peers: (its outcome, runner and vector) per member in member order, member
    2's check of part 0, and an averager (for the run's rule and codec)."""

    async def scenario():
        averagers = [
            Averager(
                dht,
                prefix=f"repair-{runner_type.__name__}",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                sender_timeout_s=1.0,
                averaging_timeout_s=averaging_timeout_s,
                data_plane=False,
                runner_type=runner_type,
            )  # fmt: skip
            for dht, key in peers
        ]
        for averager in averagers:
            await averager.start()
        outcomes = await asyncio.gather(
            *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
        )
        runners = [next(iter(a.rounds.recent.values())) for a in averagers]
        for runner in runners:
            # The honest members' draws; the withholder's own reveal phase waits out its deadline (its
            # reducer role never finishes), which no assertion needs.
            if runner.revealed is not None and runner.index != 0:  # None: the round ran out of time here
                await runner.revealed
        by_index = sorted(zip(runners, outcomes, averagers, vectors, strict=True), key=lambda r: r[0].index)
        checks = []
        for runner, _, averager, _ in by_index[2:]:  # member 2 checks part 0 as a validator would
            chunk = next(iter(runner.answers[0]))
            checks.append(
                await check_reducer(
                    runner,
                    Assignment(0, chunk),
                    servicer_type=AveragingServicer,
                    p2p=averager.p2p,
                    aggregator=averager.aggregator,
                    codec=averager.codec,
                    timeout_s=10.0,
                )  # fmt: skip
            )
        for averager in averagers:
            await averager.shutdown()
        return [(o, r, v) for r, o, _, v in by_index], checks, averagers[0]

    return asyncio.run(scenario())


def vectors_for(peers, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=generator) for _ in peers]


def test_an_honest_substitute_re_reduces_a_withheld_part_and_its_work_checks_out(keyed_dhts):
    results, (check,), averager = run_round(keyed_dhts, Roles, vectors_for(keyed_dhts, 0))
    (_, withholder, _), (one, substitute, v1), (two, validator, v2) = results
    assert one[1].complete and two[1].complete, "the round completes for the honest members"
    assert torch.equal(one[1].vector, two[1].vector), "and they hold the same bits"
    assert withholder.members[0] in one[1].failed_reducers, "the withholder is still reported"
    # Part 0 holds the mean of the inputs the substitute had (its own and member 2's), signed by it.
    lo, hi = split_bounds(NUMEL, 3)[0:2]
    assert torch.allclose(two[1].vector[lo:hi], (v1[lo:hi] + v2[lo:hi]) / 2, atol=2e-3)
    assert substitute.signers[0] == 1 and validator.signers[0] == 1
    # The validator rebuilt the substitute's chunk from inputs their senders showed: exactly right.
    assert check.verdict is None and isinstance(check.evidence, BadAggregateEvidence)
    assert check.evidence.signer == 1 and check.evidence.accused == substitute.members[1]
    judged = parse_evidence(check.evidence.to_bytes())  # what the coordinator reruns on an accusation
    assert judged.judge(averager.aggregator, averager.codec, vector_numel=NUMEL) is None


def test_a_substitute_that_lies_is_convicted_by_evidence_naming_it(keyed_dhts):
    results, (check,), averager = run_round(keyed_dhts, LyingSubstitute, vectors_for(keyed_dhts, 1))
    (_, withholder, _), (_, substitute, _), (two, _, _) = results
    assert two[1].complete
    assert check.verdict is not None and "differs from the rule's result" in check.verdict
    assert check.evidence.signer == 1 and check.evidence.accused == substitute.members[1]
    # What the coordinator reruns on the accusation's bytes: the substitute, not the withholder, is at fault.
    judged = parse_evidence(check.evidence.to_bytes())
    assert judged.accused == substitute.members[1] != withholder.members[0]
    assert "differs" in judged.judge(averager.aggregator, averager.codec, vector_numel=NUMEL)


def test_a_part_the_substitute_received_is_relayed_so_every_member_holds_the_same_bits(keyed_dhts):
    results, _, _ = run_round(keyed_dhts, WithholdsFromOne, vectors_for(keyed_dhts, 2))
    (zero, _, _), (one, _, _), (two, validator, _) = results
    assert all(o[1].complete for o in (zero, one, two))
    assert torch.equal(zero[1].vector, one[1].vector) and torch.equal(one[1].vector, two[1].vector)
    assert 0 not in validator.signers, "member 2 holds the reducer's own signed aggregate, relayed"


def test_a_part_the_reducer_gave_some_member_is_never_re_reduced_for_the_others(keyed_dhts):
    # The reducer serves member 2 but not its substitute: member 2 never asks for a repair, so the
    # substitute, which waits for every other member's inputs, never signs a second version of the part.
    # Member 2's round completes with the reducer's aggregate; the substitute's is incomplete (it retries
    # or catches up), and attackers could not have made up most of a re-reduction's inputs either.
    results, (check,), _ = run_round(
        keyed_dhts, WithholdsFromTheSubstitute, vectors_for(keyed_dhts, 3), averaging_timeout_s=8.0
    )
    (_, _, _), (one, substitute, _), (two, validator, _) = results
    assert two[1].complete and 0 not in validator.signers
    assert not one[1].complete and 0 not in substitute.signers
    assert substitute.repairs.by_part[0].results == [None] * len(substitute.repairs.by_part[0].results)
    assert check.verdict is None and check.evidence.signer is None, "member 2 checked the reducer's own"
