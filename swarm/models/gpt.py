"""``gpt``: a small GPT-style decoder-only language model over bytes.

Split into ``embed`` -> ``blocks`` -> ``head`` so that contiguous slices can later be hosted as pipeline
stages. Input and output embeddings are tied.
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
        return self.proj(self.ln(x))


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

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2 initialization, drawn in a fixed order from ``generator`` only."""
        residual_std = _INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, _INIT_STD, generator=generator)
            elif isinstance(module, nn.Linear) and module is not self.head.proj:
                # Projections that write into the residual stream are scaled down with depth.
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else _INIT_STD
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of ``targets[B, T]`` given ``input_ids[B, T]``."""
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


@register_model("gpt", GPTConfig)
def build_gpt(config: GPTConfig, generator: torch.Generator) -> GPT:
    return GPT(config, generator=generator)
