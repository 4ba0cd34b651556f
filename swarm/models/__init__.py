"""Named model architectures: a run names an architecture and a plain config dict, never code.

- (the generic name -> config + factory registry lives in :mod:`swarm.registry`, shared with :mod:`swarm.data`)
- builder.py: the model registry: ``register_model``, ``build_model``, ``available_models``, ``model_config``
- gpt.py: ``gpt``, the built-in byte-level GPT (``embed`` -> ``blocks`` -> ``head``)
- external.py: ``external``, a model defined in the researcher's own code, declared by its tensors
  (``describe_model``), trained through ``session.collaborate``
- hf.py: ``hf-causal-lm``, any ``transformers`` causal LM built from a config (the ``[hf]`` extra, imported
  when built)
- checkpointing.py: activation checkpointing of the blocks a model declares (``activation_blocks()``)

Example::

    from swarm.models import build_model
    model = build_model("gpt", {"d_model": 128, "n_layer": 2}, seed=0)

Adding an architecture
----------------------
An organizer ships it in an installed package and names it in the ``swarm.models`` entry point group::

    [project.entry-points."swarm.models"]
    mlp = "my_models:build_mlp"

The entry point is either a factory decorated with :func:`register_model` (importing it registers it)
or a zero-argument function that calls :func:`register_model` when invoked. Entry points are loaded
lazily, the first time a name is not found among the built-ins or :func:`available_models` is called;
a broken one is logged and skipped, and naming it gives a ConfigError with the cause. Every peer of a
run must have the same package installed: only the name and config travel. The config must have
``seq_len`` and the model ``loss(inputs, targets)`` (:mod:`swarm.contract`, checked by :func:`build_model`).

A model that defines ``activation_blocks() -> list[nn.Module]`` (its repeated blocks, each called with
the hidden state) can be trained with activation checkpointing (``swarm-peer join
--activation-checkpointing``); a model without it trains as usual and the flag is logged as ignored.
"""

from swarm.models.builder import (
    MODELS,
    ModelFactory,
    available_models,
    build_model,
    model_config,
    register_model,
)
from swarm.models.checkpointing import (
    activation_blocks,
    set_activation_checkpointing,
    supports_activation_checkpointing,
)
from swarm.models.external import ExternalModel, ExternalModelConfig, check_layout, describe_model
from swarm.models.gpt import GPT, VOCAB_SIZE, GPTConfig
from swarm.models.hf import HFCausalLM, HFCausalLMConfig

__all__ = [
    "GPT",
    "ExternalModel",
    "ExternalModelConfig",
    "MODELS",
    "VOCAB_SIZE",
    "GPTConfig",
    "HFCausalLM",
    "HFCausalLMConfig",
    "ModelFactory",
    "activation_blocks",
    "available_models",
    "build_model",
    "check_layout",
    "describe_model",
    "model_config",
    "register_model",
    "set_activation_checkpointing",
    "supports_activation_checkpointing",
]
