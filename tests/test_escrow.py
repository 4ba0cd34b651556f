"""The escrow of a reducer's own input (swarm/averaging/escrow.py), in process with real keys.

A sender takes an aggregate that lists its reducer's own input only with the escrow holder's receipt
for exactly that input; the input the holder keeps then settles a check: a reducer that aggregated
another own input than it escrowed is convicted, one that aggregated the escrowed input is not.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from protocols.errors import ProtocolError, SignatureError
from protocols.keys import SigningKey
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.compression import get_codec
from swarm.averaging.escrow import check_receipt, escrow_holder, receipt_message
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


def receipt(evidence: BadAggregateEvidence, key: SigningKey, held: SignedInput) -> bytes:
    """``key``'s signature that it holds ``held`` as the reducer's escrowed own input."""
    message = receipt_message(
        evidence.digest, 0, 0, key.peer_id, held.weight, hashlib.sha256(held.data).digest()
    )
    return key.sign(message)


def test_a_sender_takes_the_reducers_own_input_only_with_its_holders_receipt(keys):
    evidence = reduced(keys)
    holder = escrow_holder(0, len(keys))
    assert holder == 1
    members, entries = list(evidence.members), parse_entries(evidence.entries, len(keys))
    own = evidence.inputs[0]

    def check(receipt_bytes: bytes, listed=entries) -> None:
        check_receipt(evidence.digest, members, 0, 0, listed, receipt_bytes)

    check(receipt(evidence, keys[holder], own))  # the holder holds exactly what is listed
    check(b"", [e for e in entries if e.sender_index != 0])  # no own input listed: nothing to escrow
    with pytest.raises(ProtocolError, match="without escrowing"):
        check(b"")
    with pytest.raises(SignatureError):  # the reducer cannot stand in for its holder
        check(receipt(evidence, keys[0], own))
    with pytest.raises(SignatureError):  # a receipt for another input than the one aggregated
        other = dataclasses.replace(own, data=CODEC.encode(torch.zeros(evidence.numel)))
        check(receipt(evidence, keys[holder], other))


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
