"""The model registry: build a named architecture from a plain config dict, reproducibly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import BaseModel

from protocols.errors import ConfigError
from swarm.contract import check_model, check_model_config
from swarm.registry import Registry

#: A factory gets its validated config and a seeded generator, and must draw every random initial value
#: from that generator, so that two peers building with one seed hold bit-identical weights.
ModelFactory = Callable[[Any, torch.Generator], torch.nn.Module]

MODELS: Registry[ModelFactory] = Registry(kind="model", group="swarm.models")

_MAX_SEED = 2**64 - 1


def register_model(name: str, config_cls: type[BaseModel]) -> Callable[[ModelFactory], ModelFactory]:
    """Register ``factory(config, generator) -> nn.Module`` as the architecture ``name``.

    Example::

        class MlpConfig(BaseModel):
            model_config = ConfigDict(extra="forbid")
            width: int = Field(64, ge=1, le=4096, description="hidden width")

        @register_model("mlp", MlpConfig)
        def build_mlp(config: MlpConfig, generator: torch.Generator) -> torch.nn.Module:
            ...
    """
    return MODELS.register(name, config_cls)


def available_models() -> list[str]:
    """Names of every architecture this peer can build, sorted."""
    return MODELS.names()


def model_config(name: str, config: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
    """The validated, typed config of architecture ``name``; a ConfigError names any bad field."""
    return MODELS.validate(name, config)


def build_model(
    name: str, config: Mapping[str, Any] | BaseModel | None = None, *, seed: int | None = None
) -> torch.nn.Module:
    """Build architecture ``name`` from ``config``; with a ``seed`` the weights are bit-identical everywhere.

    The global torch RNG is neither read nor advanced. The config and the model are checked against
    :mod:`swarm.contract` (``seq_len``; ``loss(inputs, targets)``): a ConfigError names what is missing.

    Example::

        model = build_model("gpt", {"n_layer": 2}, seed=0)
        logits = model(torch.zeros(1, 8, dtype=torch.long))
    """
    typed = MODELS.validate(name, config)
    check_model_config(typed, f"model {name!r}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    else:
        generator.manual_seed(seed)
    model = MODELS.get(name).factory(typed, generator)
    check_model(model, f"model {name!r}")
    return model
