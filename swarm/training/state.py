"""The training state every peer holds bit for bit: optimizer, learning rate, flat tensors, hashes, encoding.

Every peer applies the same averaged gradient with the same optimizer code path, so model and optimizer
state stay bit-identical across the swarm. A peer that joins late downloads the state as one safetensors
blob (:func:`encode_state` / :func:`decode_state`), checks it against the :func:`state_hash` other peers
report, and copies it in with :func:`load_state_tensors`, which validates everything before it writes.

The learning rate is a pure function of the global step (:func:`learning_rate`), so it needs no state
transfer and no torch scheduler object.

Example::

    model = build_model("gpt", {"n_layer": 2}, seed=0)
    optimizer = build_optimizer(model, run.optimizer)
    tensors = state_tensors(model, optimizer)
    blob = encode_state(step, tensors, {"run_id": run.run_id})
    decoded = decode_state(blob, max_bytes=1 << 30)   # on the joining peer
    load_state_tensors(model, optimizer, decoded.tensors)
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from protocols.errors import MessageTooLarge, ProtocolError
from swarm.config import OptimizerConfig, OuterOptimizerConfig, RunConfig
from swarm.training.optimizers import Lamb, Lars

__all__ = [
    "DecodedState",
    "build_optimizer",
    "build_outer_optimizer",
    "build_shared_optimizer",
    "clip_gradients",
    "decode_state",
    "encode_state",
    "ensure_optimizer_state",
    "learning_rate",
    "load_state_tensors",
    "params_hash",
    "set_learning_rate",
    "state_hash",
    "state_tensors",
]

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
#: Metadata keys that :func:`encode_state` writes itself.
STEP_KEY = "step"
HASH_KEY = "state_hash"
FORMAT_KEY = "format"
STATE_FORMAT = "swarm-state-v1"

_MAX_STEP = 2**63 - 1
_STEP_PATTERN = re.compile(r"^(0|[1-9][0-9]{0,18})$")
_HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# Optimizer state that must never be negative: a negative second moment would make sqrt() NaN.
_NON_NEGATIVE_STATE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq"})


# --- optimizer and learning rate -------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of ``config`` over ``model``'s parameters, on the single-tensor code path.

    Matrices and embeddings (``ndim >= 2``) get ``weight_decay``; biases and norm gains get none, as in
    GPT-2 practice. The learning rate starts at ``learning_rate(config, 0)``.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, config.weight_decay), (no_decay, 0.0))
        if params
    ]
    if not groups:
        raise ValueError("the model has no trainable parameters")
    lr = learning_rate(config, 0)
    # foreach=False and fused=False: the same per-tensor kernels on every peer, whatever torch would pick.
    if config.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
        return cls(groups, lr=lr, betas=config.betas, foreach=False, fused=False)
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=config.momentum, foreach=False, fused=False)
    if config.name == "lamb":
        return Lamb(groups, lr=lr, betas=config.betas, eps=config.eps, max_trust_ratio=config.max_trust_ratio)
    if config.name == "lars":
        return Lars(
            groups,
            lr=lr,
            momentum=config.momentum,
            trust_coefficient=config.trust_coefficient,
            max_trust_ratio=config.max_trust_ratio,
        )
    raise ValueError(f"unknown optimizer {config.name!r}")


def build_outer_optimizer(model: torch.nn.Module, config: OuterOptimizerConfig) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer over ``model``'s parameters: Nesterov SGD on the averaged pseudo-gradient,
    on the single-tensor code path, its momentum created at once (the shared state has a fixed shape)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, foreach=False, fused=False
    )
    ensure_optimizer_state(model, optimizer)
    return optimizer


def build_shared_optimizer(model: torch.nn.Module, run: RunConfig) -> torch.optim.Optimizer:
    """The optimizer whose state, with ``model``'s, every peer of ``run`` holds bit for bit: the run's
    optimizer, or with ``training.sync = "diloco"`` the outer optimizer (the inner one stays local)."""
    if run.training.sync == "diloco":
        return build_outer_optimizer(model, run.outer_optimizer)
    return build_optimizer(model, run.optimizer)


def learning_rate(config: OptimizerConfig, step: int) -> float:
    """The learning rate at global ``step``: linear warmup, then constant or a decay to the floor.

    Warmup rises as ``lr * (step + 1) / (warmup_steps + 1)`` and reaches ``lr`` at ``warmup_steps``;
    cosine and linear then decay to ``lr * min_lr_ratio`` at ``total_steps`` and stay there. The
    result is bit-identical on every machine (no libm calls).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    peak = config.lr
    if step < config.warmup_steps:
        return peak * (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return peak
    floor = peak * config.min_lr_ratio
    if step >= config.total_steps:
        return floor
    progress = (step - config.warmup_steps) / (config.total_steps - config.warmup_steps)
    if config.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + _cos_pi(progress))


