"""Pipeline stages get the protections of data-parallel rounds: signed, policy-held averaging; banned callers refused."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from protocols import pipeline_pb2 as ppb
from protocols.errors import ConfigError
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager
from swarm.averaging.policy import PeerPolicy
from swarm.bans import publish_ban_list
from swarm.config import RunConfig
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.worker import StageWorker
from swarm.records import stage_prefix

pytestmark = pytest.mark.timeout(180)

NUMEL = 20_011


def stage_run(run_id: str) -> RunConfig:
    return RunConfig(
        run_id=run_id,
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32}},
        pipeline={"stages": 2},
        training={"aggregator": "centered_clip", "aggregator_options": {"tau": 5.0}, "verify_probability": 0.5,
                  "matchmaking_time_s": 1.0, "sender_timeout_s": 2.0, "averaging_timeout_s": 10.0},
    )  # fmt: skip


@pytest.fixture
def peers(keyed_dhts):
    return keyed_dhts


def test_a_stage_worker_averages_signed_with_the_runs_rule_and_policy(peers):
    (dht, key), _, _ = peers
    run, coordinator = stage_run("stage-build"), SigningKey.generate()
    with pytest.raises(ConfigError, match="signing_key"):
        StageWorker(run, dht, peer_id=key.peer_id, stage=1, coordinator_key=coordinator.public_key)
    worker = StageWorker(run, dht, peer_id=key.peer_id, stage=1, coordinator_key=coordinator.public_key,
                         signing_key=key)  # fmt: skip
    averager = worker.build_averager(1, NUMEL)
    assert averager.signing_key is key and averager.prefix == stage_prefix(run.run_id, 1).replace(".", "_")
    assert averager.policy is worker.policy is worker.gate.policy and not worker.policy.open
    assert averager.verify_probability == 0.5 and averager.max_weight == 4.0 * run.training.target_batch_size


def test_the_gate_refuses_a_caller_once_the_coordinator_bans_it(peers):
    (dht, _), (_, caller), _ = peers
    coordinator = SigningKey.generate()
    gate = PeerGate(dht, "gate-run", coordinator.public_key, allowed={caller.peer_id}, refresh_s=0.1)

    async def scenario():
        assert await gate.check(caller.peer_id) is None, "a member is served"
        await publish_ban_list(
            dht, coordinator, "gate-run", [caller.peer_id], changed_at=time.time(), ttl_s=60
        )
        deadline = time.monotonic() + 10
        while (refusal := await gate.check(caller.peer_id)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return refusal

    refusal = asyncio.run(scenario())
    assert refusal is not None and refusal[0] == ppb.BANNED
    assert "banned from run 'gate-run' by its coordinator" in refusal[1]


def test_an_uncertified_reducer_cannot_join_a_stages_round(peers, caplog):
    """A libp2p node with no certificate offers to lead the stage's round: the replicas average without it."""
    run = stage_run("stage-sybil")
    (d0, k0), (d1, k1), (d2, k2) = peers
    members = {k0.peer_id, k1.peer_id}
    honest = [
        StageWorker(run, d, peer_id=k.peer_id, stage=1, members=members, signing_key=k).build_averager(
            1, NUMEL
        )
        for d, k in ((d0, k0), (d1, k1))
    ]
    intruder = Averager(  # an uncertified reducer: any process with no certificate, running an averager
        d2, prefix=stage_prefix(run.run_id, 1), numel=NUMEL, signing_key=k2, matchmaking_time_s=1.0,
        sender_timeout_s=2.0, averaging_timeout_s=10.0, data_plane=False, policy=PeerPolicy(d2, run.run_id),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(NUMEL, generator=generator) for _ in range(2)]

    async def scenario():
        for averager in (*honest, intruder):
            await averager.start()
        attack = asyncio.create_task(intruder.average(torch.full((NUMEL,), 100.0), 1.0))
        await asyncio.sleep(0.3)  # the intruder's earlier window makes it the leader the replicas would pick
        outcomes = await asyncio.gather(*[a.average(v, 1.0) for a, v in zip(honest, inputs, strict=True)])
        intruded = await attack
        for averager in (*honest, intruder):
            await averager.shutdown()
        return outcomes, intruded

    with caplog.at_level(logging.DEBUG, logger="swarm.averaging"):
        outcomes, intruded = asyncio.run(scenario())
    assert intruded is None, "nobody formed a group with the uncertified node"
    (group, result), (_, other) = outcomes
    assert {p.to_base58() for p in group.peer_ids} == members
    assert result.complete and other.complete and torch.equal(result.vector, other.vector)
    assert torch.allclose(result.vector, (inputs[0] + inputs[1]) / 2, atol=2e-3)
    assert f"not following {k2.peer_id}: not a certified member" in caplog.text


def test_a_trainers_gradient_is_checked_for_shape_finiteness_and_norm_before_use():
    from swarm.averaging.compression import get_codec
    from swarm.pipeline.replica import Refusal, StageReplica
    from swarm.pipeline.wire import encode_floats, encode_ids

    torch.set_num_threads(1)
    run = stage_run("stage-grads")
    replica = StageReplica(run, 0)
    codec = get_codec(run.training.compression)
    ids = encode_ids(torch.randint(0, 256, (4, 32)))
    forward = ppb.ForwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=1, inputs=ids)
    outputs = replica.forward(forward).outputs
    honest = torch.randn(list(outputs.shape), generator=torch.Generator().manual_seed(0)) * 0.01
    nan = honest.clone()
    nan[0, 0, 0] = float("nan")
    bad = {
        "scaled up": (honest * 1e6, "L2 norm"),
        "NaN": (nan, "non-finite"),
        "wrong shape": (honest[:, :16], r"has shape \[4, 16, 32\]"),
    }
    try:
        for what, (grad, message) in bad.items():
            request = ppb.BackwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=1,
                                          grad_outputs=encode_floats(grad, codec))  # fmt: skip
            with pytest.raises(Refusal, match=message) as refused:
                replica.backward(request)
            assert refused.value.code == ppb.BAD_REQUEST, what
            assert replica.samples == 0 and not replica.by_trainer, f"{what} was used"
            assert all(p.grad is None for p in replica.params), f"{what} was used"
        request.grad_outputs.CopyFrom(encode_floats(honest, codec))
        replica.backward(request)
        assert replica.samples == 4 and bool(replica.mean_gradient().abs().sum() > 0)
    finally:
        replica.close()
