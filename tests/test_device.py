"""The compute device: ``--gpu``/``--cpu``/auto, and training state that moves between CPU and GPU peers.

Every test runs on the CPU; the ``cuda`` cases run where a GPU is visible (see docs/gpu.md for a run on
one). Peers on the same kind of device must stay bit-identical; a state must load, and hash the same,
whichever kind of device wrote it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import KEYS, kept_logs, run_then_shut_down, start_dhts

from lab.localswarm import tiny_run
from peer.device import describe_device, resolve_device
from protocols.errors import ConfigError
from swarm.config import OptimizerConfig
from swarm.models import build_model
from swarm.training import (
    build_optimizer,
    decode_state,
    encode_state,
    ensure_optimizer_state,
    load_state_tensors,
    params_hash,
    state_hash,
    state_tensors,
)
from swarm.training.peer import TrainingPeer
from swarm.training.state import apply_flat_gradient
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
TINY = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 16}
CONFIG = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=2, total_steps=10, weight_decay=0.1)


# --- choosing the device -----------------------------------------------------------------------------


def test_cpu_choice_and_label() -> None:
    assert resolve_device("cpu") == "cpu"
    assert re.fullmatch(r"cpu: \d+ cores", describe_device("cpu"))


def test_auto_takes_the_gpu_exactly_when_one_computes() -> None:
    assert resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")


def test_unknown_choice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="auto, cpu, gpu"):
        resolve_device("tpu")


def test_gpu_hidden_from_the_process_fails_clearly_and_auto_falls_back() -> None:
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this is the machine-without-GPU case on any machine.
    code = (
        "from peer.device import resolve_device\n"
        "from protocols.errors import ConfigError\n"
        "print(resolve_device('auto'))\n"
        "try:\n"
        "    resolve_device('gpu')\n"
        "except ConfigError as e:\n"
        "    print('error:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    auto, error = result.stdout.splitlines()
    assert auto == "cpu"
    assert error.startswith("error: --gpu was given but no CUDA device is usable: torch ")
    assert "--cpu" in error, "the message tells the volunteer what to do instead"


@needs_cuda
def test_gpu_choice_and_label_on_a_gpu() -> None:
    assert resolve_device("gpu") == "cuda"
    label = describe_device("cuda")
    assert label.startswith(f"cuda: {torch.cuda.get_device_name(0)}"[:64]) and len(label) <= 64
    assert re.search(r", \d+ GiB$", label)


# --- training state on either device -----------------------------------------------------------------


def _peer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A peer's model and optimizer, built as the trainer builds them."""
    model = build_model("gpt", TINY, seed=0).to(device)
    optimizer = build_optimizer(model, CONFIG)
    ensure_optimizer_state(model, optimizer)
    return model, optimizer


