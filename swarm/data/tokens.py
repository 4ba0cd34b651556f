"""``TokenDataset``: token ids in two arrays (train, validation), sampled by seed exactly as byte corpora are."""

from __future__ import annotations

import hashlib

import numpy as np

from protocols.errors import ConfigError
from swarm.data.corpus import SPLITS, Batch, sample_windows, spread_windows

_FINGERPRINT_DOMAIN = b"swarm/tokens/v1"


class TokenDataset:
    """Documents already tokenized and joined, one array per split.

    Windows are drawn with :func:`swarm.data.corpus.sample_windows`, the recipe of
    :class:`~swarm.data.corpus.ByteDataset`, so a batch is a function of (seed, batch_size, seq_len) and
    the token arrays only; ``fingerprint`` is SHA-256 over both arrays (as little-endian int32), so peers
    whose files or tokenizer differ can tell.

    Example::

        dataset = TokenDataset("mine", np.arange(1000) % 50, np.arange(200) % 50, vocab_size=50)
        inputs, targets = dataset.sample_batch(derive_seed("demo", "peer-a", 0), 8, 64)
    """

    def __init__(self, name: str, train: np.ndarray, validation: np.ndarray, *, vocab_size: int) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.train: np.ndarray = np.ascontiguousarray(train, dtype="<i4")
        self.validation: np.ndarray = np.ascontiguousarray(validation, dtype="<i4")
        for split, tokens in (("train", self.train), ("validation", self.validation)):
            if tokens.ndim != 1:
                raise ConfigError(f"dataset '{name}': the {split} tokens must be one flat array")
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
                raise ConfigError(f"dataset '{name}': a {split} token id is outside [0, {vocab_size})")
        digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
        for split, tokens in (("train", self.train), ("validation", self.validation)):
            digest.update(split.encode() + tokens.size.to_bytes(8, "big") + tokens.tobytes())
        self.fingerprint: str = digest.hexdigest()

    @property
    def train_tokens(self) -> int:
        return int(self.train.size)

    @property
    def validation_tokens(self) -> int:
        return int(self.validation.size)

    def split(self, split: str) -> np.ndarray:
        """The tokens of ``split`` ("train" or "validation")."""
        if split == "train":
            return self.train
        if split == "validation":
            return self.validation
        raise ConfigError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")

    def sample_batch(self, seed: int, batch_size: int, seq_len: int, split: str = "train") -> Batch:
        """``batch_size`` windows of ``split`` drawn with ``seed``: inputs and targets shifted by one token."""
        what = f"the {split} split of dataset '{self.name}'"
        return sample_windows(self.split(split), seed, batch_size, seq_len, what=what)

    def validation_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
        """A fixed list of up to ``max_batches`` validation batches spread over the split, the same everywhere."""
        return spread_windows(
            self.validation, batch_size, seq_len, max_batches, what=f"dataset '{self.name}'"
        )

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.name!r}, tokens={self.train_tokens}+{self.validation_tokens}, "
            f"vocab={self.vocab_size}, fingerprint={self.fingerprint[:12]})"
        )
