"""Datasets: deterministic batches, a stable per-file split, fingerprints, and config errors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from protocols.errors import ConfigError
from swarm.data import (
    SEPARATOR,
    ByteDataset,
    StdlibConfig,
    available_datasets,
    build_dataset,
    dataset_config,
    derive_seed,
    split_score,
)
from swarm.data.sources import build_stdlib

pytestmark = pytest.mark.timeout(60)

SMALL_STDLIB = {"max_bytes": 200_000, "validation_fraction": 0.1}


def _write_corpus(folder: Path, count: int, start: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        (folder / f"doc{i:03d}.txt").write_text(f"document {i}\n" + "lorem ipsum dolor sit amet " * (i + 20))


def _text_files(folder: Path, **config) -> ByteDataset:
    return build_dataset("text-files", {"paths": [str(folder)], **config})


def test_derive_seed_is_a_stable_63_bit_function_of_run_peer_step() -> None:
    seed = derive_seed("run-1", "peer-a", 5)
    assert seed == derive_seed("run-1", "peer-a", 5, micro=0)
    assert 0 <= seed < 2**63
    others = {
        derive_seed("run-2", "peer-a", 5),
        derive_seed("run-1", "peer-b", 5),
        derive_seed("run-1", "peer-a", 6),
        derive_seed("run-1", "peer-a", 5, micro=1),
    }
    assert seed not in others and len(others) == 4
    # Length-prefixed ids: moving a character between run and peer gives another seed.
    assert derive_seed("ab", "c", 0) != derive_seed("a", "bc", 0)
    with pytest.raises(ConfigError, match="step"):
        derive_seed("run-1", "peer-a", -1)


def test_same_run_peer_step_gives_bit_identical_batches_on_a_fresh_build() -> None:
    dataset = build_dataset("stdlib", SMALL_STDLIB)
    # Built again from disk, bypassing the in-process cache: as another machine would.
    rebuilt = build_stdlib(StdlibConfig(**SMALL_STDLIB))
    assert rebuilt is not dataset and rebuilt.fingerprint == dataset.fingerprint
    seed = derive_seed("run-1", "peer-a", 3)
    inputs, targets = dataset.sample_batch(seed, batch_size=8, seq_len=64)
    again_inputs, again_targets = rebuilt.sample_batch(seed, batch_size=8, seq_len=64)
    assert torch.equal(inputs, again_inputs) and torch.equal(targets, again_targets)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (8, 64)


def test_different_peers_and_steps_get_different_batches() -> None:
    dataset = build_dataset("stdlib", SMALL_STDLIB)
    batches = [
        dataset.sample_batch(derive_seed("run-1", peer, step), 8, 64)[0]
        for peer in ("peer-a", "peer-b")
        for step in (0, 1)
    ]
    for i, a in enumerate(batches):
        for b in batches[i + 1 :]:
            assert not torch.equal(a, b)


def test_targets_are_inputs_shifted_by_one_byte_of_the_corpus() -> None:
    dataset = build_dataset("stdlib", SMALL_STDLIB)
    inputs, targets = dataset.sample_batch(derive_seed("run-1", "peer-a", 0), 4, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    corpus = dataset.train.tobytes()
    for row_in, row_out in zip(inputs, targets, strict=True):
        assert bytes(row_in.tolist()) + bytes(row_out[-1:].tolist()) in corpus


def test_stdlib_is_python_source_without_tests_or_site_packages() -> None:
    dataset = build_dataset("stdlib")
    files = dataset.train_files + dataset.validation_files
    assert "os.py" in files and "json/__init__.py" in files
    assert all(path.endswith(".py") for path in files)
    for path in files:
        parts = path.split("/")[:-1]
        assert not {"test", "tests", "site-packages", "dist-packages"} & set(parts), path
        assert not path.startswith("idlelib/idle_test/")
    assert list(dataset.train_files) == sorted(dataset.train_files)
    assert dataset.num_bytes > 1_000_000
    assert dataset.num_bytes == dataset.train_bytes + dataset.validation_bytes
    assert len(dataset.fingerprint) == 64
    assert build_dataset("stdlib") is dataset  # loaded once per process


def test_train_and_validation_files_are_disjoint_and_the_split_is_per_file(tmp_path: Path) -> None:
    stdlib = build_dataset("stdlib")
    assert not set(stdlib.train_files) & set(stdlib.validation_files)
    assert stdlib.validation_files
    assert all(split_score(path) < 0.02 for path in stdlib.validation_files)

    _write_corpus(tmp_path / "docs", 40)
    before = _text_files(tmp_path / "docs", validation_fraction=0.2)
    assert before.validation_files and not set(before.train_files) & set(before.validation_files)
    _write_corpus(tmp_path / "docs", 20, start=40)
    after = _text_files(tmp_path / "docs", validation_fraction=0.2)
    # Adding files never moves an existing file between train and validation.
    assert set(before.validation_files) <= set(after.validation_files)
    assert set(before.train_files) <= set(after.train_files)


def test_fingerprint_follows_content_and_names_not_location(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "a", 5)
    original = _text_files(tmp_path / "a")
    assert _text_files(tmp_path / "a").fingerprint == original.fingerprint
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "a")
    assert _text_files(tmp_path / "elsewhere" / "a").fingerprint == original.fingerprint

    (tmp_path / "a" / "doc002.txt").write_text("edited\n")
    edited = _text_files(tmp_path / "a")
    assert edited.fingerprint != original.fingerprint

    (tmp_path / "a" / "doc002.txt").rename(tmp_path / "a" / "renamed.txt")
    assert _text_files(tmp_path / "a").fingerprint != edited.fingerprint


def test_text_files_reads_files_and_folders_by_glob(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "docs" / "nested", 3)
    (tmp_path / "docs" / "notes.md").write_text("# not matched\n")
    (tmp_path / "docs" / ".hidden.txt").write_text("hidden\n")
    (tmp_path / "single.md").write_text("one file given by path\n")
    dataset = build_dataset(
        "text-files", {"paths": [str(tmp_path / "docs"), str(tmp_path / "single.md")], "glob": "*.txt"}
    )
    files = set(dataset.train_files + dataset.validation_files)
    assert files == {"nested/doc000.txt", "nested/doc001.txt", "nested/doc002.txt", "single.md"}
    expected = sum(len(p.read_bytes()) + len(SEPARATOR) for p in (tmp_path / "docs" / "nested").iterdir())
    assert dataset.num_bytes == expected + len(b"one file given by path\n") + len(SEPARATOR)


def test_missing_or_empty_text_paths_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=re.escape(f"'{missing}' does not exist")):
        _text_files(missing)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"empty.* has no files matching '\*\.txt'"):
        _text_files(tmp_path / "empty")
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(ConfigError, match="blank.txt.* hold no bytes"):
        build_dataset("text-files", {"paths": [str(tmp_path / "blank.txt")]})


def test_max_bytes_caps_the_corpus_deterministically() -> None:
    capped = build_stdlib(StdlibConfig(max_bytes=50_000, validation_fraction=0.1))
    assert capped.num_bytes == 50_000
    assert capped.validation_bytes == 5_000
    again = build_stdlib(StdlibConfig(max_bytes=50_000, validation_fraction=0.1))
    assert capped.fingerprint == again.fingerprint
    assert capped.data.tobytes() == again.data.tobytes()
    assert capped.fingerprint != build_dataset("stdlib", {"max_bytes": 60_000}).fingerprint


def test_validation_batches_are_fixed_and_spread_over_the_split() -> None:
    dataset = build_dataset("stdlib", SMALL_STDLIB)
    first = dataset.validation_batches(batch_size=4, seq_len=64, max_batches=3)
    rebuilt = build_stdlib(StdlibConfig(**SMALL_STDLIB)).validation_batches(4, 64, 3)
    assert len(first) == 3
    for (a_in, a_out), (b_in, b_out) in zip(first, rebuilt, strict=True):
        assert a_in.shape == (4, 64)
        assert torch.equal(a_in, b_in) and torch.equal(a_out, b_out)
    validation = dataset.validation.tobytes()
    last_input, last_target = first[-1]
    assert validation.endswith(bytes(last_input[-1].tolist()) + bytes(last_target[-1, -1:].tolist()))
    assert validation.startswith(bytes(first[0][0][0].tolist()))
    # More batches than the split holds: every window once, the last batch partial.
    windows = (dataset.validation_bytes - 1) // 64
    everything = dataset.validation_batches(batch_size=64, seq_len=64, max_batches=10_000)
    assert sum(len(inputs) for inputs, _ in everything) == windows


def test_a_single_file_has_no_validation_split(tmp_path: Path) -> None:
    (tmp_path / "only.txt").write_text("x" * 5000)
    dataset = build_dataset("text-files", {"paths": [str(tmp_path / "only.txt")], "validation_fraction": 0.5})
    assert dataset.train_files == ("only.txt",) and dataset.validation_files == ()
    with pytest.raises(ConfigError, match="validation"):
        dataset.validation_batches(4, 16, 1)


def test_bad_sampling_arguments_are_config_errors() -> None:
    dataset = build_dataset("stdlib", SMALL_STDLIB)
    with pytest.raises(ConfigError, match="unknown split 'test'; available: train, validation"):
        dataset.sample_batch(0, 2, 8, split="test")
    with pytest.raises(ConfigError, match="seq_len 10000000 needs"):
        dataset.sample_batch(0, 2, 10_000_000)
    with pytest.raises(ConfigError, match="batch_size"):
        dataset.sample_batch(0, 0, 8)


def test_unknown_dataset_lists_the_available_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown dataset 'wikipedia'; available: hf-dataset, stdlib, text-files"
    ):
        build_dataset("wikipedia", {})
    assert {"stdlib", "text-files"} <= set(available_datasets())


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "stdlib",
            {"max_byte": 5000},
            r"unknown field 'max_byte' \(known fields: validation_fraction, max_bytes\)",
        ),
        ("stdlib", {"validation_fraction": 0.9}, r"field 'validation_fraction': .*less than or equal to 0.5"),
        ("stdlib", {"max_bytes": 10}, r"field 'max_bytes'"),
        ("text-files", {}, r"missing required field 'paths'"),
        ("text-files", {"paths": []}, r"field 'paths'"),
    ],
)
def test_bad_config_names_the_field(name: str, config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_dataset(name, config)


def test_dataset_config_returns_typed_defaults() -> None:
    config = dataset_config("stdlib")
    assert isinstance(config, StdlibConfig)
    assert (config.validation_fraction, config.max_bytes) == (0.02, None)
