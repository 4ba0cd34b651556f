"""The escrow of a reducer's own input (swarm/averaging/escrow.py), in process with real keys.

A sender takes an aggregate that lists its reducer's own input only with a receipt for exactly that
input by another member; the input the holder keeps then settles a check: a reducer that aggregated
another own input than it escrowed is convicted, one that aggregated the escrowed input is not. A
reducer whose designated holder is gone escrows with the next member, among real peers on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import pytest
import torch

from protocols.errors import ProtocolError, SignatureError
from protocols.keys import SigningKey
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.averager import Averager, AveragingServicer
from swarm.averaging.compression import get_codec
from swarm.averaging.escrow import (
    check_receipt,
    escrow_candidates,
    pack_receipt,
    receipt_holder,
    receipt_message,
)
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    EquivocationEvidence,
    SignedInput,
    aggregate_message,
    aggregation_seed,
    chunk_numel,
    contribution_message,
    input_entries,
    layout_chunk_values,
    parse_entries,
    parse_evidence,
    reduce_chunk,
    round_digest,
)
from swarm.averaging.verification import Assignment, check_reducer
from swarm.byzantine.attacks import make_attack
from swarm.dht import start_local_dhts

pytestmark = pytest.mark.timeout(60)

PREFIX, GROUP, VECTOR = "escrow-run", b"group-escrow", 3001
CODEC, RULE = get_codec("fp16"), get_aggregator("centered_clip")


@pytest.fixture(scope="module")
def keys() -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(3)]


def reduced(keys, *, shift: float = 0.0, own: bytes | None = None) -> BadAggregateEvidence:
    """Chunk 0 of part 0 as reducer ``keys[0]`` signs it: the rule's result (plus ``shift``) over every
    member's signed input, its own input's data replaced by ``own`` when given."""
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(bytes([i])).digest() for i in range(len(keys)))
    digest = round_digest(PREFIX, GROUP, members, commits)
    numel = chunk_numel(VECTOR, len(keys), 0, 0, layout_chunk_values(len(keys), CODEC.bytes_per_value))
    generator = torch.Generator().manual_seed(3)
    inputs = []
    for index, key in enumerate(keys):
        data = CODEC.encode(torch.randn(numel, generator=generator))
        data = own if index == 0 and own is not None else data
        signature = key.sign(contribution_message(digest, 0, 0, members[index], 8.0, data))
        inputs.append(SignedInput(index, data, signature, 8.0))
    decoded = [CODEC.decode(i.data, numel, sender="x") for i in inputs]
    output = reduce_chunk(RULE, CODEC, decoded, [8.0] * len(keys), aggregation_seed(GROUP, 0, 0))
    if shift:
        output = CODEC.encode(CODEC.decode(output, numel, sender="x") + shift)
    entries = input_entries([(i.sender_index, i.weight, i.data) for i in inputs])
    return BadAggregateEvidence(
        prefix=PREFIX, group_id=GROUP, members=members, commitments=commits, part=0, chunk=0, numel=numel,
        inputs=tuple(inputs), output=output, entries=entries,
        output_signature=keys[0].sign(aggregate_message(digest, 0, 0, members[0], entries, output)),
    )  # fmt: skip


def receipt(evidence: BadAggregateEvidence, key: SigningKey, held: SignedInput, *, names: int) -> bytes:
    """``key``'s receipt, naming member ``names`` as holder, that it holds ``held`` as the reducer's
    escrowed own input."""
    message = receipt_message(
        evidence.digest, 0, 0, key.peer_id, held.weight, hashlib.sha256(held.data).digest()
    )
    return pack_receipt(names, key.sign(message))


def test_a_sender_takes_the_reducers_own_input_only_with_a_holders_receipt(keys):
    evidence = reduced(keys)
    assert escrow_candidates(0, len(keys)) == [1, 2], "the next member first, then the one after"
    members, entries = list(evidence.members), parse_entries(evidence.entries, len(keys))
    own = evidence.inputs[0]

    def check(receipt_bytes: bytes, listed=entries) -> int | None:
        return check_receipt(evidence.digest, members, 0, 0, listed, receipt_bytes)

    # The holder holds exactly what is listed: the designated one, or the fallback when that one is gone.
    assert check(receipt(evidence, keys[1], own, names=1)) == 1
    assert check(receipt(evidence, keys[2], own, names=2)) == 2
    assert check(b"", [e for e in entries if e.sender_index != 0]) is None  # no own input: nothing held
    with pytest.raises(ProtocolError, match="without escrowing"):
        check(b"")
    with pytest.raises(ProtocolError, match="another member"):  # the reducer cannot hold for itself
        check(receipt(evidence, keys[0], own, names=0))
    with pytest.raises(ProtocolError, match="another member"):  # nor can a member outside the group
        check(receipt(evidence, keys[1], own, names=3))
    with pytest.raises(ProtocolError, match="bytes"):
        check(receipt(evidence, keys[1], own, names=1)[:-1])
    with pytest.raises(SignatureError):  # a receipt naming one member, signed by another
        check(receipt(evidence, keys[1], own, names=2))
    with pytest.raises(SignatureError):  # a receipt for another input than the one aggregated
        other = dataclasses.replace(own, data=CODEC.encode(torch.zeros(evidence.numel)))
        check(receipt(evidence, keys[1], other, names=1))


def test_an_escrow_other_than_the_aggregated_own_input_convicts_the_reducer(keys):
    escrowed = reduced(keys).inputs[0]  # what the reducer escrowed with its holder
    aggregated = reduced(keys, own=CODEC.encode(torch.zeros(len(escrowed.data) // 2)))
    proof = EquivocationEvidence(
        prefix=PREFIX, group_id=GROUP, members=aggregated.members, commitments=aggregated.commitments,
        part=0, chunk=0, first=escrowed, second=None, entries=aggregated.entries, output=aggregated.output,
        output_signature=aggregated.output_signature,
    )  # fmt: skip
    judged = parse_evidence(proof.to_bytes())
    assert judged.accused == keys[0].peer_id
    assert "other than the one it aggregated" in judged.judge(RULE, CODEC, vector_numel=VECTOR)
    honest = reduced(keys)  # an honest reducer aggregated what it escrowed: the proof frames nobody
    framed = dataclasses.replace(
        judged, entries=honest.entries, output=honest.output, output_signature=honest.output_signature
    )
    with pytest.raises(ProtocolError, match="the one it aggregated"):
        framed.judge(RULE, CODEC, vector_numel=VECTOR)


class HolderGone(ButterflyAllReduce):
    """An honest member, except the one right after ``ATTACKER`` in group order (the attacker's
    designated escrow holder): that one dies once its group has formed, and neither sends nor reduces."""

    attacker = ""

    async def run(self):
        if self.index == (self.members.index(self.attacker) + 1) % len(self.members):
            await asyncio.sleep(3600)
        return await super().run()


@pytest.fixture
def four_dhts(tmp_path):
    nodes = start_local_dhts(4, tmp_path)
    yield nodes
    for node, _ in nodes:
        node.shutdown()


@pytest.mark.timeout(120)
def test_a_reducer_whose_holder_is_gone_escrows_with_the_next_member_and_is_convicted_from_its_copy(
    four_dhts, monkeypatch
):
    numel, attacker = 40_000, four_dhts[0][1].peer_id
    monkeypatch.setattr(HolderGone, "attacker", attacker)
    averagers = [
        Averager(
            dht,
            prefix="escrow-fallback",
            numel=numel,
            signing_key=key,
            matchmaking_time_s=1.0,
            sender_timeout_s=1.0,
            data_plane=False,
            runner_type=HolderGone,
            attack=make_attack("refusing_reducer", group_size=4, attackers=1) if i == 0 else None,
        )  # fmt: skip
        for i, (dht, key) in enumerate(four_dhts)
    ]
    by_id = {key.peer_id: av for (_, key), av in zip(four_dhts, averagers, strict=True)}
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(numel, generator=generator) for _ in averagers]

    async def scenario():
        for averager in averagers:
            await averager.start()
        try:
            return await one_round()
        finally:
            for averager in averagers:
                await averager.shutdown()

    async def one_round():
        tasks = [
            asyncio.create_task(a.average(v, 1.0, expected_size=4))
            for a, v in zip(averagers, inputs, strict=True)
        ]
        done: set[asyncio.Task] = set()
        for _ in range(60):  # the vanished member's round ends only at its deadline; the others' in seconds
            done, _ = await asyncio.wait(tasks, timeout=1)
            if len(done) >= 3:
                break
        for task in tasks:
            task.cancel()
        group = next(t.result()[0] for t in done if t.result() is not None)
        members = [p.to_base58() for p in group.peer_ids]
        a = members.index(attacker)
        gone, fallback, validator = ((a + step) % 4 for step in (1, 2, 3))
        survivors = [tasks[averagers.index(by_id[m])] for i, m in enumerate(members) if i != gone]
        assert all(t in done for t in survivors), "the three survivors end the round"
        results = [t.result()[1] for t in survivors]
        assert all(r.complete for r in results), "the survivors complete the round"
        assert all(torch.equal(r.vector, results[0].vector) for r in results), "and agree bit for bit"
        holder_round, checker = (
            by_id[members[fallback]].rounds.lookup(group.group_id),
            by_id[members[validator]],
        )
        checking = checker.rounds.lookup(group.group_id)
        # The attacker's designated holder is gone: every aggregate of its part lists its own input with
        # a receipt by the member after that one, which holds the input.
        answers = checking.answers[a]
        assert answers, "the validator took the attacker's part from the attacker"
        assert all(receipt_holder(m.receipt, 4, a) == fallback for m in answers.values())
        assert set(holder_round.escrows) == {(a, c) for c in answers}
        # The validator that does not hold the escrow checks a chunk of the attacker's part (what it does
        # once the draw names it): the attacker shows nothing, the member its receipt names shows the
        # attacker's own input, and the recomputed chunk convicts the attacker.
        outcome = await check_reducer(
            checking, Assignment(a, min(answers)), servicer_type=AveragingServicer, p2p=checker.p2p,
            aggregator=checker.aggregator, codec=checker.codec, timeout_s=10.0,
        )  # fmt: skip
        own = next(i for i in outcome.evidence.inputs if i.sender_index == a)
        assert own.data == holder_round.escrows[(a, min(answers))].data
        return outcome

    outcome = asyncio.run(scenario())
    assert "differs from the rule's result" in outcome.verdict
    judged = parse_evidence(outcome.evidence.to_bytes())
    assert judged.accused == attacker
    assert "differs from the rule's result" in judged.judge(get_aggregator("mean"), CODEC, vector_numel=numel)
