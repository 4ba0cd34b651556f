"""``SwarmCallback``: a Hugging Face ``transformers.Trainer`` script joins a run through a collaboration.

The ``Trainer`` still runs forward and backward (with its gradient accumulation), but just before its
optimizer step the callback hands the gradient to ``collab.step``, which averages with the run's peers
and applies the run's optimizer when the batch of the run is complete (``swarm.training.collaboration``).
The ``Trainer``'s own optimizer then finds no gradient and changes nothing; its learning-rate schedule
does not reach the run's optimizer, which follows the run's ``[optimizer]`` schedule. The callback stops
training when the run reaches its ``max_steps``.

The ``Trainer`` must not clip the gradient itself (``max_grad_norm=0``): the run clips the averaged
gradient (``[optimizer] grad_clip_norm``), and a peer that clipped its own would send another gradient
than the one it computed. Needs the Hugging Face extra (``pip install -e ".[hf]"``).

Example::

    with swarm.connect(coordinator, identity=identity) as session:
        collab = session.collaborate(model)
        trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=0),
                          train_dataset=data, callbacks=[SwarmCallback(collab)])
        trainer.train()
        collab.finish()
"""

from __future__ import annotations

from typing import Any

from protocols.errors import ConfigError
from swarm.hf_import import import_hf
from swarm.training.collaboration import Collaboration

_transformers = import_hf("transformers", "swarm.training.hf.SwarmCallback")

if not hasattr(_transformers.TrainerCallback, "on_pre_optimizer_step"):
    raise ConfigError(
        f"SwarmCallback needs transformers 4.43 or later (on_pre_optimizer_step); this is "
        f"{_transformers.__version__}: pip install -U 'transformers>=4.43'"
    )


class SwarmCallback(_transformers.TrainerCallback):
    """Hands each optimizer step's gradient to ``collab`` (see the module docstring).

    Args:
        collab: the session's collaboration over the model the ``Trainer`` trains.
        samples_per_step: examples behind one optimizer step of this process; None: the arguments'
            ``per_device_train_batch_size * gradient_accumulation_steps``.
        until_step: stop training once the run reaches this step (None: at the run's ``max_steps``).
    """

    def __init__(
        self, collab: Collaboration, samples_per_step: int | None = None, until_step: int | None = None
    ):
        self.collab, self.samples_per_step, self.until_step = collab, samples_per_step, until_step

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if args.max_grad_norm and args.max_grad_norm > 0:
            raise ConfigError(
                f"SwarmCallback: TrainingArguments.max_grad_norm is {args.max_grad_norm}; set it to 0: the run "
                "clips the averaged gradient ([optimizer] grad_clip_norm), and a peer must send the gradient "
                "it computed"
            )
        if args.fp16:
            raise ConfigError(
                "SwarmCallback: TrainingArguments.fp16 scales the loss, and the gradient handed to the run "
                "would still be scaled; train in fp32 or bf16 (bf16=True), or set the run's precision"
            )
        model = kwargs.get("model")
        if model is not None and model is not self.collab.model:
            raise ConfigError(
                "SwarmCallback: the Trainer trains another model than the one collaborate was given"
            )
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        samples = self.samples_per_step or args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.collab.step(samples=samples)
        if self.collab.finished or (
            self.until_step is not None and self.collab.global_step >= self.until_step
        ):
            control.should_training_stop = True
        return control


__all__ = ["SwarmCallback"]
