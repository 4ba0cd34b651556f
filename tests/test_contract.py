"""The model and dataset contract (swarm.contract): what a registry factory returns is checked where a
run's model or dataset is built, and a plugin that misses a member is refused naming it."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import ConfigError
from swarm.contract import SampledDataset, TrainableModel
from swarm.data import DATASETS, build_dataset, register_dataset
from swarm.models import MODELS, build_model, register_model

pytestmark = pytest.mark.timeout(60)


class WithSeqLen(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq_len: int = Field(8, ge=1, le=64, description="Longest sequence.")


class WithoutSeqLen(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(4, ge=1, le=64, description="Width.")


class NoLoss(torch.nn.Linear):
    pass


class WrongLoss(torch.nn.Linear):
    def loss(self, inputs):
        return inputs.sum()


class Scorer(torch.nn.Linear):
    def loss(self, inputs, targets):
        return (self(inputs.float()) - targets.float()).square().mean()


class Frozen(Scorer):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.requires_grad_(False)


class NoValidation:
    def sample_batch(self, seed, batch_size, seq_len):
        return torch.zeros(batch_size, seq_len), torch.zeros(batch_size, seq_len)


@pytest.fixture(autouse=True)
def scratch_registries(monkeypatch):
    for registry in (MODELS, DATASETS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))


@pytest.mark.parametrize(
    "config_cls, factory, message",
    [
        (
            WithoutSeqLen,
            lambda c, g: Scorer(2, 2),
            r"model 'contract-probe'.*must have an integer field 'seq_len'",
        ),
        (WithSeqLen, lambda c, g: "not a module", r"must return a torch\.nn\.Module, got str"),
        (WithSeqLen, lambda c, g: NoLoss(2, 2), r"NoLoss has no method loss\(inputs, targets\)"),
        (WithSeqLen, lambda c, g: WrongLoss(2, 2), r"WrongLoss\.loss must accept loss\(inputs, targets\)"),
        (WithSeqLen, lambda c, g: Frozen(), r"no trainable parameters"),
    ],
)
def test_a_model_that_misses_the_contract_is_refused_naming_the_member(config_cls, factory, message) -> None:
    register_model("contract-probe", config_cls)(factory)
    with pytest.raises(ConfigError, match=message):
        build_model("contract-probe", {}, seed=0)


def test_a_model_and_a_dataset_that_meet_the_contract_build() -> None:
    register_model("contract-probe", WithSeqLen)(lambda c, g: Scorer(2, 2))
    assert isinstance(build_model("contract-probe", {}, seed=0), TrainableModel)
    assert isinstance(build_dataset("stdlib", {"max_bytes": 4096}), SampledDataset)


def test_a_dataset_without_validation_batches_is_refused_naming_it() -> None:
    register_dataset("contract-probe", WithoutSeqLen)(lambda c: NoValidation())
    with pytest.raises(
        ConfigError, match=r"dataset 'contract-probe'.*validation_batches\(batch_size, seq_len"
    ):
        build_dataset("contract-probe", {})
