"""Mixed precision for the forward and backward pass, with fp32 master weights.

A run sets ``training.precision``: ``fp32``, ``bf16`` or ``fp16``. Only the forward and backward pass
run in the lower precision (``torch.autocast``); parameters, their gradients, the optimizer state and
the averaged gradient stay fp32, so every peer applies the same fp32 step to the same fp32 weights
whatever hardware computed its share of the gradient.

fp16 has too little range for small gradients, so its loss is multiplied by a scale before backward
and the gradients divided by it after (:class:`LossScaler`). The scale moves only by powers of two,
which makes the division exact, and only as a function of the overflows this peer has seen, so a run
replays the same way twice. fp16 autocast needs a GPU: a CPU peer of an fp16 run is refused at join
(:func:`check_precision`); CPU peers use bf16.

Example::

    check_precision(run.training.precision, "cpu")          # ConfigError for fp16
    with autocast(run.training.precision, "cpu"):
        loss = model.loss(inputs, targets)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence

import torch

from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["LossScaler", "autocast", "check_precision", "compute_dtype"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes in for ``precision``."""
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ConfigError(f"training.precision must be one of fp32, bf16, fp16; got {precision!r}") from None


def check_precision(precision: str, device: str | torch.device) -> None:
    """Refuse, with a ConfigError naming ``training.precision``, a precision this device cannot honour."""
    compute_dtype(precision)
    kind = torch.device(device).type
    if precision == "fp16" and kind != "cuda":
        raise ConfigError(
            f"the run sets training.precision = 'fp16', which needs a CUDA GPU, but this peer computes "
            f"on the {kind}: join with --gpu on a machine that has one, or ask the organizer for bf16"
        )
    if precision == "bf16" and kind == "cpu" and cpu_has_native_bf16() is False:
        _warn_slow_bf16()
    if precision == "bf16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"the run sets training.precision = 'bf16', but {torch.cuda.get_device_name(0)} has no bf16 "
            "support: join with --cpu, or ask the organizer for fp16 or fp32"
        )


def cpu_has_native_bf16() -> bool | None:
    """Whether the CPU has bf16 instructions, from /proc/cpuinfo; None where that cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) if flags else None


@functools.cache
def _warn_slow_bf16() -> None:  # once per process: the join and the trainer both check
    logger.warning(
        "the run computes in bf16, but this CPU has no bf16 instructions (avx512_bf16, amx_bf16): "
        "torch's bf16 matrix products run several times slower than fp32 here (docs/benchmarks.md)"
    )


def autocast(precision: str, device: str | torch.device) -> contextlib.AbstractContextManager:
    """A context in which the forward pass (and so its backward) computes in ``precision``."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


class LossScaler:
    """Deterministic dynamic loss scaling for fp16; with ``enabled=False`` a scale of exactly 1.

    The scale halves on every overflow (the micro-batch is then computed again) and doubles after
    ``growth_interval`` clean micro-batches in a row, within ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        enabled: bool,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 200,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.min_scale, self.max_scale = growth_interval, min_scale, max_scale
        self._clean = 0
        self.overflows = 0

    def found_overflow(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether any gradient is non-finite; updates the scale for the next try."""
        if not self.enabled:
            return False
        finite = [torch.isfinite(g).all() for g in grads if g is not None]
        overflow = bool(finite) and not bool(torch.stack(finite).all())  # one device sync, not one per tensor
        if overflow:
            self.overflows += 1
            self._clean = 0
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"the gradient is not finite even at loss scale {self.scale:g}: the model has diverged"
                )
            self.scale = max(self.scale / 2, self.min_scale)
            logger.debug(f"fp16 gradient overflow; loss scale now {self.scale:g}")
        else:
            self._clean += 1
            if self._clean >= self.growth_interval and self.scale < self.max_scale:
                self.scale = min(self.scale * 2, self.max_scale)
                self._clean = 0
        return overflow