def _averaged_gradient(seed: int) -> torch.Tensor:
    """A real gradient of the tiny model, flat on the CPU, as the all-reduce hands it to every peer."""
    model = build_model("gpt", TINY, seed=seed)
    ids = torch.randint(0, 256, (4, TINY["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))
    (model.loss(ids[:, :-1], ids[:, 1:]) * 50).backward()  # large enough that clipping acts
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _apply(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, flat: torch.Tensor) -> None:
    """The trainer's step: the averaged gradient onto the device, clipped, then the optimizer."""
    apply_flat_gradient(model, list(model.parameters()), optimizer, CONFIG, step, flat)
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
def test_peers_on_one_kind_of_device_stay_bit_identical(device: str) -> None:
    a, b = _peer(device), _peer(device)
    start = params_hash(a[0])
    for step in range(4):
        flat = _averaged_gradient(seed=10 + step)
        _apply(*a, step, flat)
        _apply(*b, step, flat)
        assert state_hash(step + 1, state_tensors(*a)) == state_hash(step + 1, state_tensors(*b)), step
    assert all(p.device.type == device for p in a[0].parameters())
    assert params_hash(a[0]) == params_hash(b[0]) != start


@pytest.mark.parametrize("source", DEVICES)
@pytest.mark.parametrize("target", DEVICES)
def test_state_moves_between_devices_and_hashes_the_same(source: str, target: str) -> None:
    sender = _peer(source)
    for step in range(2):
        _apply(*sender, step, _averaged_gradient(seed=step))
    sent = state_tensors(*sender)
    data = encode_state(2, sent, {"run_id": "test-run"})
    decoded = decode_state(data, max_bytes=len(data))
    assert decoded.state_hash == state_hash(2, sent)

    joiner = _peer(target)
    load_state_tensors(*joiner, decoded.tensors)
    # The hash covers bytes, dtype and shape, never the device: the joiner reports what the sender did.
    assert state_hash(2, state_tensors(*joiner)) == decoded.state_hash
    assert params_hash(joiner[0]) == params_hash(sender[0])
    live = [*joiner[0].parameters(), *(t for s in joiner[1].state.values() for t in s.values())]
    # Loading copies into the joiner's own tensors: parameters and moments stay on its device.
    assert {t.device.type for t in live if t.dim() > 0} == {target}

    flat = _averaged_gradient(seed=7)
    _apply(*sender, 2, flat)
    _apply(*joiner, 2, flat)
    after_sender, after_joiner = state_tensors(*sender), state_tensors(*joiner)
    if source == target:
        assert state_hash(3, after_sender) == state_hash(3, after_joiner)
    else:
        # CPU and CUDA kernels may round differently; the step is still the same computation.
        for name in after_sender:
            torch.testing.assert_close(after_joiner[name], after_sender[name], rtol=1e-5, atol=1e-7)


def test_swarm_sim_with_gpu_peers_and_no_gpu_fails_fast_naming_the_cause(tmp_path: Path) -> None:
    if HAS_CUDA:
        pytest.skip("checks the message shown on machines without a GPU")
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--peers", "1", "--gpu-peers", "1", "--model-size", "tiny",
         "--steps", "1", "--timeout-s", "100"],
        capture_output=True, text=True, timeout=110, cwd=ROOT, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1
    assert "peer0 exited with code 2" in result.stderr
    assert "--gpu was given but no CUDA device is usable" in result.stderr
    kept = kept_logs(result.stderr)
    assert kept is not None, "a failed run keeps its logs and says where"
    assert "no CUDA device is usable" in (kept / "peer0.log").read_text()
    shutil.rmtree(kept)


# --- a swarm of mixed device kinds -------------------------------------------------------------------


class OtherKindOfDevice(TrainingPeer):
    """A peer whose optimizer step rounds differently, as a CPU peer's does among GPU peers: after each
    step one parameter is one float32 ulp off what the others computed from the same averaged gradient
    (the third trainer's peer is of this class)."""

    def _apply_round(self, result) -> None:
        super()._apply_round(result)
        with torch.no_grad():
            first = self.params[0].view(-1)
            first[0] = torch.nextafter(first[0], torch.tensor(float("inf")))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_that_rounds_differently_ends_the_run_holding_the_majority_state() -> None:
    run = tiny_run("mixed-kinds", max_steps=3, min_group_size=3)
    torch.set_num_threads(1)
    dhts = start_dhts(3)
    trainers = [
        Trainer(run, d, peer_id=d.peer_id.to_base58(), signing_key=KEYS[d.peer_id.to_base58()]) for d in dhts
    ]
    odd = trainers[2]
    odd.peer.__class__ = OtherKindOfDevice

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers]
        try:
            deadline = time.monotonic() + 180
            # Done when all finished and agree; the odd peer's last step came out apart, so it must
            # still adopt the majority's state after max_steps.
            while not (all(t.finished for t in trainers) and len({t.state_hash for t in trainers}) == 1):
                assert time.monotonic() < deadline, (
                    f"steps {[t.step for t in trainers]}, hashes {[t.state_hash[:12] for t in trainers]}"
                )
                assert not any(t.done() for t in tasks), "a trainer stopped"
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    run_then_shut_down(scenario(), dhts)
    assert [t.step for t in trainers] == [3, 3, 3]
    assert trainers[0].param_hash == trainers[1].param_hash == odd.param_hash
    assert odd.metrics()["resyncs"] >= 1, "it downloaded the state the two others agree on"