def _cos_pi(x: float) -> float:
    """cos(pi * x) for x in [0, 1] from + and * only.

    math.cos comes from the C library, which may differ by an ulp between platforms; peers on different
    systems must still compute the same learning rate bit for bit.
    """
    sign = 1.0
    if x > 0.5:  # cos(pi x) = -cos(pi (1 - x)) keeps the argument in [0, pi/2]
        x, sign = 1.0 - x, -1.0
    t = math.pi * x
    t2 = t * t
    term, total = 1.0, 1.0
    for k in range(1, 14):  # |t| <= pi/2: the 13th term is below 1e-22
        term = -term * t2 / ((2 * k - 1) * (2 * k))
        total += term
    return sign * total


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning rate must be finite and >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> float:
    """Clip the gradients of ``model`` to a total L2 norm of ``max_norm`` (None: leave them); the norm before.

    Uses the single-tensor code path, like the optimizer, so every peer clips the same bits the same way.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None:
        norms = torch.stack([torch.linalg.vector_norm(p.grad.detach(), 2.0) for p in params])
        return float(torch.linalg.vector_norm(norms, 2.0))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))


def flat_mean_gradient(params: list[torch.nn.Parameter], samples: int) -> torch.Tensor:
    """The accumulated gradients of ``params`` (sums over ``samples``) as one flat CPU vector of means."""
    return flat_mean([p.grad for p in params], params, samples)


def flat_mean(
    sums: list[torch.Tensor | None], params: list[torch.nn.Parameter], samples: int
) -> torch.Tensor:
    """Gradient sums over ``samples`` (one per parameter of ``params``, None: zero) as a flat CPU vector of means."""
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(sums, params, strict=True)]
    return torch.cat([g.detach().flatten().cpu() for g in grads]) / max(samples, 1)


def set_flat_gradient(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set each parameter's gradient to its slice of ``flat``, on the parameter's device and dtype."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype).clone()
        offset += p.numel()


def apply_flat_gradient(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    step: int,
    averaged: torch.Tensor,
) -> None:
    """One optimizer step with a round's averaged flat gradient: onto each parameter's device, clipped,
    at the learning rate of ``step``. Every peer given the same bits takes the same step."""
    set_flat_gradient(params, averaged)
    clip_gradients(model, config.grad_clip_norm)
    set_learning_rate(optimizer, learning_rate(config, step))
    optimizer.step()


def ensure_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create every missing per-parameter optimizer state, exactly as the optimizer's first step would.

    A fresh peer then holds the same set of tensors as one that has trained, and its next step is
    bit-identical to the first step of an optimizer that never had this called. Existing state is kept.
    Supports Adam, AdamW, SGD, LAMB and LARS.
    """
    _parameter_names(model, optimizer)  # every optimized parameter must belong to the model
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state[p]
            if state:
                continue
            if isinstance(optimizer, (Lamb, Lars)):
                state.update(optimizer.initial_state(p))
            elif isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam subclass
                state.update(_adam_initial_state(p, group))
            elif isinstance(optimizer, torch.optim.SGD):
                if group["momentum"] != 0:
                    # SGD's first step stores a copy of the gradient. -0.0 is the one exact additive
                    # identity (+0.0 would turn a -0.0 gradient into +0.0), so momentum * buf + grad on this
                    # buffer gives the same bits as that copy.
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format).neg_()
            else:
                raise TypeError(f"ensure_optimizer_state does not know {type(optimizer).__name__}")


