"""Accusations from pipeline stages: each stage averages its own parameters under its own prefix.

The real ``CoordinatorService`` is served over gRPC on loopback for a two-stage run. Evidence is built
and signed exactly as a stage's round builds it, under the stage's averaging prefix and the stage's
layout: a true accusation bans the cheating reducer, never the accuser, and evidence under a prefix the
run does not use bans nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.service import CoordinatorService
from coordinator.store import Store
from lab.localswarm import tiny_run
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    aggregate_message,
    aggregation_seed,
    chunk_numel,
    contribution_message,
    input_entries,
    layout_chunk_values,
    reduce_chunk,
    round_digest,
)
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.pipeline.replica import StageReplica
from swarm.records import stage_prefix
from swarm.rpc import CHANNEL_OPTIONS

SIGNED_AT_MS = 1_795_000_000_000  # when the reducers in these tests sign (Unix ms)

pytestmark = pytest.mark.timeout(90)

RUN = "stage.run"  # a dot, which averagers turn into "_" in their prefix


def pipeline_run() -> RunConfig:
    spec = tiny_run(RUN).model_dump()
    spec["model"]["config"]["n_layer"] = 2
    spec["pipeline"] = {"stages": 2}
    return RunConfig.model_validate(spec)


def averaging_prefix(prefix: str) -> str:
    return prefix.replace(".", "_")  # as swarm.averaging.averager names it


def signed_chunk(
    run: RunConfig, keys: list[SigningKey], *, prefix: str, vector: int, part: int, shift: float = 0.0
) -> BadAggregateEvidence:
    """Chunk 0 of part ``part`` of a round under ``prefix``, as reducer ``keys[part]`` aggregated it
    (its output shifted by ``shift``), with every input signed by its sender."""
    codec = get_codec(run.training.compression)
    aggregator = get_aggregator(run.training.aggregator, run.training.aggregator_options)
    members = [k.peer_id for k in keys]
    group_id, chunk = b"stage-group", 0
    digest = round_digest(prefix, group_id, members)
    values = layout_chunk_values(len(keys), codec.bytes_per_value)
    numel = chunk_numel(vector, len(keys), part, chunk, values)
    generator = torch.Generator().manual_seed(3)
    inputs = []
    for index, key in enumerate(keys):
        data = codec.encode(torch.randn(numel, generator=generator))
        signature = key.sign(contribution_message(digest, part, chunk, members[index], 8.0, data))
        inputs.append(SignedInput(index, data, signature, 8.0))
    decoded = [codec.decode(i.data, numel, sender="x") for i in inputs]
    output = reduce_chunk(
        aggregator, codec, decoded, [i.weight for i in inputs], aggregation_seed(group_id, part, chunk)
    )
    if shift:
        output = codec.encode(codec.decode(output, numel, sender="x") + shift)
    entries = input_entries([(i.sender_index, i.weight, i.data) for i in inputs])
    signature = keys[part].sign(
        aggregate_message(digest, part, chunk, members[part], entries, output, SIGNED_AT_MS)
    )
    return BadAggregateEvidence(
        prefix=prefix, group_id=group_id, members=tuple(members), commitments=(), part=part, chunk=chunk,
        numel=numel, inputs=tuple(inputs), output=output, output_signature=signature, signed_at_ms=SIGNED_AT_MS, entries=entries,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, run: RunConfig, stage_checkpoint=lambda stage: None, stage_states=None
) -> AsyncIterator[tuple[str, Store]]:
    """The real coordinator service on loopback; ``stage_checkpoint``: its checkpoint of a stage;
    ``stage_states``: where it gets a stage's state at another step."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store.open_sync(tmp_path / "coordinator.db", run.run_id)
    service = CoordinatorService(
        run, SigningKey.generate(), store, [], stage_checkpoint=stage_checkpoint, stage_states=stage_states
    )
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((service.generic_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", store
    finally:
        await server.stop(grace=0.5)
        store.close()


def test_a_true_accusation_from_a_stage_bans_the_cheating_reducer(tmp_path: Path):
    run = pipeline_run()
    stage = StageReplica(run, 1)  # what a replica of stage 1 averages
    prefix = averaging_prefix(stage_prefix(RUN, 1))
    keys = [SigningKey.generate() for _ in range(5)]
    accuser, reducer, third, framer, outsider = keys

    async def scenario() -> None:
        async with serving(tmp_path, run) as (address, store), CoordinatorClient(address) as client:
            for i, key in enumerate(keys):
                await client.join(key, RUN, name=f"peer{i}", device="cpu")
            lie = signed_chunk(
                run, [accuser, reducer, third], prefix=prefix, vector=stage.numel, part=1, shift=0.5
            )
            answer = await client.accuse(
                accuser, RUN, accused=reducer.peer_id, reason="shifted", evidence=lie.to_bytes()
            )
            assert answer.banned_peer == reducer.peer_id and "differs" in answer.verdict
            # The stage's layout, not the whole model's, is what the judge holds the evidence to.
            honest = signed_chunk(run, [framer, third, outsider], prefix=prefix, vector=stage.numel, part=1)
            answer = await client.accuse(
                framer, RUN, accused=third.peer_id, reason="made up", evidence=honest.to_bytes()
            )
            assert answer.banned_peer == framer.peer_id and "false accusation" in answer.verdict
            assert {b.peer_id for b in await store.list_bans()} == {reducer.peer_id, framer.peer_id}

    asyncio.run(scenario())


def test_evidence_under_an_unknown_prefix_bans_nobody(tmp_path: Path):
    run = pipeline_run()
    keys = [SigningKey.generate() for _ in range(3)]
    accuser, reducer, third = keys

    async def scenario() -> None:
        async with serving(tmp_path, run) as (address, store), CoordinatorClient(address) as client:
            for i, key in enumerate(keys):
                await client.join(key, RUN, name=f"peer{i}", device="cpu")
            for prefix in (averaging_prefix(stage_prefix(RUN, 2)), "another_run"):  # no stage 2; not this run
                lie = signed_chunk(run, keys, prefix=prefix, vector=5000, part=1, shift=0.5)
                with pytest.raises(ProtocolError, match="nobody banned"):
                    await client.accuse(
                        accuser, RUN, accused=reducer.peer_id, reason="shifted", evidence=lie.to_bytes()
                    )
            assert await store.list_bans() == []

    asyncio.run(scenario())
