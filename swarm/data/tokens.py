"""``TokenDataset``: token ids in two arrays (train, validation), sampled by seed exactly as byte corpora are."""

from __future__ import annotations

import hashlib

import numpy as np

from protocols.errors import ConfigError
from swarm.data.corpus import SplitWindows

_FINGERPRINT_DOMAIN = b"swarm/tokens/v1"


class TokenDataset(SplitWindows):
    """Documents already tokenized and joined, one array per split.

    Windows are drawn as from :class:`~swarm.data.corpus.ByteDataset` (both are
    :class:`~swarm.data.corpus.SplitWindows`), so a batch is a function of (seed, batch_size, seq_len) and
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

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.name!r}, tokens={self.train_tokens}+{self.validation_tokens}, "
            f"vocab={self.vocab_size}, fingerprint={self.fingerprint[:12]})"
        )
