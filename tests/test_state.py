"""Training state: peers agree bit for bit, state transfer verifies and refuses tampering, checkpoints."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import safetensors.torch
import torch

from protocols.errors import ConfigError, MessageTooLarge, ProtocolError
from swarm.config import OptimizerConfig, RunConfig
from swarm.models import build_model
from swarm.training import (
    build_optimizer,
    clip_gradients,
    decode_state,
    encode_state,
    ensure_optimizer_state,
    latest_checkpoint,
    learning_rate,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    load_state_tensors,
    params_hash,
    save_checkpoint,
    set_learning_rate,
    state_hash,
    state_tensors,
)
from swarm.training.state import _cos_pi

pytestmark = pytest.mark.timeout(60)

TINY = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 16}
OPTIMIZERS = ["adamw", "adam", "sgd"]


def _config(name: str = "adamw", **overrides) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=1e-2, warmup_steps=2, total_steps=10, **overrides)


def _peer(config: OptimizerConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model("gpt", TINY, seed=0)
    return model, build_optimizer(model, config)


def _gradient(seed: int) -> dict[str, torch.Tensor]:
    """A real gradient of the tiny model on a seeded batch, with signed zeros planted in it."""
    model = build_model("gpt", TINY, seed=seed)
    ids = torch.randint(0, 256, (2, TINY["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for g in grads.values():
        # -0.0 and +0.0 are equal but hash differently: the optimizer must treat them the same everywhere.
        g.view(-1)[0] = -0.0
        g.view(-1)[-1] = 0.0
    return grads


def _train_step(model, optimizer, config: OptimizerConfig, step: int, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    clip_gradients(model, config.grad_clip_norm)
    set_learning_rate(optimizer, learning_rate(config, step))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], step: int) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    assert state_hash(step, a) == state_hash(step, b)


# --- peers agree ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_peers_take_bit_identical_steps(name: str) -> None:
    config = _config(name)
    fresh_model, fresh_opt = _peer(config)
    ensured_model, ensured_opt = _peer(config)
    # One peer materializes its state up front (as a peer that downloads state does), the other lets
    # torch create it lazily in its first step: their steps must still agree bit for bit.
    ensure_optimizer_state(ensured_model, ensured_opt)
    start = params_hash(fresh_model)
    assert params_hash(ensured_model) == start
    for step in range(3):
        grads = _gradient(seed=100 + step)
        _train_step(fresh_model, fresh_opt, config, step, grads)
        _train_step(ensured_model, ensured_opt, config, step, grads)
        _assert_same_state(
            state_tensors(fresh_model, fresh_opt), state_tensors(ensured_model, ensured_opt), step
        )
    assert params_hash(fresh_model) == params_hash(ensured_model) != start


def test_ensure_creates_the_state_a_trained_peer_has() -> None:
    for name in OPTIMIZERS:
        config = _config(name)
        trained_model, trained_opt = _peer(config)
        _train_step(trained_model, trained_opt, config, 0, _gradient(seed=1))
        fresh_model, fresh_opt = _peer(config)
        ensure_optimizer_state(fresh_model, fresh_opt)
        trained = state_tensors(trained_model, trained_opt)
        fresh = state_tensors(fresh_model, fresh_opt)
        assert list(trained) == list(fresh), name
        for key in trained:
            assert (trained[key].dtype, trained[key].shape) == (fresh[key].dtype, fresh[key].shape), key


def test_state_tensors_names_and_layout() -> None:
    model, optimizer = _peer(_config("adamw"))
    tensors = state_tensors(model, optimizer)
    assert list(tensors) == sorted(tensors)
    assert "model/embed.token.weight" in tensors
    # The output projection is tied to the token embedding: it is one tensor, stored once.
    assert "model/head.proj.weight" not in tensors
    assert tensors["optim/blocks.0.mlp.fc.weight/exp_avg"].shape == (128, 32)
    step = tensors["optim/blocks.0.mlp.fc.weight/step"]
    assert step.dim() == 0 and step.dtype == torch.float32
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    n_params = len(list(model.parameters()))
    assert len(tensors) == n_params * 4  # the parameter, step, exp_avg, exp_avg_sq
    # A snapshot: training on does not change it.
    before = state_hash(0, tensors)
    _train_step(model, optimizer, _config("adamw"), 0, _gradient(seed=1))
    assert state_hash(0, tensors) == before


def test_sgd_without_momentum_has_no_optimizer_state() -> None:
    model, optimizer = _peer(_config("sgd", momentum=0.0))
    assert all(name.startswith("model/") for name in state_tensors(model, optimizer))


def test_weight_decay_skips_biases_and_norms() -> None:
    model, optimizer = _peer(_config("adamw", weight_decay=0.1))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), name


# --- state transfer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_round_trip_then_training_continues_identically(name: str) -> None:
    config = _config(name)
    source_model, source_opt = _peer(config)
    for step in range(2):
        _train_step(source_model, source_opt, config, step, _gradient(seed=step))
    tensors = state_tensors(source_model, source_opt)
    data = encode_state(2, tensors, {"run_id": "test-run"})

    decoded = decode_state(data, max_bytes=len(data))
    assert decoded.step == 2
    assert decoded.metadata["run_id"] == "test-run"
    assert decoded.state_hash == state_hash(2, tensors)

    joiner_model, joiner_opt = _peer(config)  # a fresh peer: untrained, optimizer state not yet created
    load_state_tensors(joiner_model, joiner_opt, decoded.tensors)
    assert state_hash(2, state_tensors(joiner_model, joiner_opt)) == decoded.state_hash
    assert params_hash(joiner_model) == params_hash(source_model)

    grads = _gradient(seed=7)
    _train_step(source_model, source_opt, config, 2, grads)
    _train_step(joiner_model, joiner_opt, config, 2, grads)
    _assert_same_state(state_tensors(source_model, source_opt), state_tensors(joiner_model, joiner_opt), 3)


def _encoded(step: int = 1) -> tuple[bytes, dict[str, torch.Tensor]]:
    config = _config("adamw")
    model, optimizer = _peer(config)
    _train_step(model, optimizer, config, 0, _gradient(seed=3))
    tensors = state_tensors(model, optimizer)
    return encode_state(step, tensors, {}), tensors


def test_flipped_byte_fails_the_hash() -> None:
    data, _ = _encoded()
    tampered = bytearray(data)
    tampered[-1] ^= 0x01  # the last byte of the last tensor's raw data
    with pytest.raises(ProtocolError, match="hash mismatch"):
        decode_state(bytes(tampered), max_bytes=len(data))


def test_relabelled_step_fails_the_hash() -> None:
    data, tensors = _encoded(step=5)
    metadata = dict(decode_state(data, max_bytes=len(data)).metadata)
    metadata["step"] = "500"  # an old state passed off as a newer one
    with pytest.raises(ProtocolError, match="hash mismatch"):
        decode_state(safetensors.torch.save(tensors, metadata=metadata), max_bytes=len(data) * 2)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (None, "no step"),
        ("-1", "invalid step"),
        ("1e3", "invalid step"),
        ("01", "invalid step"),
        ("9" * 30, "invalid step"),
    ],
)
def test_missing_or_invalid_step_refused(step: str | None, message: str) -> None:
    data, tensors = _encoded()
    metadata = dict(decode_state(data, max_bytes=len(data)).metadata)
    if step is None:
        del metadata["step"]
    else:
        metadata["step"] = step
    with pytest.raises(ProtocolError, match=message):
        decode_state(safetensors.torch.save(tensors, metadata=metadata), max_bytes=len(data) * 2)


def test_missing_hash_refused() -> None:
    data, tensors = _encoded()
    metadata = dict(decode_state(data, max_bytes=len(data)).metadata)
    del metadata["state_hash"]
    with pytest.raises(ProtocolError, match="state_hash"):
        decode_state(safetensors.torch.save(tensors, metadata=metadata), max_bytes=len(data) * 2)


def test_oversized_state_refused() -> None:
    data, _ = _encoded()
    with pytest.raises(MessageTooLarge, match="exceeds"):
        decode_state(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x00" * 8,
        b"not a safetensors blob at all",
        (2**63).to_bytes(8, "little") + b"{}",
        b"\x02\x00\x00\x00\x00\x00\x00\x00{}",  # valid, but no metadata: not a state
        "text, not bytes",
    ],
)
def test_garbage_refused(garbage) -> None:
    with pytest.raises(ProtocolError):
        decode_state(garbage, max_bytes=1 << 20)


def test_truncated_state_refused() -> None:
    data, _ = _encoded()
    with pytest.raises(ProtocolError, match="not a valid safetensors"):
        decode_state(data[: len(data) // 2], max_bytes=len(data))


def _wrong_shape(t: dict, name: str) -> None:
    t[name] = t[name][..., :-1].clone()


def _wrong_dtype(t: dict, name: str) -> None:
    t[name] = t[name].double()


def _missing(t: dict, name: str) -> None:
    del t[name]


def _nan(t: dict, name: str) -> None:
    t[name] = t[name].clone()
    t[name].view(-1)[-1] = math.nan


def _inf(t: dict, name: str) -> None:
    t[name] = t[name].clone()
    t[name].view(-1)[0] = -math.inf


def _negative_second_moment(t: dict, name: str) -> None:
    t[name] = t[name].clone()
    t[name].view(-1)[0] = -1.0


def _not_a_tensor(t: dict, name: str) -> None:
    t[name] = t[name].tolist()


# Each corruption hits a tensor that sorts late, after most tensors a careless loader would already
# have copied.
LAST_PARAM = "model/head.ln.weight"
LAST_MOMENT = "optim/head.ln.weight/exp_avg_sq"


@pytest.mark.parametrize(
    ("corrupt", "name", "message"),
    [
        (_wrong_shape, LAST_PARAM, "shape"),
        (_wrong_dtype, LAST_MOMENT, "dtype"),
        (_missing, LAST_MOMENT, "missing"),
        (_nan, LAST_PARAM, "non-finite"),
        (_inf, LAST_MOMENT, "non-finite"),
        (_negative_second_moment, LAST_MOMENT, "negative"),
        (_not_a_tensor, LAST_PARAM, "not a tensor"),
    ],
)
def test_bad_state_refused_before_anything_changes(
    corrupt: Callable[[dict, str], None], name: str, message: str
) -> None:
    config = _config("adamw")
    source_model, source_opt = _peer(config)
    _train_step(source_model, source_opt, config, 0, _gradient(seed=5))
    tensors = state_tensors(source_model, source_opt)
    assert name in tensors and list(tensors)[-1].startswith("optim/head.ln")
    corrupt(tensors, name)

    model, optimizer = _peer(config)
    ensure_optimizer_state(model, optimizer)
    before_params, before_state = params_hash(model), state_hash(0, state_tensors(model, optimizer))
    with pytest.raises(ProtocolError, match=message) as caught:
        load_state_tensors(model, optimizer, tensors)
    assert name in str(caught.value)
    assert params_hash(model) == before_params
    assert state_hash(0, state_tensors(model, optimizer)) == before_state


def test_unexpected_tensor_refused_by_name() -> None:
    model, optimizer = _peer(_config("adamw"))
    tensors = state_tensors(model, optimizer)
    tensors["model/backdoor.weight"] = torch.zeros(2)
    with pytest.raises(ProtocolError, match="unexpected tensor 'model/backdoor.weight'"):
        load_state_tensors(model, optimizer, tensors)


def test_state_of_another_optimizer_refused() -> None:
    sgd_model, sgd_opt = _peer(_config("sgd"))
    adam_model, adam_opt = _peer(_config("adamw"))
    with pytest.raises(ProtocolError, match="missing tensor 'optim/.*/exp_avg'"):
        load_state_tensors(adam_model, adam_opt, state_tensors(sgd_model, sgd_opt))


def test_hashes_tell_states_apart() -> None:
    model, optimizer = _peer(_config("adamw"))
    tensors = state_tensors(model, optimizer)
    assert state_hash(0, tensors) != state_hash(1, tensors)
    signed = dict(tensors)
    signed["model/blocks.0.attn.proj.bias"] = tensors["model/blocks.0.attn.proj.bias"].neg()  # zeros -> -0.0
    assert torch.equal(signed["model/blocks.0.attn.proj.bias"], tensors["model/blocks.0.attn.proj.bias"])
    assert state_hash(0, signed) != state_hash(0, tensors)
    other = build_model("gpt", TINY, seed=1)
    assert params_hash(other) != params_hash(model)
    assert len(params_hash(model)) == 64


def test_hashing_the_default_model_with_adamw_state_is_fast() -> None:
    model = build_model("gpt", {}, seed=0)
    tensors = state_tensors(model, build_optimizer(model, OptimizerConfig()))
    assert sum(t.numel() for t in tensors.values()) > 14_000_000
    started = time.perf_counter()
    state_hash(0, tensors)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"state_hash took {elapsed:.2f}s"  # about 0.07s; generous for busy CI machines


# --- learning rate -------------------------------------------------------------------------------------


def test_warmup_rises_from_near_zero_to_lr() -> None:
    config = OptimizerConfig(lr=1e-3, warmup_steps=100, schedule="constant")
    rates = [learning_rate(config, s) for s in range(101)]
    assert 0 < rates[0] < 0.02 * config.lr
    assert all(a < b for a, b in pairwise(rates))
    assert rates[100] == config.lr


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_reaches_the_floor_at_total_steps(schedule: str) -> None:
    config = OptimizerConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1, schedule=schedule)
    floor = config.lr * config.min_lr_ratio
    assert learning_rate(config, 10) == config.lr
    assert learning_rate(config, 60) == pytest.approx((config.lr + floor) / 2, rel=1e-12)
    assert learning_rate(config, 110) == floor
    assert learning_rate(config, 10_000) == floor
    rates = [learning_rate(config, s) for s in range(10, 111)]
    assert all(a > b for a, b in pairwise(rates))


def test_constant_schedule_stays() -> None:
    config = OptimizerConfig(lr=3e-4, warmup_steps=0, schedule="constant", total_steps=5)
    assert {learning_rate(config, s) for s in (0, 1, 5, 10**6)} == {3e-4}


def test_learning_rate_rejects_negative_steps() -> None:
    with pytest.raises(ValueError):
        learning_rate(OptimizerConfig(), -1)


def test_portable_cosine_matches_libm() -> None:
    for i in range(1001):
        x = i / 1000
        assert abs(_cos_pi(x) - math.cos(math.pi * x)) < 1e-15


# --- checkpoints ---------------------------------------------------------------------------------------


def _run_config() -> RunConfig:
    return RunConfig.parse(
        {
            "run_id": "ckpt-test",
            "optimizer": {"name": "sgd", "lr": 0.05},
            "model": {"name": "gpt", "config": TINY},
        }
    )


def _save_three(directory: Path) -> dict[int, dict[str, torch.Tensor]]:
    config = _config("adamw")
    model, optimizer = _peer(config)
    saved = {}
    for step in (10, 20, 30):
        _train_step(model, optimizer, config, step, _gradient(seed=step))
        saved[step] = state_tensors(model, optimizer)
        save_checkpoint(directory, step, saved[step], _run_config(), keep=2)
    return saved


def test_checkpoints_keep_the_newest_and_round_trip(tmp_path: Path) -> None:
    saved = _save_three(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000020.safetensors",
        "ckpt-00000030.safetensors",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000030.safetensors"

    checkpoint = load_checkpoint(tmp_path / "ckpt-00000030.safetensors")
    assert checkpoint.step == 30
    assert checkpoint.run_config == _run_config()
    assert checkpoint.state_hash == state_hash(30, saved[30])
    _assert_same_state(checkpoint.tensors, saved[30], 30)

    model, optimizer = _peer(_config("adamw"))
    load_state_tensors(model, optimizer, checkpoint.tensors)
    assert state_hash(30, state_tensors(model, optimizer)) == checkpoint.state_hash


def test_truncated_newest_checkpoint_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = _save_three(tmp_path)
    newest = tmp_path / "ckpt-00000030.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="swarm.training.checkpoint"):
        checkpoint = load_latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.step == 20
    _assert_same_state(checkpoint.tensors, saved[20], 20)
    assert any(str(newest) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_checkpoint_is_a_config_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    _save_three(tmp_path)
    path = tmp_path / "ckpt-00000030.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupt") as caught:
        load_checkpoint(path)
    assert str(path) in str(caught.value)


def test_missing_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "ckpt-00000001.safetensors")


def test_renamed_checkpoint_refused(tmp_path: Path) -> None:
    _save_three(tmp_path)
    renamed = tmp_path / "ckpt-00000099.safetensors"
    (tmp_path / "ckpt-00000020.safetensors").rename(renamed)
    with pytest.raises(ConfigError, match="holds step 20"):
        load_checkpoint(renamed)


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    assert load_latest_checkpoint(tmp_path) is None
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert list_checkpoints(tmp_path) == []


def test_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    (tmp_path / ".ckpt-crashed.tmp").write_bytes(b"half a checkpoint from a crash")
    model, optimizer = _peer(_config("adamw"))
    path = save_checkpoint(tmp_path, 0, state_tensors(model, optimizer), _run_config(), keep=1)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] == ["ckpt-00000000.safetensors"]


def test_clip_gradients_reports_the_norm_and_clips() -> None:
    model, _ = _peer(_config("adamw"))
    for name, p in model.named_parameters():
        p.grad = _gradient(seed=9)[name] * 100
    norm = clip_gradients(model, None)
    assert norm > 1.0
    assert clip_gradients(model, 1.0) == norm
    assert clip_gradients(model, None) == pytest.approx(1.0, rel=1e-5)