def _adam_initial_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    # Mirrors torch.optim.Adam._init_group.
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if group["capturable"] or group["fused"]:
        fused_dtype = torch.float32 if group["fused"] else scalar_dtype
        step = torch.zeros((), dtype=fused_dtype, device=p.device)
    else:
        step = torch.tensor(0.0, dtype=scalar_dtype, device="cpu")
    state = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


# --- flat state ------------------------------------------------------------------------------------


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} not in the model"
                )
    return names


def _live_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's and optimizer's own tensors by flat name, sorted (not copies)."""
    ensure_optimizer_state(model, optimizer)
    live: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied weights appear once, under their first name
        live[MODEL_PREFIX + name] = p
    persistent = model.state_dict(keep_vars=True).keys()
    for name, b in model.named_buffers():
        if name in persistent:
            live[MODEL_PREFIX + name] = b
    names = _parameter_names(model, optimizer)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            flat = f"{OPTIM_PREFIX}{names[id(p)]}/{key}"
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {flat} is a {type(value).__name__}, not a tensor")
            live[flat] = value
    return dict(sorted(live.items()))


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A snapshot of the full training state as ``name -> CPU contiguous tensor``, sorted by name.

    Names are ``model/<parameter or persistent buffer>`` and ``optim/<parameter>/<state key>`` (such as
    ``optim/blocks.0.mlp.fc.weight/exp_avg``); scalar state like Adam's ``step`` is a 0-d tensor of its
    own dtype. Missing optimizer state is created first (:func:`ensure_optimizer_state`). The tensors are
    copies: later steps do not change them.
    """
    return {
        name: t.detach().to("cpu", copy=True).contiguous()
        for name, t in _live_tensors(model, optimizer).items()
    }


def load_state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Copy a state from :func:`state_tensors` (possibly received from the network) into model and optimizer.

    Everything is checked before anything is written: the exact set of names, and each tensor's dtype,
    shape, finiteness and sign where it matters. A ProtocolError names the first offending tensor and
    leaves the model and optimizer as they were (missing optimizer state is still created first).
    """
    live = _live_tensors(model, optimizer)
    if not isinstance(tensors, Mapping):
        raise ProtocolError(f"state must be a mapping of names to tensors, got {type(tensors).__name__}")
    missing = sorted(set(live) - set(tensors))
    if missing:
        raise ProtocolError(f"state is missing tensor {missing[0]!r}" + _and_more(missing))
    unexpected = sorted(set(tensors) - set(live), key=str)
    if unexpected:
        raise ProtocolError(f"state has unexpected tensor {unexpected[0]!r}" + _and_more(unexpected))
    for name, target in live.items():
        _check_tensor(name, tensors[name], target)
    with torch.no_grad():
        for name, target in live.items():
            target.copy_(tensors[name])


def _and_more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _check_tensor(name: str, value: object, target: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise ProtocolError(f"state tensor {name!r} is a {type(value).__name__}, not a tensor")
    if value.dtype != target.dtype:
        raise ProtocolError(f"state tensor {name!r} has dtype {value.dtype}, expected {target.dtype}")
    if value.shape != target.shape:
        raise ProtocolError(
            f"state tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
        )
    if value.layout != torch.strided:
        raise ProtocolError(f"state tensor {name!r} is not a dense tensor")
    if value.numel() == 0 or not (value.is_floating_point() or value.is_complex()):
        return
    # min and max are NaN if any value is, and infinite if any value is: one pass, no boolean mask
    # (torch.isfinite(value).all() is ten times slower on CPU).
    low, high = torch.aminmax(torch.view_as_real(value) if value.is_complex() else value)
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        raise ProtocolError(f"state tensor {name!r} has non-finite values")
    key = name.rsplit("/", 1)[1] if name.startswith(OPTIM_PREFIX) else None
    if key in _NON_NEGATIVE_STATE and float(low) < 0:
        raise ProtocolError(f"state tensor {name!r} has negative values")


# --- hashes ----------------------------------------------------------------------------------------


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _update(h: hashlib._Hash, name: str, t: torch.Tensor) -> None:
    # Every field is length-prefixed, so no two different states can frame to the same byte string.
    encoded = name.encode()
    dtype = str(t.dtype).encode()
    data = _raw_bytes(t)
    h.update(struct.pack("<Q", len(encoded)) + encoded)
    h.update(struct.pack("<Q", len(dtype)) + dtype)
    h.update(struct.pack(f"<Q{t.dim()}Q", t.dim(), *t.shape))
    h.update(struct.pack("<Q", data.nbytes))
    h.update(data)


def params_hash(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of the model's parameters: name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256(b"swarm-params-v1\0")
    for name, p in sorted(model.named_parameters()):
        _update(h, name, p)
    return h.hexdigest()


def state_hash(step: int, tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a training state: the step, then each tensor's name, dtype, shape and raw bytes
    in sorted name order. Peers that agree bit for bit report the same hash.
    """
    _check_step(step)
    h = hashlib.sha256(b"swarm-state-v1\0")
    h.update(struct.pack("<q", step))
    for name in sorted(tensors):
        _update(h, name, tensors[name])
    return h.hexdigest()


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an integer in [0, 2**63), got {step!r}")


