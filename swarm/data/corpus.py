"""``ByteDataset``: a byte corpus in one uint8 array, split by file, fingerprinted, sampled by seed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

from protocols.errors import ConfigError
from swarm.data.seeds import row_offsets

#: Written after every file: a NUL byte never occurs in source text, so it marks "end of document".
SEPARATOR = b"\x00"
SPLITS = ("train", "validation")
_FINGERPRINT_DOMAIN = b"swarm/corpus/v1"

Batch = tuple[torch.Tensor, torch.Tensor]


def split_score(path: str) -> float:
    """Where ``path`` falls in [0, 1): files scoring under the validation fraction are held out."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") / 2**64


class SplitWindows:
    """What the corpora share: token ids in a ``train`` and a ``validation`` array, and windows of them
    drawn by seed (:func:`sample_windows`) or spread over the validation split (:func:`spread_windows`)."""

    name: str
    train: np.ndarray
    validation: np.ndarray

    def split(self, split: str) -> np.ndarray:
        """The tokens of ``split`` ("train" or "validation")."""
        if split == "train":
            return self.train
        if split == "validation":
            return self.validation
        raise ConfigError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")

    def sample_batch(self, seed: int, batch_size: int, seq_len: int, split: str = "train") -> Batch:
        """``batch_size`` random windows of ``split``: inputs and targets (inputs shifted by one token).

        The same ``seed`` gives bit-identical tensors on every machine with the same ``fingerprint``;
        see :func:`swarm.data.seeds.row_offsets` for the recipe.
        """
        what = f"the {split} split of dataset '{self.name}'"
        return sample_windows(self.split(split), seed, batch_size, seq_len, what=what)

    def validation_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
        """A fixed list of up to ``max_batches`` validation batches, the same on every machine.

        Windows do not overlap and are spread evenly over the whole validation split; the last batch
        may be smaller when the split holds fewer than ``batch_size * max_batches`` windows.
        """
        return spread_windows(
            self.validation, batch_size, seq_len, max_batches, what=f"dataset '{self.name}'"
        )


class ByteDataset(SplitWindows):
    """Files concatenated as bytes, with a held-out validation split chosen per file.

    A file is held out when ``split_score(relative_path) < validation_fraction``, so the split depends
    only on the file's own path. Two corner cases keep both splits usable: with two or more files and
    none held out, the lowest-scoring file is; a lone file is always training data.

    ``fingerprint`` is SHA-256 over the split, relative path and bytes of every file used, so peers
    whose corpora differ (another Python version, an edited file) can tell before training.

    Example::

        dataset = build_dataset("stdlib", {"max_bytes": 1_000_000})
        inputs, targets = dataset.sample_batch(derive_seed("demo", "peer-a", 0), 8, 128)
    """

    def __init__(
        self,
        name: str,
        documents: Iterable[tuple[str, bytes]],
        *,
        validation_fraction: float,
        max_bytes: int | None = None,
    ) -> None:
        self.name = name
        docs = sorted(documents, key=lambda doc: doc[0])
        paths = [path for path, _ in docs]
        if len(set(paths)) != len(paths):
            duplicate = next(p for p, q in zip(paths, paths[1:], strict=False) if p == q)
            raise ConfigError(f"dataset '{name}' has two files with the relative path {duplicate!r}")
        if not docs:
            raise ConfigError(f"dataset '{name}' has no files")

        held_out = {path for path in paths if split_score(path) < validation_fraction}
        if validation_fraction > 0 and not held_out and len(paths) >= 2:
            held_out = {min(paths, key=split_score)}
        if len(held_out) == len(paths):
            held_out.discard(max(paths, key=split_score))
        train_docs = [doc for doc in docs if doc[0] not in held_out]
        validation_docs = [doc for doc in docs if doc[0] in held_out]

        validation_budget = train_budget = None
        if max_bytes is not None:
            validation_budget = round(max_bytes * validation_fraction) if validation_docs else 0
            train_budget = max_bytes - validation_budget

        digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
        pieces: list[bytes] = []
        files: dict[str, tuple[str, ...]] = {}
        for split, split_docs, budget in (
            ("train", train_docs, train_budget),
            ("validation", validation_docs, validation_budget),
        ):
            split_pieces, used = _take(split_docs, budget)
            files[split] = tuple(path for path, _ in used)
            for path, content in used:
                for field in (split.encode(), path.encode("utf-8"), content):
                    digest.update(len(field).to_bytes(8, "big") + field)
            pieces.append(b"".join(split_pieces))

        self.train_files: tuple[str, ...] = files["train"]
        self.validation_files: tuple[str, ...] = files["validation"]
        self.fingerprint: str = digest.hexdigest()
        #: The whole corpus, read-only: the training bytes, then the validation bytes.
        self.data: np.ndarray = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        self.train: np.ndarray = self.data[: len(pieces[0])]
        self.validation: np.ndarray = self.data[len(pieces[0]) :]

    @property
    def num_bytes(self) -> int:
        return int(self.data.size)

    @property
    def train_bytes(self) -> int:
        return int(self.train.size)

    @property
    def validation_bytes(self) -> int:
        return int(self.validation.size)

    def __repr__(self) -> str:
        return (
            f"ByteDataset({self.name!r}, files={len(self.train_files)}+{len(self.validation_files)}, "
            f"bytes={self.train_bytes}+{self.validation_bytes}, fingerprint={self.fingerprint[:12]})"
        )


