"""The rules a reducer applies to the contributions it receives for its part of the vector.

An aggregator takes the stacked contributions ``[senders, values]`` and one weight per sender and
returns the aggregated ``[values]``. It must be deterministic: the reducer's output is what every peer
applies. Rules are registered by name with a typed config, like models; organizers may add their own
through the ``swarm.aggregators`` entry point group.

Example::

    aggregate = get_aggregator("mean")
    result = aggregate(torch.stack([a, b]), torch.tensor([1.0, 3.0]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from swarm.registry import Registry

AggregatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AggregatorFactory = Callable[[Any], AggregatorFn]

AGGREGATORS: Registry[AggregatorFactory] = Registry(kind="aggregator", group="swarm.aggregators")


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


def register_aggregator(name: str, config_cls: type[BaseModel] = NoOptions) -> Callable:
    """Register ``factory(config) -> aggregate(contributions, weights)`` under ``name``."""
    return AGGREGATORS.register(name, config_cls)


def aggregator_config(name: str, config: Mapping[str, Any] | None = None) -> BaseModel:
    return AGGREGATORS.validate(name, config)


def get_aggregator(name: str, config: Mapping[str, Any] | None = None) -> AggregatorFn:
    return AGGREGATORS.get(name).factory(AGGREGATORS.validate(name, config))


@register_aggregator("mean")
def weighted_mean(config: NoOptions) -> AggregatorFn:
    """The weighted average: what plain data-parallel SGD computes. Not robust to a single bad sender."""

    def aggregate(contributions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        weights = weights.to(contributions.dtype)
        if float(weights.sum()) <= 0:
            weights = torch.ones_like(weights)
        return (weights[:, None] * contributions).sum(dim=0) / weights.sum()

    return aggregate