# --- wire encoding ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedState:
    """A state received from the network whose tensors match the hash in its own metadata.

    That hash must still be compared with the one honest peers report: a sender can hash anything.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    state_hash: str


def encode_state(step: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """Serialize a state to safetensors bytes; the metadata gains ``step``, ``state_hash`` and ``format``."""
    _check_step(step)
    reserved = {STEP_KEY, HASH_KEY, FORMAT_KEY} & set(metadata)
    if reserved:
        raise ValueError(f"metadata key {sorted(reserved)[0]!r} is reserved")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")
    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    full = {
        **metadata,
        STEP_KEY: str(step),
        HASH_KEY: state_hash(step, plain),
        FORMAT_KEY: STATE_FORMAT,
    }
    return save_safetensors(plain, metadata=full)


def decode_state(data: bytes | bytearray | memoryview, *, max_bytes: int) -> DecodedState:
    """Parse and verify bytes from :func:`encode_state`; a ProtocolError says what is wrong.

    Refuses input over ``max_bytes`` (MessageTooLarge), anything that is not valid safetensors, a
    missing or invalid step or hash, and tensors that do not hash to the ``state_hash`` in the metadata.
    No pickle is involved: safetensors holds only a JSON header and raw buffers.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"state must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise MessageTooLarge(f"state of {size} bytes exceeds the limit of {max_bytes} bytes")
    data = bytes(data)
    try:
        tensors = load_safetensors(data)  # a JSON header and raw buffers: nothing here can run code
        metadata = _read_metadata(data)
    except Exception as e:  # untrusted bytes: whatever the parser raises means the blob is malformed
        raise ProtocolError(f"state is not a valid safetensors blob: {e}") from None
    if metadata.get(FORMAT_KEY) != STATE_FORMAT:
        raise ProtocolError(f"state format is {metadata.get(FORMAT_KEY)!r}, expected {STATE_FORMAT!r}")
    raw_step = metadata.get(STEP_KEY)
    if raw_step is None:
        raise ProtocolError("state metadata has no step")
    if not _STEP_PATTERN.match(raw_step) or int(raw_step) > _MAX_STEP:
        raise ProtocolError(f"state metadata has an invalid step {raw_step[:40]!r}")
    step = int(raw_step)
    claimed = metadata.get(HASH_KEY)
    if claimed is None or not _HASH_PATTERN.match(claimed):
        raise ProtocolError("state metadata has no valid state_hash")
    actual = state_hash(step, tensors)
    if actual != claimed:
        raise ProtocolError(
            f"state hash mismatch: the metadata says {claimed}, the tensors and step hash to {actual}"
        )
    return DecodedState(
        step=step, tensors=dict(sorted(tensors.items())), metadata=metadata, state_hash=actual
    )


def _read_metadata(data: bytes) -> dict[str, str]:
    # load_safetensors has already validated the framing; it does not return the metadata.
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + length], object_pairs_hook=_no_duplicate_keys)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("__metadata__ must map strings to strings")
    return metadata


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in the header")
    return result
