"""One micro-batch's forward and backward on a peer's own device: precision, checkpointing, memory.

:class:`MicroBatchRunner` adds the gradient of the micro-batch's summed loss to each parameter's
``.grad`` (fp32, whatever the compute precision), the way the trainer accumulates towards a global batch.
It runs the micro-batch in chunks of ``chunk_size`` samples; the sum over chunks is the same gradient,
so the chunk size is this peer's own business and never changes what it contributes.

When a chunk runs out of memory the runner logs it, turns on activation checkpointing first (when
``fit_memory`` is set, as ``--max-gpu-memory`` does, and the model declares its blocks), then halves the
chunk and carries on from that chunk: each chunk's gradient is added only once its backward has
finished, so nothing is counted twice or lost. Only a single sample that does not fit ends the step.

Example::

    runner = MicroBatchRunner(model, device="cuda", precision="bf16", fit_memory=True)
    loss = runner.run(inputs, targets)      # mean loss; gradients of the sum are in p.grad
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from swarm.models.checkpointing import set_activation_checkpointing, supports_activation_checkpointing
from swarm.training.memory import is_out_of_memory, peak_memory_bytes
from swarm.training.precision import LossScaler, autocast, check_precision

logger = logging.getLogger(__name__)

__all__ = ["MicroBatchRunner"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MicroBatchRunner:
    """Forward and backward of one micro-batch on ``device`` in ``precision`` (``check_precision`` says
    which a device supports), adding the gradient of the summed loss to ``model``'s parameters, in
    chunks that shrink when memory runs out (see the module docstring); optionally with activation
    checkpointing from the start, and a ``loss_fn`` other than the model's own ``loss``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str = "cpu",
        precision: str = "fp32",
        activation_checkpointing: bool = False,
        fit_memory: bool = False,
        loss_fn: LossFn | None = None,
    ) -> None:
        check_precision(precision, device)
        self.model, self.device, self.precision = model, device, precision
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else model.loss
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fit_memory = fit_memory
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.chunk_size: int | None = None  # None: the whole micro-batch at once
        self.out_of_memory_events = 0
        self.checkpointing = False
        if activation_checkpointing:
            if supports_activation_checkpointing(model):
                self.checkpointing = set_activation_checkpointing(model, True) > 0
            else:
                logger.warning(
                    f"activation checkpointing ignored: model {type(model).__name__} declares no blocks"
                )

    def evaluation(self):  # noqa: ANN201 - a context manager
        """The context for a forward pass without gradients, in the run's precision."""
        return autocast(self.precision, self.device)

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes(self.device)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Add the gradient of the summed loss over ``inputs``/``targets`` to ``.grad``; the mean loss."""
        total = inputs.shape[0]
        done, loss_sum = 0, 0.0
        while done < total:
            size = min(self.chunk_size or total, total - done)
            try:
                loss_sum += self._chunk(inputs[done : done + size], targets[done : done + size])
            except Exception as e:  # noqa: BLE001 - anything but running out of memory is re-raised
                if not is_out_of_memory(e):
                    raise
                message = str(e).splitlines()[0] if str(e) else type(e).__name__
            else:
                done += size
                continue
            self._shrink(size, message)  # outside the handler: the failed graph is freed by now
        return loss_sum / max(total, 1)

    def _chunk(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        count = inputs.shape[0]
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        while True:
            with autocast(self.precision, self.device):
                loss = self.loss_fn(inputs, targets)
            # The gradient of the sum: the trainer divides by the sample count when it averages.
            grads = torch.autograd.grad(
                loss.float() * (count * self.scaler.scale), self.params, allow_unused=True
            )
            if not self.scaler.found_overflow(grads):
                break
        with torch.no_grad():
            for p, g in zip(self.params, grads, strict=True):
                if g is None:
                    continue
                if self.scaler.enabled:
                    g = g / self.scaler.scale  # a power of two: exact
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return float(loss.detach()) * count

    def _shrink(self, size: int, message: str) -> None:
        self.out_of_memory_events += 1
        if self.device != "cpu" and torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        if self.fit_memory and not self.checkpointing and supports_activation_checkpointing(self.model):
            self.checkpointing = set_activation_checkpointing(self.model, True) > 0
            logger.warning(
                f"out of memory at {size} samples per forward/backward ({message}); "
                "retrying with activation checkpointing on"
            )
            return
        if size <= 1:
            raise MemoryError(
                f"one sample does not fit in memory on {self.device} ({message}): this device is too "
                "small for the run's model; try --activation-checkpointing or another device"
            )
        self.chunk_size = size // 2
        logger.warning(
            f"out of memory at {size} samples per forward/backward ({message}); "
            f"retrying with {self.chunk_size}"
        )
