"""``external``: a model that researchers define in their own code, declared to the run by its layout.

A run whose model is not in any registry (a module the researcher's script defines, trained in the
researcher's own loop through ``session.collaborate``) names ``external`` and lists every tensor of the
model's state: name, shape, dtype and whether it is trained. :func:`describe_model` writes that list from
a live module. The coordinator and every peer build a stand-in from it (zeros, no forward) so that state
layouts, checkpoints, download bounds and the averaged vector's length are known without the
researcher's code; ``collaborate`` refuses a model whose state does not match the list, naming the first
tensor that differs. Such a run cannot be joined with ``swarm-peer join``: the built-in loop has no
code for the model's forward.

Example::

    run = swarm.RunConfig(run_id="mine", model=swarm.describe_model(MyNet()))
    run.to_toml("run.toml")  # swarm-coordinator start --config run.toml
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from protocols.errors import ConfigError
from swarm.models.builder import register_model

NAME = "external"
MAX_TENSORS = 65536
MAX_DIMS = 8
# What the coordinator and each peer allocate (as zeros) for a stand-in: 4 Gi elements, 16 GiB in float32.
MAX_NUMEL = 1 << 32
FLOATS = {"float32", "float16", "bfloat16", "float64"}
# Names a stand-in's modules already use: a tensor path through one of them cannot be built.
_TAKEN = frozenset(dir(nn.Module())) | {"loss"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}  # fmt: skip


class TensorSpec(BaseModel):
    """One tensor of an external model's state, as ``state_dict`` names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=512, pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
    shape: list[int] = Field(max_length=MAX_DIMS)
    dtype: str = "float32"
    trainable: bool = True

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        if any(d < 0 or d > MAX_NUMEL for d in shape):
            raise ValueError(f"dimensions must be in [0, {MAX_NUMEL}], got {shape}")
        return shape

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        taken = [part for part in name.split(".") if part in _TAKEN]
        if taken:
            raise ValueError(
                f"{name!r}: {taken[0]!r} is an attribute every torch module has (or the stand-in's loss); "
                "rename that module or tensor in the model"
            )
        return name

    @model_validator(mode="after")
    def _trainable_floats(self) -> TensorSpec:
        if self.trainable and self.dtype not in FLOATS:
            raise ValueError(f"{self.name!r}: a trained tensor must be floating point, not {self.dtype}")
        return self

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str) -> str:
        if dtype not in DTYPES:
            raise ValueError(f"{dtype!r} is not one of {', '.join(DTYPES)}")
        return dtype


class ExternalModelConfig(BaseModel):
    """The state of a model defined in the researcher's code: every parameter and persistent buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensors: list[TensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    seq_len: int = Field(1, ge=1, le=1 << 20, description="Unused by the run; the contract asks every config")

    @field_validator("tensors")
    @classmethod
    def _tensors(cls, tensors: list[TensorSpec]) -> list[TensorSpec]:
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)!r} is listed twice")
        prefixes = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
        clash = sorted(prefixes & set(names))
        if clash:
            raise ValueError(f"{clash[0]!r} is both a tensor and a module holding tensors")
        if not any(t.trainable for t in tensors):
            raise ValueError("no tensor is trainable")
        if sum(math.prod(t.shape) for t in tensors) > MAX_NUMEL:
            raise ValueError(f"the tensors hold more than {MAX_NUMEL} elements")
        return tensors


class ExternalModel(nn.Module):
    """A stand-in with the declared tensors (zeros) and no forward: its state layout is the run's."""

    def __init__(self, config: ExternalModelConfig):
        super().__init__()
        for spec in config.tensors:
            *path, leaf = spec.name.split(".")
            owner: nn.Module = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            value = torch.zeros(spec.shape, dtype=DTYPES[spec.dtype])
            if spec.trainable:
                owner.register_parameter(leaf, nn.Parameter(value))
            else:
                owner.register_buffer(leaf, value)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ConfigError(
            f"model {NAME!r} is defined in the researcher's own code and trained in their loop "
            "(session.collaborate); the built-in loop (swarm-peer join) cannot compute it"
        )


@register_model(NAME, ExternalModelConfig)
def build_external(config: ExternalModelConfig, generator: torch.Generator) -> nn.Module:
    return ExternalModel(config)


def model_layout(model: nn.Module) -> list[TensorSpec]:
    """The tensors of ``model``'s state as the run holds it: its parameters (a tied one once, under its
    first name) and its persistent buffers."""
    persistent = model.state_dict(keep_vars=True).keys()
    tensors = [(name, p, p.requires_grad) for name, p in model.named_parameters()]
    tensors += [(name, b, False) for name, b in model.named_buffers() if name in persistent]
    specs = []
    for name, tensor, trainable in tensors:
        dtype = next((k for k, v in DTYPES.items() if v == tensor.dtype), None)
        if dtype is None:
            raise ConfigError(f"model tensor {name!r} has dtype {tensor.dtype}, which a run cannot hold")
        specs.append(TensorSpec(name=name, shape=list(tensor.shape), dtype=dtype, trainable=trainable))
    return specs


def describe_model(model: nn.Module) -> dict[str, Any]:
    """The run's ``model`` section for a module defined in the researcher's code (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"describe_model takes a torch.nn.Module, got {type(model).__name__}")
    tensors = [spec.model_dump() for spec in model_layout(model)]
    return {"name": NAME, "config": {"tensors": tensors}}


def check_layout(model: nn.Module, expected: nn.Module, what: str) -> None:
    """Refuse ``model`` unless its state has ``expected``'s tensors (names, shapes, dtypes, trained or not),
    naming the first that differs; ``what`` names the run's model in the message."""
    mine = {s.name: s for s in model_layout(model)}
    theirs = {s.name: s for s in model_layout(expected)}
    for name in [*mine, *(n for n in theirs if n not in mine)]:  # the model's order, then what it lacks
        a, b = mine.get(name), theirs.get(name)
        if a is None:
            raise ConfigError(f"the model has no tensor {name!r}, which {what} has ({b.shape}, {b.dtype})")
        if b is None:
            raise ConfigError(f"the model's tensor {name!r} is not in {what}")
        if a != b:
            raise ConfigError(
                f"the model's tensor {name!r} is {a.shape} {a.dtype}{'' if a.trainable else ' (not trained)'}; "
                f"{what} has {b.shape} {b.dtype}{'' if b.trainable else ' (not trained)'}"
            )


__all__ = [
    "ExternalModel",
    "ExternalModelConfig",
    "TensorSpec",
    "check_layout",
    "describe_model",
    "model_layout",
]
