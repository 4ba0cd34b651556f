"""Checks on a model and optimizer that a researcher's own code built, before they join a run's state.

Every peer of a run holds the same state bit for bit, so a model built outside the registry must have
exactly the tensors of the run's model (``external`` runs declare them, see ``swarm.models.external``),
and the optimizer must be the one the run names, configured as the run configures it, on torch's
single-tensor code path: ``foreach`` and ``fused`` kernels may be chosen per device and sum in another
order, so two peers given the same averaged gradient would step to different bits.

Example::

    check_own_model(run, model, optimizer)  # ConfigError: optimizer param group 0: 'weight_decay' is 0.0 ...
"""

from __future__ import annotations

import torch

from protocols.errors import ConfigError
from swarm.config import RunConfig
from swarm.models import build_model, check_layout
from swarm.training.state import build_optimizer

# Hyperparameters the collaboration sets itself at every step (the run's schedule) or that name no value.
_SET_BY_THE_RUN = {"lr", "initial_lr", "params"}
# Switches that pick kernels per device: the same gradient must give the same bits on every peer.
_KERNEL_SWITCHES = ("foreach", "fused")


def check_own_model(run: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``model`` or ``optimizer`` unless they hold and step the state of ``run`` like every peer's,
    with a ConfigError that names the first tensor, group or setting that differs and why it matters."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"collaborate: the model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"collaborate: the optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    what = f"the model of run {run.run_id!r} ({run.model.name!r})"
    reference = build_model(run.model.name, run.model.config, seed=run.training.seed)
    try:
        check_layout(model, reference, what)
    except ConfigError as e:
        raise ConfigError(f"collaborate: {e}") from None
    check_optimizer(run, model, optimizer)


def check_optimizer(run: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that is not ``build_optimizer(model, run.optimizer)`` in all but the learning rate."""
    expected = build_optimizer(model, run.optimizer)
    section = "inner optimizer ([optimizer])" if run.training.sync == "diloco" else "optimizer ([optimizer])"
    if type(optimizer) is not type(expected):
        raise ConfigError(
            f"collaborate: the optimizer is {type(optimizer).__name__}; run {run.run_id!r}'s {section} is "
            f"{type(expected).__name__} ({run.optimizer.name!r}); pass optimizer=None to have it built"
        )
    for index, group in enumerate(optimizer.param_groups):
        for switch in _KERNEL_SWITCHES:
            if group.get(switch):
                raise ConfigError(
                    f"collaborate: optimizer param group {index} has {switch}=True: those kernels may differ "
                    f"from device to device, and peers given the same gradient would step to different "
                    f"bits; build it with {switch}=False (or pass optimizer=None)"
                )
    if len(optimizer.param_groups) != len(expected.param_groups):
        raise ConfigError(
            f"collaborate: the optimizer has {len(optimizer.param_groups)} param groups; run "
            f"{run.run_id!r}'s has {len(expected.param_groups)} (weight decay on tensors of 2 or more "
            "dimensions only); pass optimizer=None to have it built"
        )
    for index, (mine, theirs) in enumerate(zip(optimizer.param_groups, expected.param_groups, strict=True)):
        if [id(p) for p in mine["params"]] != [id(p) for p in theirs["params"]]:
            raise ConfigError(
                f"collaborate: optimizer param group {index} holds other parameters than run "
                f"{run.run_id!r}'s (weight decay on tensors of 2 or more dimensions only, in the model's "
                "order); pass optimizer=None to have it built"
            )
        for key in sorted((mine.keys() | theirs.keys()) - _SET_BY_THE_RUN):
            if key in _KERNEL_SWITCHES:
                continue
            if _normal(mine.get(key)) != _normal(theirs.get(key)):
                raise ConfigError(
                    f"collaborate: optimizer param group {index}: {key!r} is {mine.get(key)!r}; run "
                    f"{run.run_id!r}'s {section} sets {theirs.get(key)!r}"
                )


def _normal(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


__all__ = ["check_optimizer", "check_own_model"]
