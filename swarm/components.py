"""Checking a run's named components against the registries installed on this machine.

``RunConfig`` stays a plain, torch-free description of a run; this module is the one place that asks
the model, dataset, aggregator and pipeline code whether they accept it, so the config imports none of
them.

Example::

    from swarm import RunConfig, check_components
    check_components(RunConfig.demo())  # raises ConfigError naming the bad section and field
"""

from __future__ import annotations

from protocols.errors import ConfigError
from swarm.averaging.aggregators import aggregator_config
from swarm.config import RunConfig
from swarm.data import dataset_config
from swarm.models import model_config
from swarm.pipeline.layout import stage_layout


def check_components(run: RunConfig) -> None:
    """Check the model, dataset, aggregator and pipeline split of ``run`` (imports torch)."""
    try:
        aggregator_config(run.training.aggregator, run.training.aggregator_options)
    except ConfigError as e:
        raise ConfigError(f"run {run.run_id!r}: training.aggregator: {e}") from None
    for section, check in (("model", model_config), ("dataset", dataset_config)):
        spec = getattr(run, section)
        try:
            check(spec.name, spec.config)
        except ConfigError as e:
            raise ConfigError(f"run {run.run_id!r}: {section}: {e}") from None
    if run.pipeline.stages > 1:
        stage_layout(run)  # the split fits the model: a ConfigError names pipeline.layer_split
