"""The model registry and the built-in byte-level GPT."""

from __future__ import annotations

import math
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

from protocols.errors import ConfigError
from swarm.data import build_dataset, derive_seed
from swarm.models import MODELS, GPTConfig, available_models, build_model, model_config

pytestmark = pytest.mark.timeout(60)

TINY = {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_default_gpt_has_a_few_million_parameters() -> None:
    model = build_model("gpt", {}, seed=0)
    count = sum(p.numel() for p in model.parameters())
    assert 3_000_000 <= count <= 6_000_000, count
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 256)


def test_same_seed_gives_bit_identical_weights_without_touching_global_rng() -> None:
    rng_before = torch.random.get_rng_state()
    first = build_model("gpt", TINY, seed=1234)
    second = build_model("gpt", dict(TINY), seed=1234)
    assert torch.equal(rng_before, torch.random.get_rng_state())
    assert _same_weights(first, second)
    assert not _same_weights(first, build_model("gpt", TINY, seed=1235))


def test_embeddings_are_tied_and_stages_are_named() -> None:
    model = build_model("gpt", TINY, seed=0)
    assert model.head.proj.weight is model.embed.token.weight
    assert len(model.blocks) == TINY["n_layer"]
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    hidden = model.embed(ids)
    for block in model.blocks:
        hidden = block(hidden)
    assert torch.equal(model.head(hidden), model(ids))


def test_attention_is_causal() -> None:
    model = build_model("gpt", TINY, seed=0).eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(ids)[0, :12], model(changed)[0, :12])
        assert not torch.equal(model(ids)[0, 12:], model(changed)[0, 12:])


def test_loss_is_mean_cross_entropy_near_uniform_at_init() -> None:
    model = build_model("gpt", TINY, seed=0)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.5


def test_too_long_input_names_seq_len() -> None:
    model = build_model("gpt", TINY, seed=0)
    with pytest.raises(ConfigError, match="seq_len"):
        model(torch.zeros(1, TINY["seq_len"] + 1, dtype=torch.long))


def test_unknown_model_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'bert'.*available: .*gpt"):
        build_model("bert", {})
    assert "gpt" in available_models()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"d_modle": 64}, r"unknown field 'd_modle' \(known fields: d_model,"),
        ({"n_layer": 0}, r"field 'n_layer': .*greater than or equal to 1"),
        ({"dropout": 1.5}, r"field 'dropout'"),
        ({"seq_len": "long"}, r"field 'seq_len'.*'long'"),
    ],
)
def test_bad_config_names_the_field(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model("gpt", config)


def test_heads_must_divide_width_and_the_error_names_both() -> None:
    with pytest.raises(ConfigError) as error:
        model_config("gpt", {"d_model": 100, "n_head": 8})
    assert "d_model" in str(error.value) and "n_head" in str(error.value)


def test_model_config_returns_typed_defaults() -> None:
    config = model_config("gpt", {"n_layer": 3})
    assert isinstance(config, GPTConfig)
    assert (config.n_layer, config.d_model, config.dropout) == (3, 256, 0.0)
    with pytest.raises(ConfigError, match="must be a table"):
        model_config("gpt", [("n_layer", 3)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        build_model("gpt", TINY, seed=-1)


PLUGIN = """
import torch
from pydantic import BaseModel, ConfigDict, Field
from swarm.models import register_model


class WidthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(4, ge=1, le=64, description="Width of the one layer.")
    seq_len: int = Field(8, ge=1, le=64, description="Longest sequence.")


class Linear(torch.nn.Linear):
    def loss(self, inputs, targets):
        return torch.nn.functional.mse_loss(self(inputs.float()), targets.float())


@register_model("plugin-linear", WidthConfig)
def build_linear(config, generator):
    layer = Linear(config.width, config.width, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.normal_(generator=generator)
        layer.bias.zero_()
    return layer


def register_more():
    register_model("plugin-hooked", WidthConfig)(build_linear)


def broken():
    raise RuntimeError("plugin exploded")
"""


def test_entry_point_models_load_lazily(tmp_path, monkeypatch) -> None:
    (tmp_path / "swarm_test_plugin_models.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swarm_test_plugin_models", raising=False)
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))
    monkeypatch.setattr(MODELS, "_broken", {})
    monkeypatch.setattr(MODELS, "_entry_points_loaded", False)
    points = [
        EntryPoint("plugin-linear", "swarm_test_plugin_models:build_linear", "swarm.models"),
        EntryPoint("plugin-hooked", "swarm_test_plugin_models:register_more", "swarm.models"),
        EntryPoint("plugin-broken", "swarm_test_plugin_models:broken", "swarm.models"),
    ]
    monkeypatch.setattr(
        "swarm.registry.entry_points", lambda group: points if group == "swarm.models" else []
    )

    assert {"gpt", "plugin-linear", "plugin-hooked"} <= set(available_models())
    assert "plugin-broken" not in available_models()
    first = build_model("plugin-linear", {"width": 8}, seed=3)
    assert _same_weights(first, build_model("plugin-hooked", {"width": 8}, seed=3))
    with pytest.raises(ConfigError, match="plugin exploded"):
        build_model("plugin-broken", {})
    with pytest.raises(ConfigError, match="unknown field 'depth'"):
        build_model("plugin-linear", {"depth": 2})
    with pytest.raises(ConfigError, match="already registered"):
        MODELS.register("gpt", GPTConfig)(lambda config, generator: None)


@pytest.mark.timeout(120)
def test_a_few_dozen_adam_steps_lower_validation_loss() -> None:
    dataset = build_dataset("stdlib", {"max_bytes": 400_000, "validation_fraction": 0.1})
    model = build_model("gpt", TINY, seed=0)
    validation = dataset.validation_batches(batch_size=16, seq_len=TINY["seq_len"], max_batches=4)

    def validation_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [model.loss(inputs, targets).item() for inputs, targets in validation]
        model.train()
        return sum(losses) / len(losses)

    before = validation_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(40):
        inputs, targets = dataset.sample_batch(derive_seed("test-run", "peer-a", step), 16, TINY["seq_len"])
        optimizer.zero_grad()
        model.loss(inputs, targets).backward()
        optimizer.step()
    after = validation_loss()
    assert before > 5.0
    assert after < before - 1.5, (before, after)
