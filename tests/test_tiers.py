"""The second tier's decision logic in-process: who represents a group, what a member checks in its
representative's hand-off (``TierCheck``), and who may ask for it (``TierBoard``). The real round, with real
peers, is ``tests/test_sim.py::test_two_groups_of_a_step_apply_one_update_through_the_second_tier``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
import torch

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    aggregate_message,
    chunk_bounds,
    input_entries,
    layout_chunk_values,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.tiers import (
    TIER_COMPRESSION,
    TierBoard,
    TierCheck,
    TierOutcome,
    representative,
    tier_prefix,
)

PREFIX = tier_prefix("run").replace(".", "_")
SCHEMA = hashlib.sha256(b"schema").digest()
NUMEL = 300
CODEC = get_codec(TIER_COMPRESSION)


def second_tier(
    members: int = 3, *, rep: int = 0, group_input: torch.Tensor, weight: float = 64.0, rep_sends=None
) -> tuple[apb.TierAnswer, list[apb.PartChunk]]:
    """A second-tier round's hand-off as a representative sends it: every member signs its entry, every
    reducer signs its chunks over the inputs it took, the representative's being ``rep_sends`` (default:
    its group's result ``group_input``) at ``weight``."""
    keys = [SigningKey.generate() for _ in range(members)]
    names = [k.peer_id for k in keys]
    bodies = [
        GroupEntryBody(schema_hash=SCHEMA, weight=weight, commit=os.urandom(32), extra={"step": 3})
        for _ in range(members)
    ]
    entries = [make_entry(k, PREFIX, b) for k, b in zip(keys, bodies, strict=True)]
    group_id = os.urandom(20)
    mask = reducer_mask([True] * members)
    digest = round_digest(PREFIX, group_id, names, [b.commit for b in bodies], mask)
    bounds = split_bounds(NUMEL, members, mask)
    values = layout_chunk_values(members, CODEC.bytes_per_value)
    inputs = [torch.randn(NUMEL) for _ in range(members)]
    inputs[rep] = group_input if rep_sends is None else rep_sends
    chunks = []
    for part in range(members):
        lo_part, hi_part = bounds[part], bounds[part + 1]
        cuts = chunk_bounds(hi_part - lo_part, values)
        for chunk in range(len(cuts) - 1):
            lo, hi = lo_part + cuts[chunk], lo_part + cuts[chunk + 1]
            sent = [CODEC.encode_contribution(v[lo:hi]) for v in inputs]
            included = input_entries([(i, weight, data) for i, data in enumerate(sent)])
            data = CODEC.encode(torch.stack([v[lo:hi] for v in inputs]).mean(0))
            at_ms = int(time.time() * 1000)
            signature = keys[part].sign(
                aggregate_message(digest, part, chunk, names[part], included, data, at_ms)
            )
            chunks.append(
                apb.PartChunk(
                    part_index=part,
                    chunk_index=chunk,
                    data=data,
                    signature=signature,
                    included=included,
                    signed_at_ms=at_ms,
                )  # fmt: skip
            )
    header = apb.TierAnswer(
        tier_group_id=group_id, entries=entries, representative=rep, signers=list(range(members))
    )
    return header, chunks


def check_all(header: apb.TierAnswer, chunks: list[apb.PartChunk], group_input: torch.Tensor, weight=64.0):
    check = TierCheck(
        header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, contribution=group_input, weight=weight,
        max_age_s=60.0, certify=None,
    )  # fmt: skip
    expected = list(check.expected())
    assert len(expected) == len(chunks)
    for (part, chunk), message in zip(expected, chunks, strict=True):
        check.take(part, chunk, message)
    return check.output


def test_a_member_decodes_exactly_the_bytes_the_second_tier_signed():
    group_input = torch.randn(NUMEL)
    header, chunks = second_tier(group_input=group_input)
    output = check_all(header, chunks, group_input)
    decoded = torch.cat([CODEC.decode(c.data, len(c.data) // 2, sender="reducer") for c in chunks])  # fp16
    assert torch.equal(output, decoded), "what every representative decoded, bit for bit"


def test_a_representative_that_passed_off_another_input_for_its_group_is_caught():
    group_input = torch.randn(NUMEL)
    header, chunks = second_tier(group_input=group_input, rep_sends=group_input * 10)
    with pytest.raises(ProtocolError, match="never sent"):
        check_all(header, chunks, group_input)


def test_a_representative_that_claimed_another_weight_for_its_group_is_caught():
    group_input = torch.randn(NUMEL)
    header, chunks = second_tier(group_input=group_input, weight=640.0)
    with pytest.raises(ProtocolError, match="never sent"):
        check_all(header, chunks, group_input, weight=64.0)


def test_a_result_altered_on_its_way_is_caught_naming_the_chunk():
    group_input = torch.randn(NUMEL)
    header, chunks = second_tier(group_input=group_input)
    chunks[1].data = CODEC.encode(torch.zeros(len(chunks[1].data) // 2))
    with pytest.raises(ProtocolError, match=r"part \d+ chunk \d+"):
        check_all(header, chunks, group_input)


def test_entries_signed_for_another_prefix_or_listed_twice_are_refused():
    group_input = torch.randn(NUMEL)
    header, _ = second_tier(group_input=group_input)
    with pytest.raises(ProtocolError, match="is for run .run_tier2., expected .other_tier2."):
        TierCheck(header, prefix="other_tier2", schema_hash=SCHEMA, numel=NUMEL, contribution=group_input,
                  weight=64.0, max_age_s=60.0, certify=None)  # fmt: skip
    twice = apb.TierAnswer()
    twice.CopyFrom(header)
    twice.entries[1] = header.entries[0]
    with pytest.raises(ProtocolError, match="twice"):
        TierCheck(twice, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, contribution=group_input,
                  weight=64.0, max_age_s=60.0, certify=None)  # fmt: skip
    with pytest.raises(ProtocolError, match="proves no admission"):
        TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, contribution=group_input,
                  weight=64.0, max_age_s=60.0, certify=lambda peer, cert: "no certificate")  # fmt: skip


def test_every_member_names_the_same_dialable_representative():
    names = [SigningKey.generate().peer_id for _ in range(6)]
    group_id = os.urandom(20)
    chosen = names[representative(group_id, names, None)]
    assert list(reversed(names))[representative(group_id, list(reversed(names)), None)] == chosen
    dialable = [name != chosen for name in names]
    assert names[representative(group_id, names, dialable)] != chosen, "one behind NAT never represents"


def test_only_a_groups_members_get_its_outcome_and_only_once_it_is_posted():
    async def scenario():
        board = TierBoard()
        group_id = os.urandom(20)
        with pytest.raises(ProtocolError, match="represents no such group"):
            await board.wait(group_id, "a", timeout_s=0.2)
        board.open(group_id, ["a", "b"])
        with pytest.raises(ProtocolError, match="not a member"):
            await board.wait(group_id, "stranger", timeout_s=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await board.wait(group_id, "b", timeout_s=0.2)
        waiting = asyncio.create_task(board.wait(group_id, "b", timeout_s=5.0))
        await asyncio.sleep(0.05)
        board.post(group_id, TierOutcome(alone=True))
        assert (await waiting).alone

    asyncio.run(scenario())
