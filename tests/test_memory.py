"""Activation checkpointing, peak memory, and running out of memory without ending the peer.

Out-of-memory errors are injected deterministically: a loss function that raises the allocator's error
above a batch size, or once at a chosen call, the way a too-small GPU would, but reproducibly on a CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from swarm.models import build_model, set_activation_checkpointing
from swarm.training.memory import is_out_of_memory, peak_memory_bytes
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.state import params_hash

pytestmark = pytest.mark.timeout(120)

SMALL = {"d_model": 32, "n_layer": 4, "n_head": 2, "seq_len": 32}


class FaultInjector:
    """Wraps a model's loss: raises an out-of-memory error above ``max_batch`` samples, or at call ``fail_at``."""

    def __init__(self, model, *, max_batch: int | None = None, fail_at: int | None = None, error=None):
        self.model, self.max_batch, self.fail_at = model, max_batch, fail_at
        self.error = error or (
            lambda n: torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} MiB")
        )
        self.calls: list[int] = []

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls.append(inputs.shape[0])
        loss = self.model.loss(inputs, targets)  # the forward runs: its graph must be freed on failure
        if (self.max_batch is not None and inputs.shape[0] > self.max_batch) or len(
            self.calls
        ) == self.fail_at:
            raise self.error(inputs.shape[0])
        return loss


