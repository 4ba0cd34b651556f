"""Which part of the model each pipeline stage holds, checked against the model, and building a stage.

A run names its split in ``[pipeline]`` (``stages`` and, optionally, ``layer_split``: transformer blocks
per stage). The first stage also holds the embedding, the last one the head. Every stage is built from
the run's seed with exactly the initial values of its part of the whole model.

Example::

    run = RunConfig(run_id="r", model={"name": "gpt", "config": {"n_layer": 6}}, pipeline={"stages": 3})
    [spec.blocks for spec in stage_layout(run)]     # [(0, 2), (2, 4), (4, 6)]
    stage = build_stage(run, 1)                       # blocks 2..3 of the model, as initialized
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from protocols.errors import ConfigError
from swarm.config import RunConfig
from swarm.models import model_config
from swarm.models.gpt import GPTConfig, GPTStage

#: Architectures that can be split into stages (their config must say how many blocks there are).
SPLITTABLE = {"gpt": GPTConfig}


@dataclass(frozen=True)
class StageSpec:
    """Which blocks of the model stage ``index`` holds, and whether it holds the embedding or the head."""

    index: int
    first_block: int
    last_block: int
    embed: bool
    head: bool

    @property
    def blocks(self) -> tuple[int, int]:
        return self.first_block, self.last_block


def even_split(n_layer: int, stages: int) -> list[int]:
    """Blocks per stage, as even as possible; leftovers go to the middle stages first, which need one."""
    sizes = [n_layer // stages] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 1 else [0]
    for i in order[: n_layer % stages]:
        sizes[i] += 1
    return sizes


def layout_of(n_layer: int, stages: int, layer_split: list[int] | None) -> list[StageSpec]:
    split = list(layer_split) if layer_split is not None else even_split(n_layer, stages)
    if len(split) != stages:
        raise ConfigError(f"pipeline.layer_split lists {len(split)} stages but pipeline.stages is {stages}")
    if sum(split) != n_layer:
        raise ConfigError(
            f"pipeline.layer_split {split} holds {sum(split)} blocks but the model has n_layer={n_layer}"
        )
    if any(n < 1 for n in split[1:-1]) or any(n < 0 for n in split):
        raise ConfigError(
            f"pipeline.layer_split {split}: every middle stage needs at least one block "
            f"(the model has n_layer={n_layer} for {stages} stages)"
        )
    specs, first = [], 0
    for index, count in enumerate(split):
        specs.append(StageSpec(index, first, first + count, embed=index == 0, head=index == stages - 1))
        first += count
    return specs


def stage_layout(run: RunConfig) -> list[StageSpec]:
    """The run's stages; a ConfigError names ``pipeline.layer_split`` or the model when they do not fit."""
    if run.model.name not in SPLITTABLE:
        raise ConfigError(
            f"model {run.model.name!r} cannot be split into pipeline stages (splittable: {', '.join(SPLITTABLE)})"
        )
    config = model_config(run.model.name, run.model.config)
    return layout_of(config.n_layer, run.pipeline.stages, run.pipeline.layer_split)


def build_stage(run: RunConfig, index: int) -> GPTStage:
    """Stage ``index`` of the run's model, initialized from the run's seed like the whole model would be."""
    specs = stage_layout(run)
    if not 0 <= index < len(specs):
        raise ConfigError(
            f"stage {index} does not exist: the run has {len(specs)} stages (0..{len(specs) - 1})"
        )
    spec = specs[index]
    return GPTStage(
        model_config(run.model.name, run.model.config),
        first_block=spec.first_block, last_block=spec.last_block, embed=spec.embed, head=spec.head,
        generator=torch.Generator().manual_seed(run.training.seed),
    )  # fmt: skip


def split_model(run: RunConfig) -> list[GPTStage]:
    """Every stage of the run's model, first to last (composing them gives the whole model's forward)."""
    return [build_stage(run, index) for index in range(len(stage_layout(run)))]


def stage_bytes(run: RunConfig, index: int) -> int:
    """Bytes a replica of stage ``index`` needs for parameters, gradients and Adam state (4 copies)."""
    spec = stage_layout(run)[index]
    config = model_config(run.model.name, run.model.config)
    d, hidden = config.d_model, config.mlp_hidden
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    numel = block * (spec.last_block - spec.first_block)
    if spec.embed:
        numel += 256 * d + config.seq_len * d
    if spec.head:
        numel += 2 * d + 256 * d
    return 4 * 4 * numel


def available_memory_bytes(device: str) -> int:
    """Free memory of ``device`` ("cpu" or "cuda..."): what a stage's state must fit in."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info()[0])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
