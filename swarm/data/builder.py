"""The dataset registry: build a named corpus from a plain config dict."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from swarm.contract import SampledDataset, check_dataset
from swarm.registry import Registry

DatasetFactory = Callable[[Any], SampledDataset]

DATASETS: Registry[DatasetFactory] = Registry(kind="dataset", group="swarm.datasets")

_cache: dict[tuple[str, str], SampledDataset] = {}
_cache_lock = threading.Lock()


def register_dataset(name: str, config_cls: type[BaseModel]) -> Callable[[DatasetFactory], DatasetFactory]:
    """Register ``factory(config) -> dataset`` as the dataset ``name`` (see :class:`swarm.contract.SampledDataset`).

    A config class with ``cacheable: ClassVar[bool] = True`` lets :func:`build_dataset` reuse one
    built corpus per config within a process.
    """
    return DATASETS.register(name, config_cls)


def available_datasets() -> list[str]:
    """Names of every dataset this peer can build, sorted."""
    return DATASETS.names()


def dataset_config(name: str, config: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
    """The validated, typed config of dataset ``name``; a ConfigError names any bad field."""
    return DATASETS.validate(name, config)


def build_dataset(name: str, config: Mapping[str, Any] | BaseModel | None = None) -> SampledDataset:
    """Build dataset ``name`` from ``config``; a ConfigError names a bad field or a missing path.

    What the factory returns is checked against :class:`swarm.contract.SampledDataset`.

    Example::

        dataset = build_dataset("stdlib", {"max_bytes": 1_000_000})
        print(dataset.fingerprint, dataset.train_bytes, dataset.validation_bytes)
    """
    typed = DATASETS.validate(name, config)
    factory = DATASETS.get(name).factory
    if not getattr(typed, "cacheable", False):
        return _checked(name, factory(typed))
    key = (name, json.dumps(typed.model_dump(mode="json"), sort_keys=True))
    # Held while building so that concurrent callers load the corpus once, not once each.
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _checked(name, factory(typed))
        return _cache[key]


def _checked(name: str, dataset: SampledDataset) -> SampledDataset:
    check_dataset(dataset, f"dataset {name!r}")
    return dataset
