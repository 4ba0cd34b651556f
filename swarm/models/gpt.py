"""``gpt``: a small GPT-style decoder-only language model over bytes.

Split into ``embed`` -> ``blocks`` -> ``head`` so that contiguous slices are hosted as pipeline stages
(:class:`GPTStage`). Input and output embeddings are tied in the whole model; a pipeline's last stage holds
its own copy of the output projection, equal to the token embedding at initialization.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from protocols.errors import ConfigError
from swarm.models.builder import register_model

VOCAB_SIZE = 256
_INIT_STD = 0.02


class GPTConfig(BaseModel):
    """Shape of the byte-level GPT. The defaults give about 4.8M parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    d_model: int = Field(256, ge=8, le=8192, description="Width of the residual stream.")
    n_layer: int = Field(6, ge=1, le=256, description="Number of transformer blocks.")
    n_head: int = Field(8, ge=1, le=256, description="Attention heads per block; must divide d_model.")
    seq_len: int = Field(256, ge=2, le=65536, description="Longest input sequence (learned positions).")
    mlp_ratio: float = Field(4.0, ge=1.0, le=16.0, description="MLP hidden width as a multiple of d_model.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention and residuals while training."
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}): "
                "change one of the fields 'd_model' or 'n_head'"
            )
        return self

    @property
    def mlp_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)


class Embedding(nn.Module):
    """Token plus learned position embeddings: input_ids[B, T] -> hidden[B, T, d_model]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.token = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position = nn.Embedding(config.seq_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ConfigError(f"input_ids must have shape [batch, time], got {tuple(input_ids.shape)}")
        length = input_ids.shape[1]
        if length > self.seq_len:
            raise ConfigError(f"input of {length} tokens is longer than the model's seq_len ({self.seq_len})")
        positions = torch.arange(length, device=input_ids.device)
        return self.dropout(self.token(input_ids) + self.position(positions))


class SelfAttention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout_p = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (
            t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True
        )
        return self.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_hidden)
        self.proj = nn.Linear(config.mlp_hidden, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class Head(nn.Module):
    """Final LayerNorm and the output projection to byte logits (weight tied to the token embedding)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.proj = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits stay fp32 under autocast: bf16 keeps 8 bits of mantissa, too few for a softmax over
        # 256 bytes, and this projection is a small share of the compute.
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.proj(self.ln(x.float()))


class GPT(nn.Module):
    """Byte-level GPT: ``forward(input_ids[B, T]) -> logits[B, T, 256]``.

    Every initial value is drawn from ``generator`` (seed 0 when none is given), never the global RNG.

    Example::

        model = GPT(GPTConfig(n_layer=2), generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([list(b"def f(x):")])
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    """

    def __init__(self, config: GPTConfig, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device so that no module draws its default init from the global RNG;
        # every value is then drawn from ``generator`` in reset_parameters.
        with torch.device("meta"):
            self.embed = Embedding(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.head = Head(config)
        self.to_empty(device="cpu")
        # Tied after materializing: to_empty would give each module its own copy of a shared parameter.
        self.head.proj.weight = self.embed.token.weight
        self.reset_parameters(generator if generator is not None else torch.Generator().manual_seed(0))

    def activation_blocks(self) -> list[nn.Module]:
        """The transformer blocks, each recomputed in backward under activation checkpointing."""
        return list(self.blocks)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2 initialization, drawn in a fixed order from ``generator`` only."""
        _initialize(self, self.config.n_layer, generator, tied=self.head.proj)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of ``targets[B, T]`` given ``input_ids[B, T]``."""
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


@torch.no_grad()
def _initialize(
    root: nn.Module, n_layer: int, generator: torch.Generator, *, tied: nn.Module
) -> torch.Tensor:
    """Draw every initial value of ``root``'s modules in ``named_modules`` order; returns the token embedding.

    A module left on the meta device (a part of the model another pipeline stage holds) still has its
    values drawn, into a scratch tensor that is then dropped, so the generator advances exactly as it does
    for the whole model and every stage gets the values of its part of the whole model.
    """
    residual_std = _INIT_STD / math.sqrt(2 * n_layer)
    token = torch.empty(0)
    for name, module in root.named_modules():
        if isinstance(module, nn.LayerNorm):
            if not module.weight.is_meta:
                module.weight.fill_(1.0)
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            values = _draw(module.weight, _INIT_STD, generator)
            if name.endswith("token"):
                token = values
        elif isinstance(module, nn.Linear) and module is not tied:
            # Projections that write into the residual stream are scaled down with depth.
            std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else _INIT_STD
            _draw(module.weight, std, generator)
            if module.bias is not None and not module.bias.is_meta:
                module.bias.zero_()
    return token


def _draw(parameter: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    target = torch.empty(parameter.shape) if parameter.is_meta else parameter
    return target.normal_(0.0, std, generator=generator)


class _Layout(nn.Module):
    """The whole model's module tree (on the meta device), so that a stage walks it in the same order."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)


class GPTStage(nn.Module):
    """Blocks ``[first_block, last_block)`` of a :class:`GPT`, with the embedding on the first stage and
    the head on the last: one stage of a pipeline.

    Its initial values are exactly those of the same part of ``GPT(config, generator=...)`` built from an
    equal generator; only the stage's own part is ever held in memory. The first stage maps
    ``input_ids[B, T]`` to hidden states ``[B, T, d_model]``, a middle stage maps hidden states to hidden
    states, and the last stage maps them to logits ``[B, T, 256]``.

    Example::

        first = GPTStage(config, first_block=0, last_block=3, embed=True, head=False)
        last = GPTStage(config, first_block=3, last_block=6, embed=False, head=True)
        loss = last.loss(first(ids[:, :-1]), ids[:, 1:])
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        first_block: int,
        last_block: int,
        embed: bool,
        head: bool,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= first_block <= last_block <= config.n_layer:
            raise ConfigError(
                f"blocks [{first_block}, {last_block}) do not fit a model of n_layer={config.n_layer}"
            )
        self.config, self.first_block, self.last_block = config, first_block, last_block
        with torch.device("meta"):
            layout = _Layout(config)
        owned: list[nn.Module] = list(layout.blocks[first_block:last_block])
        if embed:
            owned.append(layout.embed)
        if head:
            owned.append(layout.head)
        for module in owned:
            module.to_empty(device="cpu")
        token = _initialize(
            layout, config.n_layer, generator if generator is not None else torch.Generator().manual_seed(0),
            tied=layout.head.proj,
        )  # fmt: skip
        self.embed = layout.embed if embed else None
        self.blocks = nn.ModuleList(layout.blocks[first_block:last_block])
        self.head = layout.head if head else None
        if self.head is not None:
            if self.embed is not None:
                self.head.proj.weight = self.embed.token.weight  # one stage holds it all: tied as in GPT
            else:
                with torch.no_grad():
                    self.head.proj.weight.copy_(token)

    def activation_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``targets[B, T]``; only for a stage that holds the head."""
        if self.head is None:
            raise ConfigError("only the last stage (the one with the head) computes the loss")
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


@register_model("gpt", GPTConfig)
def build_gpt(config: GPTConfig, generator: torch.Generator) -> GPT:
    return GPT(config, generator=generator)