def _batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (n, SMALL["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _reference(config=SMALL, n: int = 8) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model("gpt", config, seed=0)
    inputs, targets = _batch(n)
    loss = model.loss(inputs, targets)
    (loss * n).backward()
    return float(loss.detach()), _grads(model)


def _assert_same_grads(got: dict, want: dict, **tolerance) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, **tolerance)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(dropout: float) -> None:
    config = {**SMALL, "dropout": dropout}
    results = []
    for checkpointing in (False, True):
        model = build_model("gpt", config, seed=0)
        runner = MicroBatchRunner(model, activation_checkpointing=checkpointing)
        assert runner.checkpointing is checkpointing
        torch.manual_seed(1)  # dropout draws from the global RNG; recomputation must replay the same draws
        loss = runner.run(*_batch())
        results.append((loss, _grads(model), params_hash(model)))
    (plain_loss, plain_grads, plain_hash), (ckpt_loss, ckpt_grads, ckpt_hash) = results
    assert ckpt_loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(ckpt_grads, plain_grads, rtol=1e-5, atol=1e-7)
    assert ckpt_hash == plain_hash, "parameter names and values are those of the plain model"


def _saved_activation_bytes(checkpointing: bool) -> int:
    model = build_model("gpt", SMALL, seed=0)
    set_activation_checkpointing(model, checkpointing)
    params = {p.data_ptr() for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.data_ptr() not in params:  # weights are held anyway; count what the forward adds
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(*_batch())
    loss.backward()
    return saved


def test_activation_checkpointing_keeps_far_fewer_activations_for_backward() -> None:
    plain, checkpointed = _saved_activation_bytes(False), _saved_activation_bytes(True)
    assert checkpointed * 2 <= plain, (plain, checkpointed)


def test_checkpointing_turns_off_again_and_is_skipped_in_evaluation() -> None:
    model = build_model("gpt", SMALL, seed=0)
    assert set_activation_checkpointing(model, True) == SMALL["n_layer"]
    with torch.no_grad():
        on = model.loss(*_batch())
    set_activation_checkpointing(model, False)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    with torch.no_grad():
        assert float(model.loss(*_batch())) == float(on)


def test_a_model_that_declares_no_blocks_trains_without_checkpointing(caplog) -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, 8)
            self.head = torch.nn.Linear(8, 256)

        def loss(self, inputs, targets):
            return torch.nn.functional.cross_entropy(
                self.head(self.embed(inputs)).flatten(0, 1), targets.flatten()
            )

    with caplog.at_level(logging.WARNING):
        runner = MicroBatchRunner(Plain(), activation_checkpointing=True)
    assert not runner.checkpointing and "declares no blocks" in caplog.text
    assert runner.run(*_batch(2)) > 0


def test_out_of_memory_halves_the_micro_batch_and_the_gradient_is_unchanged(caplog) -> None:
    want_loss, want_grads = _reference()
    model = build_model("gpt", SMALL, seed=0)
    injector = FaultInjector(model, max_batch=2)
    runner = MicroBatchRunner(model, loss_fn=injector)
    with caplog.at_level(logging.WARNING):
        loss = runner.run(*_batch())
    assert injector.calls == [8, 4, 2, 2, 2, 2]
    assert runner.chunk_size == 2 and runner.out_of_memory_events == 2
    assert "out of memory at 8 samples per forward/backward" in caplog.text
    assert "retrying with 4" in caplog.text and "retrying with 2" in caplog.text
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _assert_same_grads(_grads(model), want_grads, rtol=1e-5, atol=1e-7)
    runner.run(*_batch())  # the next micro-batch starts at the size that fitted
    assert injector.calls[6:] == [2, 2, 2, 2]


def test_out_of_memory_in_the_middle_of_a_micro_batch_counts_every_sample_once() -> None:
    want_loss, want_grads = _reference()
    model = build_model("gpt", SMALL, seed=0)
    injector = FaultInjector(model, fail_at=2, error=lambda n: RuntimeError("CUDA error: out of memory"))
    runner = MicroBatchRunner(model, loss_fn=injector)
    runner.chunk_size = 4
    loss = runner.run(*_batch())
    # Chunk [0, 4) fitted; [4, 8) failed once and was redone as [4, 6) and [6, 8).
    assert injector.calls == [4, 4, 2, 2]
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _assert_same_grads(_grads(model), want_grads, rtol=1e-5, atol=1e-7)


def test_with_a_memory_cap_checkpointing_comes_before_smaller_batches(caplog) -> None:
    model = build_model("gpt", SMALL, seed=0)
    injector = FaultInjector(model, fail_at=1)
    runner = MicroBatchRunner(model, fit_memory=True, loss_fn=injector)
    with caplog.at_level(logging.WARNING):
        runner.run(*_batch())
    assert runner.checkpointing and runner.chunk_size is None and injector.calls == [8, 8]
    assert "retrying with activation checkpointing on" in caplog.text


def test_one_sample_that_does_not_fit_is_a_clear_error_and_other_errors_pass_through() -> None:
    model = build_model("gpt", SMALL, seed=0)
    runner = MicroBatchRunner(model, loss_fn=FaultInjector(model, max_batch=0))
    with pytest.raises(MemoryError, match="one sample does not fit"):
        runner.run(*_batch(2))
    broken = MicroBatchRunner(
        model, loss_fn=FaultInjector(model, max_batch=0, error=lambda n: ValueError("bad"))
    )
    with pytest.raises(ValueError, match="bad"):
        broken.run(*_batch(2))


def test_out_of_memory_is_recognized_and_peak_memory_is_measured() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes. Failed to allocate"
        )
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(
        ValueError("out of memory")
    )
    before = peak_memory_bytes("cpu")
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    block.add_(1)
    assert peak_memory_bytes("cpu") >= max(before, 64 << 20)


def test_join_takes_activation_checkpointing_and_a_memory_cap_as_flags() -> None:
    from peer.cli import build_parser
    from peer.config import PeerConfig
    from swarm.cliargs import config_from_args

    args = build_parser().parse_args(
        ["join", "--coordinator", "127.0.0.1:9", "--activation-checkpointing", "--max-gpu-memory", "6"]
    )
    config = config_from_args(PeerConfig, args)
    assert config.activation_checkpointing and config.max_gpu_memory == 6
    default = config_from_args(
        PeerConfig, build_parser().parse_args(["join", "--coordinator", "127.0.0.1:9"])
    )
    assert not default.activation_checkpointing