def _take(docs: list[tuple[str, bytes]], budget: int | None) -> tuple[list[bytes], list[tuple[str, bytes]]]:
    """Documents with separators, in order, until ``budget`` bytes; the last one may be cut short."""
    pieces: list[bytes] = []
    used: list[tuple[str, bytes]] = []
    remaining = budget
    for path, content in docs:
        if remaining is not None and remaining <= 0:
            break
        if remaining is not None and len(content) + len(SEPARATOR) > remaining:
            content = content[:remaining]
            pieces.append(content)
            used.append((path, content))
            break
        pieces.extend((content, SEPARATOR))
        used.append((path, content))
        if remaining is not None:
            remaining -= len(content) + len(SEPARATOR)
    return pieces, used


def sample_windows(data: np.ndarray, seed: int, batch_size: int, seq_len: int, *, what: str) -> Batch:
    """``batch_size`` windows of ``data`` starting at :func:`~swarm.data.seeds.row_offsets` of ``seed``:
    inputs, and targets shifted by one token. ``what`` names the data in errors."""
    _check_shape(batch_size, seq_len)
    span = data.size - seq_len
    if span < 1:
        raise ConfigError(
            f"seq_len {seq_len} needs at least {seq_len + 1} tokens, but {what} has {data.size}"
        )
    return _windows(data, row_offsets(seed, batch_size, span), seq_len)


def spread_windows(
    data: np.ndarray, batch_size: int, seq_len: int, max_batches: int, *, what: str
) -> list[Batch]:
    """Up to ``max_batches`` batches of non-overlapping windows spread evenly over all of ``data``."""
    _check_shape(batch_size, seq_len)
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
        raise ConfigError(f"max_batches must be a positive integer, got {max_batches!r}")
    available = (data.size - 1) // seq_len
    if available < 1:
        raise ConfigError(
            f"{what} has {data.size} validation tokens, too few for seq_len {seq_len}; "
            "raise validation_fraction or add files"
        )
    count = min(available, batch_size * max_batches)
    last_start = data.size - seq_len - 1
    starts = [i * last_start // (count - 1) for i in range(count)] if count > 1 else [0]
    return [_windows(data, starts[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]


def _check_shape(batch_size: int, seq_len: int) -> None:
    for field, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field} must be a positive integer, got {value!r}")


def _windows(data: np.ndarray, starts: list[int], seq_len: int) -> Batch:
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    rows = torch.from_numpy(data[index].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
