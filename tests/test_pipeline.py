"""SWARM pipeline parallelism: stages split from the model, real stage servers and trainers on loopback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from lab.localswarm import tiny_run
from protocols import pipeline_pb2 as ppb
from protocols.errors import ConfigError
from swarm.averaging.compression import get_codec
from swarm.components import check_components
from swarm.config import RunConfig
from swarm.dht import start_local_dhts
from swarm.models import build_model
from swarm.pipeline import split_model, stage_layout
from swarm.pipeline.balance import choose_stage, rebalance_move
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.server import StageServicer, pipeline_namespace
from swarm.pipeline.wire import encode_floats, encode_ids
from swarm.pipeline.worker import StageWorker

ROOT = Path(__file__).resolve().parents[1]


def pipeline_run(stages: int = 2, n_layer: int = 2, **pipeline: object) -> RunConfig:
    data = tiny_run("pipe").model_dump(mode="json")
    data["model"]["config"]["n_layer"] = n_layer
    data["pipeline"] = {"stages": stages, **pipeline}
    return RunConfig.parse(data)


# --- the split ---------------------------------------------------------------------------------------


def test_stages_compose_to_the_whole_model_bit_for_bit():
    run = pipeline_run(stages=3, n_layer=4)
    assert [s.blocks for s in stage_layout(run)] == [(0, 1), (1, 3), (3, 4)]
    whole = build_model("gpt", run.model.config, seed=run.training.seed)
    stages = split_model(run)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    hidden = ids
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, whole(ids)), "stages start from exactly the whole model's initial values"
    total = sum(p.numel() for s in stages for p in s.parameters())
    # The last stage holds its own copy of the (tied) output projection.
    assert total == sum(p.numel() for p in whole.parameters()) + 256 * run.model.config["d_model"]


def test_bad_layer_split_names_the_field(tmp_path: Path):
    with pytest.raises(ConfigError, match="pipeline.layer_split"):
        RunConfig.parse({"run_id": "r", "pipeline": {"stages": 2, "layer_split": [1, 2, 3]}})
    run = pipeline_run(stages=2, n_layer=2, layer_split=[1, 2])
    with pytest.raises(
        ConfigError, match=r"pipeline.layer_split \[1, 2\] holds 3 blocks but the model has n_layer=2"
    ):
        check_components(run)
    with pytest.raises(
        ConfigError, match="pipeline.layer_split: .*every middle stage needs at least one block"
    ):
        pipeline_run(stages=3, n_layer=2, layer_split=[1, 0, 1])
    run = pipeline_run(stages=2, n_layer=4, layer_split=[3, 1])
    run.to_toml(tmp_path / "run.toml")
    assert RunConfig.from_toml(tmp_path / "run.toml") == run


# --- balancing decisions ----------------------------------------------------------------------------


def _record(peer: str, stage: int, rate: float) -> StageRecord:
    return StageRecord(peer, stage, 0, rate, 0.0, "a" * 64, "b" * 64, time.time())


def test_a_new_peer_takes_the_stage_most_short_of_throughput_that_fits():
    view = PipelineView(stages={0: [_record("p1", 0, 50.0)], 1: [_record("p2", 1, 20.0)]})
    assert choose_stage(view, 3, [True, True, True]) == 2, "a stage with no server at all comes first"
    assert choose_stage(view, 3, [True, True, False]) == 1
    assert choose_stage(view, 3, [False, False, False]) is None


def test_rebalancing_moves_one_peer_from_spare_to_bottleneck_only_when_it_helps():
    view = PipelineView(stages={
        0: [_record("a", 0, 40.0), _record("b", 0, 40.0), _record("c", 0, 40.0)],
        1: [_record("d", 1, 30.0)],
    })  # fmt: skip
    assert rebalance_move(view, "a", 0, 2, margin=0.2) == 1, "stage 1 goes from 30 to 60 samples/s"
    assert rebalance_move(view, "b", 0, 2, margin=0.2) is None, "one mover per stage at a time"
    assert rebalance_move(view, "d", 1, 2, margin=0.2) is None, "a stage's only server never leaves"
    balanced = PipelineView(
        stages={0: [_record("a", 0, 40.0), _record("b", 0, 40.0)], 1: [_record("d", 1, 45.0)]}
    )
    assert rebalance_move(balanced, "a", 0, 2, margin=0.2) is None, "moving would make stage 0 the bottleneck"


# --- a stage server under bad input -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_malformed_activations_get_a_clear_error_and_the_server_keeps_serving(tmp_path: Path):
    torch.set_num_threads(1)
    run = pipeline_run(stages=2, n_layer=2, ban_after_bad_requests=50)
    (server_dht, server_key), (caller_dht, _), (stranger_dht, _) = start_local_dhts(3, tmp_path)
    server_id, caller_id = server_dht.peer_id.to_base58(), caller_dht.peer_id.to_base58()
    worker = StageWorker(
        run, server_dht, peer_id=server_id, stage=1, members={server_id, caller_id}, signing_key=server_key
    )
    stop = asyncio.Event()
    codec = get_codec(run.training.compression)
    d_model = run.model.config["d_model"]

    async def scenario() -> None:
        task = asyncio.create_task(worker.run(stop))
        deadline = time.monotonic() + 60
        while worker.replica is None or not hasattr(worker, "servicer"):
            assert time.monotonic() < deadline and not task.done(), "the stage server did not start"
            await asyncio.sleep(0.2)
        caller_p2p = await caller_dht.replicate_p2p()
        stranger_p2p = await stranger_dht.replicate_p2p()
        namespace = pipeline_namespace(run.run_id, 1)
        stub = StageServicer.get_stub(caller_p2p, server_dht.peer_id, namespace=namespace)
        targets = encode_ids(torch.randint(0, 256, (4, 32)))

        def request(inputs: ppb.Tensor, **fields) -> ppb.ForwardRequest:
            base = dict(run_id=run.run_id, stage=1, step=0, microbatch_id=7, inputs=inputs, targets=targets)
            return ppb.ForwardRequest(**{**base, **fields})

        good = encode_floats(torch.randn(4, 32, d_model), codec)
        nan = torch.randn(4, 32, d_model)
        nan[0, 0, 0] = float("nan")
        cases = {
            "wrong shape": (encode_floats(torch.randn(4, 32, d_model + 1), codec), "has shape [4, 32, 33]"),
            "wrong rank": (encode_floats(torch.randn(4, 32), codec), "expected 3 dimensions"),
            "wrong dtype": (encode_floats(torch.randn(4, 32, d_model), get_codec("none")), "dtype float32"),
            "wrong size": (
                ppb.Tensor(shape=[4, 32, d_model], dtype=ppb.FLOAT16, data=b"\0" * 10),
                "sent 10 bytes",
            ),
            "NaN": (encode_floats(nan, codec), "non-finite"),
            "too long": (encode_floats(torch.randn(4, 33, d_model), codec), "expected [1..4, 1..32, 32]"),
        }
        for what, (inputs, message) in cases.items():
            reply = await stub.rpc_forward(request(inputs), timeout=10)
            assert reply.code == ppb.BAD_REQUEST and message in reply.error, (what, reply.error)
        reply = await stub.rpc_forward(request(good, stage=0), timeout=10)
        assert reply.code == ppb.BAD_REQUEST and "serves stage 1, not stage 0" in reply.error
        reply = await stub.rpc_forward(request(good, step=5), timeout=10)
        assert reply.code == ppb.WRONG_STEP and reply.step == 0
        stranger = StageServicer.get_stub(stranger_p2p, server_dht.peer_id, namespace=namespace)
        reply = await stranger.rpc_forward(request(good), timeout=10)
        assert reply.code == ppb.UNKNOWN_PEER and "not a member" in reply.error
        # The server is still up and serves a good request: the loss and the gradient for stage 0.
        reply = await stub.rpc_forward(request(good), timeout=10)
        assert (
            reply.code == ppb.OK
            and 5.0 < reply.loss < 6.0
            and list(reply.grad_inputs.shape) == [4, 32, d_model]
        )
        assert worker.replica.samples == 4
        again = await stub.rpc_forward(request(good), timeout=10)
        assert again.grad_inputs.data == reply.grad_inputs.data and worker.replica.samples == 4, (
            "counted once"
        )
        worker.gate.ban(caller_id, "sent NaN activations")
        reply = await stub.rpc_forward(request(good, microbatch_id=8), timeout=10)
        assert reply.code == ppb.BANNED and "sent NaN activations" in reply.error
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, timeout=30)

    try:
        asyncio.run(scenario())
    finally:
        for dht in (server_dht, caller_dht, stranger_dht):
            dht.shutdown()
