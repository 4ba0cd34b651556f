"""``hf-dataset``: local text, JSON lines or Parquet files read with ``datasets``, tokenized with a local
tokenizer, and sampled by seed like every other dataset (:class:`~swarm.data.tokens.TokenDataset`).

Only local files are read: ``load_dataset("text" | "json" | "parquet", data_files=...)`` and
``AutoTokenizer.from_pretrained(folder, local_files_only=True)``; a path that is not on this machine (a
hub name included) is refused naming the field. Needs the Hugging Face extra (``pip install -e ".[hf]"``).

Example::

    dataset = build_dataset("hf-dataset", {"files": ["corpus.jsonl"], "tokenizer_path": "tokenizer/"})
    inputs, targets = dataset.sample_batch(derive_seed("demo", "peer-a", 0), batch_size=8, seq_len=128)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import ConfigError
from swarm.data.builder import register_dataset
from swarm.data.corpus import split_score
from swarm.data.tokens import TokenDataset
from swarm.hf_import import import_hf, local_path

NAME = "hf-dataset"
_WHAT = f"dataset '{NAME}'"
_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_TOKENIZE_CHUNK = 1024

Format = Literal["text", "json", "parquet"]


class HFDatasetConfig(BaseModel):
    """Local files of one format and a local tokenizer; validation from held-out files or records."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: Local files may be edited between builds, so every build reads them again.
    cacheable: ClassVar[bool] = False

    files: tuple[str, ...] = Field(
        ..., min_length=1, max_length=1024, description="Local training files, in order; '~' is expanded."
    )
    tokenizer_path: str = Field(
        ..., min_length=1, max_length=4096, description="A local tokenizer folder (save_pretrained's)."
    )
    format: Format | None = Field(
        None, description="'text', 'json' (JSON lines) or 'parquet'; None: from the files' extension."
    )
    text_field: str = Field(
        "text", min_length=1, max_length=128, description="Column holding the text (json and parquet)."
    )
    validation_files: tuple[str, ...] = Field(
        (), max_length=1024, description="Held-out files; none: hold out records by content hash."
    )
    validation_fraction: float = Field(
        0.02, ge=0.0, le=0.5, description="Share of records held out when no validation_files are given."
    )
    max_tokens: int | None = Field(
        None, ge=1024, le=2**40, description="Cap on tokens (train and validation); None for all."
    )
    cache_dir: str | None = Field(
        None, min_length=1, max_length=4096, description="datasets' Arrow cache; None for its default."
    )


@register_dataset(NAME, HFDatasetConfig)
def build_hf_dataset(config: HFDatasetConfig) -> TokenDataset:
    files = [str(_file(f, "files")) for f in config.files]
    held_out = [str(_file(f, "validation_files")) for f in config.validation_files]
    fmt = config.format or _infer_format(files + held_out)
    tokenizer = _tokenizer(config.tokenizer_path)
    records = _read(files, fmt, config)
    if held_out:
        train, validation = records, _read(held_out, fmt, config)
    else:
        train, validation = _hold_out(records, config.validation_fraction)
    train_budget = validation_budget = None
    if config.max_tokens is not None:
        validation_budget = round(config.max_tokens * config.validation_fraction) if validation else 0
        train_budget = config.max_tokens - validation_budget
    return TokenDataset(
        NAME,
        _tokenize(tokenizer, train, train_budget),
        _tokenize(tokenizer, validation, validation_budget),
        vocab_size=len(tokenizer),
    )


def _file(value: str, field: str) -> Path:
    path = local_path(value, field, _WHAT, want="file")
    if not path.is_file():
        raise ConfigError(f"{_WHAT}: field '{field}': {value!r} is not a file")
    return path


def _infer_format(files: list[str]) -> Format:
    found = {_FORMATS.get(Path(f).suffix.lower()) for f in files}
    if None in found or len(found) != 1:
        raise ConfigError(
            f"{_WHAT}: cannot tell the format of {files!r} from their extensions "
            f"({', '.join(sorted(_FORMATS))}, all one format): set the field 'format'"
        )
    return found.pop()


def _tokenizer(value: str) -> Any:
    transformers = import_hf("transformers", _WHAT)
    path = local_path(value, "tokenizer_path", _WHAT, want="folder")
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"{_WHAT}: field 'tokenizer_path': no tokenizer could be loaded from {value!r}: {exc}"
        ) from None


def _read(files: list[str], fmt: Format, config: HFDatasetConfig) -> list[str]:
    datasets = import_hf("datasets", _WHAT)
    options: dict[str, Any] = {"sample_by": "paragraph"} if fmt == "text" else {}
    try:
        table = datasets.load_dataset(
            fmt, data_files=files, split="train", cache_dir=config.cache_dir, **options
        )
    except Exception as exc:  # datasets raises many kinds for a malformed file; the user fixes the file
        raise ConfigError(f"{_WHAT}: cannot read {fmt} files {files!r}: {exc}") from None
    field = "text" if fmt == "text" else config.text_field
    if field not in table.column_names:
        raise ConfigError(
            f"{_WHAT}: field 'text_field': {files!r} have no column {field!r} (columns: {table.column_names})"
        )
    texts = list(table[field])
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(
                f"{_WHAT}: field 'text_field': row {row} of {files!r} holds {type(text).__name__}, not text"
            )
    return texts


def _hold_out(records: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Records whose content scores under ``fraction`` are held out (duplicates land in one split); with
    two or more records both splits get at least one when ``fraction`` is above 0."""
    scores = [split_score(text) for text in records]
    held = {i for i, score in enumerate(scores) if score < fraction}
    if fraction > 0 and not held and len(records) >= 2:
        held = {min(range(len(records)), key=scores.__getitem__)}
    if held and len(held) == len(records):
        held.discard(max(range(len(records)), key=scores.__getitem__))
    train = [text for i, text in enumerate(records) if i not in held]
    return train, [text for i, text in enumerate(records) if i in held]


def _tokenize(tokenizer: Any, texts: list[str], budget: int | None) -> np.ndarray:
    """Every text's ids followed by the end-of-text token (when the tokenizer has one), cut at ``budget``."""
    end = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    pieces: list[np.ndarray] = []
    total = 0
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        encoded = tokenizer(texts[start : start + _TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray(ids + end, dtype=np.int64))
            total += pieces[-1].size
            if budget is not None and total >= budget:
                return np.concatenate(pieces)[:budget]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
