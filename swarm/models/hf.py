"""``hf-causal-lm``: any ``transformers`` causal LM, built from a config (never downloaded), as a run's model.

The run names a transformers model type with its config fields, or a local ``config.json``; every peer
builds the architecture with ``AutoModelForCausalLM.from_config`` from the run's seed, so all start from
bit-identical random weights. Needs the Hugging Face extra (``pip install -e ".[hf]"``), imported only
when the model is built.

Example::

    model = build_model("hf-causal-lm", {
        "model_type": "gpt2",
        "hf_config": {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512, "n_positions": 128},
        "seq_len": 128,
    }, seed=0)
    loss = model.loss(inputs, targets)  # mean cross-entropy of the logits at inputs against targets
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator
from torch import nn

from protocols.errors import ConfigError
from swarm.config import is_dropout_key
from swarm.hf_import import import_hf, local_path
from swarm.models.builder import register_model

logger = logging.getLogger(__name__)

NAME = "hf-causal-lm"
_WHAT = f"model '{NAME}'"
_MAX_CONFIG_BYTES = 1 << 20
# Fields that would run code from elsewhere or that the other fields of this config already set.
_REFUSED_FIELDS = {
    "auto_map": "code from a repository is never run; use a model type transformers ships",
    "trust_remote_code": "code from a repository is never run; use a model type transformers ships",
    "model_type": "give it as the field 'model_type' of this model's config",
}
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx")


class HFCausalLMConfig(BaseModel):
    """A transformers causal LM: a local config file or a model type, plus config fields and ``seq_len``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_path: str | None = Field(
        None, min_length=1, max_length=4096,
        description="A local config.json, or a folder holding one (save_pretrained's); never a hub name.",
    )  # fmt: skip
    model_type: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_\-]*$",
        description="A model type transformers ships (e.g. 'gpt2', 'llama'), when no config_path is given.",
    )  # fmt: skip
    hf_config: dict[str, JsonValue] = Field(
        default_factory=dict, max_length=256,
        description="Fields of the transformers config, over config_path's (vocab_size, hidden_size, ...).",
    )  # fmt: skip
    seq_len: int = Field(
        128, ge=2, le=65536, description="Longest training sequence; at most the config's position limit."
    )

    @field_validator("hf_config")
    @classmethod
    def _no_refused_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        for key in fields:
            if key in _REFUSED_FIELDS:
                raise ValueError(f"'hf_config.{key}' is not accepted: {_REFUSED_FIELDS[key]}")
            if not key or len(key) > 128:
                raise ValueError("'hf_config' keys are names of 1 to 128 characters")
        return fields

    @model_validator(mode="after")
    def _one_source(self) -> HFCausalLMConfig:
        if (self.config_path is None) == (self.model_type is None):
            raise ValueError(
                "give exactly one of the fields 'config_path' (a local config.json) and 'model_type'"
            )
        return self


class HFCausalLM(nn.Module):
    """A transformers causal LM under the run's model contract: ``forward`` gives logits, ``loss`` their
    mean cross-entropy against the given targets (the built-in datasets' targets are inputs shifted by one).
    """

    def __init__(self, lm: nn.Module, seq_len: int) -> None:
        super().__init__()
        self.lm = lm
        self.seq_len = seq_len
        self.vocab_size = int(lm.config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ConfigError(f"input_ids must have shape [batch, time], got {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.seq_len:
            raise ConfigError(
                f"input of {input_ids.shape[1]} tokens is longer than the model's seq_len ({self.seq_len})"
            )
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ConfigError(
                f"token id {high if high >= self.vocab_size else low} is outside the model's vocabulary "
                f"[0, {self.vocab_size}): raise hf_config.vocab_size to the tokenizer's size"
            )
        return self.lm(input_ids=input_ids, use_cache=False).logits

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@register_model(NAME, HFCausalLMConfig)
def build_hf_causal_lm(config: HFCausalLMConfig, generator: torch.Generator) -> HFCausalLM:
    transformers = import_hf("transformers", _WHAT)
    hf_config = transformers_config(config)
    # from_config initializes from the global generator: seed it from ours inside a fork, so the weights
    # follow the run's seed and the caller's global random state is left as it was.
    seed = int(torch.randint(0, 2**63 - 1, (), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        try:
            lm = transformers.AutoModelForCausalLM.from_config(hf_config)
        except ValueError as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"{_WHAT}: transformers has no causal LM for this config: {first}") from None
    return HFCausalLM(lm.to(torch.float32), config.seq_len)


def transformers_config(config: HFCausalLMConfig) -> Any:
    """The ``transformers`` config object that ``config`` describes, with every dropout set to 0."""
    transformers = import_hf("transformers", _WHAT)
    fields: dict[str, Any] = {}
    model_type = config.model_type
    if config.config_path is not None:
        fields = _read_config_file(config.config_path)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ConfigError(f"{_WHAT}: field 'config_path': {config.config_path!r} has no 'model_type'")
    try:
        config_cls = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError:
        raise ConfigError(
            f"{_WHAT}: model type {model_type!r} is not one transformers {transformers.__version__} ships "
            "(e.g. 'gpt2', 'llama'): check the field 'model_type' or the file's 'model_type'"
        ) from None
    defaults = config_cls()
    known = set(vars(defaults)) | set(getattr(config_cls, "attribute_map", {}))
    for key in config.hf_config:
        if key not in known:
            raise ConfigError(f"{_WHAT}: field 'hf_config.{key}': {model_type}'s config has no such field")
    fields.update(config.hf_config)
    for key, value in list(fields.items()):
        if is_dropout_key(key) and isinstance(value, int | float) and value:
            if key in config.hf_config:
                raise ConfigError(
                    f"{_WHAT}: field 'hf_config.{key}' must be 0: a peer's batch is recomputed by others "
                    "from its public seed, and dropout would draw from this process's random state"
                )
            logger.info("%s: %s set to 0 (dropout is not reproducible by other peers)", _WHAT, key)
    try:
        hf_config = config_cls(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_WHAT}: the transformers config refused these fields: {exc}") from None
    for key in vars(hf_config):
        value = getattr(hf_config, key)
        if is_dropout_key(key) and isinstance(value, float) and value:
            setattr(hf_config, key, 0.0)
    for key in _POSITION_LIMITS:
        limit = getattr(hf_config, key, None)
        if isinstance(limit, int) and config.seq_len > limit:
            raise ConfigError(
                f"{_WHAT}: field 'seq_len' ({config.seq_len}) is longer than the config's {key} ({limit})"
            )
    hf_config.use_cache = False
    return hf_config


def _read_config_file(value: str) -> dict[str, Any]:
    path = local_path(value, "config_path", _WHAT)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{_WHAT}: field 'config_path': folder {value!r} has no config.json")
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{_WHAT}: field 'config_path': {value!r} is over {_MAX_CONFIG_BYTES} bytes")
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{_WHAT}: field 'config_path': cannot read {str(path)!r} as JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{_WHAT}: field 'config_path': {str(path)!r} is not a JSON object")
    for key in fields:
        if key in ("auto_map", "trust_remote_code"):
            raise ConfigError(
                f"{_WHAT}: field 'config_path': {str(path)!r} has '{key}': {_REFUSED_FIELDS[key]}"
            )
    return fields
