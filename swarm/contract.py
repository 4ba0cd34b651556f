"""What a run's model, model config and dataset must offer, written as typed protocols and checked.

Every trainer, validator and checkpoint reader uses a registered model and dataset through these few
members only. :func:`swarm.models.build_model` and :func:`swarm.data.build_dataset` check what a factory
returns against them, so a plugin that misses one fails where it is built, with a ConfigError naming
the member, not deep inside a training round.

Determinism is part of the contract but cannot be checked by looking at an object: a model factory draws
every initial value from the generator it is given, ``loss`` draws nothing from a random generator
(no dropout), and ``sample_batch`` is a pure function of its arguments and the files it was built from,
so that peers stay bit-identical and anyone can recompute any peer's batch from its public seed.

Example::

    from swarm.contract import check_dataset
    check_dataset(my_dataset, "dataset 'mine'")  # ConfigError: ... has no method 'validation_batches'
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from protocols.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class ModelConfig(Protocol):
    """The typed config of a registered model: at least the longest sequence it takes."""

    seq_len: int


@runtime_checkable
class TrainableModel(Protocol):
    """A ``torch.nn.Module`` whose ``loss`` is the mean next-token loss of ``inputs`` against ``targets``.

    ``inputs`` and ``targets`` are int64 ``[batch, seq_len]`` tensors as a dataset's ``sample_batch``
    gives them (targets are inputs shifted by one position); the result is a scalar tensor.
    """

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Any: ...


@runtime_checkable
class SampledDataset(Protocol):
    """Training windows drawn by seed and a fixed list of validation windows, the same on every machine."""

    def sample_batch(self, seed: int, batch_size: int, seq_len: int) -> Batch: ...

    def validation_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]: ...


def check_model_config(config: object, what: str) -> None:
    """Refuse a model config without a positive integer ``seq_len``, naming ``what`` (e.g. "model 'gpt'")."""
    seq_len = getattr(config, "seq_len", None)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(
            f"{what}: its config class {type(config).__name__} must have an integer field 'seq_len' >= 1 "
            f"(the longest sequence it trains on), got {seq_len!r}"
        )


def check_model(model: object, what: str) -> None:
    """Refuse a model that is not an ``nn.Module`` with trainable parameters and ``loss(inputs, targets)``."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{what}: its factory must return a torch.nn.Module, got {type(model).__name__}")
    _check_method(model, "loss", ("inputs", "targets"), what)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{what}: the model has no trainable parameters")


def check_dataset(dataset: object, what: str) -> None:
    """Refuse a dataset without ``sample_batch(seed, batch_size, seq_len)`` and ``validation_batches``."""
    _check_method(dataset, "sample_batch", ("seed", "batch_size", "seq_len"), what)
    _check_method(dataset, "validation_batches", ("batch_size", "seq_len", "max_batches"), what)


def _check_method(obj: object, name: str, args: tuple[str, ...], what: str) -> None:
    wanted = f"{name}({', '.join(args)})"
    method = getattr(obj, name, None)
    if not callable(method):
        raise ConfigError(f"{what}: {type(obj).__name__} has no method {wanted}")
    try:
        inspect.signature(method).bind(*args)
    except TypeError:
        raise ConfigError(
            f"{what}: {type(obj).__name__}.{name} must accept {wanted} as positional arguments"
        ) from None
    except ValueError:  # a builtin without a signature: nothing to check
        pass
