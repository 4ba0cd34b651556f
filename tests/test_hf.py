"""The Hugging Face extra: a transformers causal LM from a config and a `datasets` corpus from local files,
with a tokenizer built here, used as a run's model and dataset. Nothing is downloaded: the network is cut
around every build."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocols.errors import ConfigError
from swarm.contract import SampledDataset, TrainableModel
from swarm.data import build_dataset, derive_seed
from swarm.models import build_model

transformers = pytest.importorskip("transformers", reason='the [hf] extra: pip install -e ".[hf]"')
datasets = pytest.importorskip("datasets", reason='the [hf] extra: pip install -e ".[hf]"')
tokenizers = pytest.importorskip("tokenizers", reason='the [hf] extra: pip install -e ".[hf]"')

pytestmark = pytest.mark.timeout(120)

VOCAB = 320
SEQ_LEN = 32
GPT2 = {
    "model_type": "gpt2",
    "hf_config": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": VOCAB, "n_positions": 64},
    "seq_len": SEQ_LEN,
}
LLAMA = {
    "model_type": "llama",
    "hf_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64,
    },
    "seq_len": SEQ_LEN,
}  # fmt: skip
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "near",
    "old",
    "river",
    "stones",
]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every connection attempt fails the test: a build that reached for a hub would show here."""

    def refuse(self, address, *args, **kwargs):
        raise AssertionError(f"a connection to {address!r} was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def documents(count: int = 120) -> list[str]:
    """Sentences with a learnable pattern (each word follows the one before it in WORDS, cyclically)."""
    return [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 9)) + f" number {i}"
        for i in range(count)
    ]


def save_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A word-level tokenizer trained on ``texts`` and saved as transformers would load it, offline."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(folder))
    assert len(fast) <= VOCAB
    return folder


def write_corpus(folder: Path, texts: list[str], fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        path = folder / "corpus.txt"
        path.write_text("\n\n".join(texts))
    elif fmt == "json":
        path = folder / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    else:
        path = folder / "corpus.parquet"
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(path))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    """An hf-dataset config over a JSON lines file, with its tokenizer and cache in tmp_path."""
    texts = documents()
    return {
        "files": [str(write_corpus(tmp_path / "data", texts, "json"))],
        "tokenizer_path": str(save_tokenizer(tmp_path / "tokenizer", texts)),
        "validation_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"),
    }


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_model_from_a_config_meets_the_contract_and_one_seed_gives_one_model(config: dict) -> None:
    rng = torch.get_rng_state()
    first, again = build_model("hf-causal-lm", config, seed=7), build_model("hf-causal-lm", config, seed=7)
    assert torch.equal(rng, torch.get_rng_state()), "the caller's global random state is untouched"
    assert isinstance(first, TrainableModel)
    assert same_parameters(first, again)
    assert not same_parameters(first, build_model("hf-causal-lm", config, seed=8))
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = first.loss(inputs, targets)
    assert torch.equal(loss, again.loss(inputs, targets)), "bit-identical losses"
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5, "near uniform at init"
    with pytest.raises(ConfigError, match="vocab_size"):
        first.loss(torch.full((1, 4), VOCAB), targets[:1, :4])


def test_a_local_config_file_builds_with_dropout_off(tmp_path: Path) -> None:
    fields = {"model_type": "gpt2", **GPT2["hf_config"], "resid_pdrop": 0.1, "attn_pdrop": 0.1}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    model = build_model("hf-causal-lm", {"config_path": str(tmp_path), "seq_len": SEQ_LEN}, seed=0)
    assert same_parameters(model, build_model("hf-causal-lm", GPT2, seed=0)), "the file is the inline config"
    assert model.lm.config.resid_pdrop == model.lm.config.attn_pdrop == 0.0
    model.train()
    x = torch.randint(0, VOCAB, (2, SEQ_LEN))
    assert torch.equal(model.loss(x, x), model.loss(x, x)), "training-mode losses are reproducible"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"config_path": "gpt2"}, r"field 'config_path': 'gpt2' is not a local .*hub name"),
        ({"config_path": "openai-community/gpt2"}, r"field 'config_path'.*hub name"),
        ({"model_type": "gpt2", "hf_config": {"n_layers": 2}}, r"field 'hf_config\.n_layers'"),
        ({"model_type": "no-such-model"}, r"'no-such-model'.*'model_type'"),
        ({"model_type": "gpt2", "hf_config": {"auto_map": {}}}, r"hf_config\.auto_map"),
        (
            {"model_type": "gpt2", "hf_config": {"attn_pdrop": 0.1}},
            r"field 'hf_config\.attn_pdrop' must be 0",
        ),
        (
            {"model_type": "gpt2", "seq_len": 4096},
            r"field 'seq_len' \(4096\) is longer than the config's max_position_embeddings",
        ),
        ({"model_type": "t5"}, r"no causal LM"),
        ({}, r"exactly one of the fields 'config_path'"),
    ],
)
def test_a_bad_model_config_names_the_field(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model("hf-causal-lm", config, seed=0)


@pytest.mark.parametrize("fmt", ["text", "json", "parquet"])
def test_text_json_lines_and_parquet_give_one_corpus(tmp_path: Path, fmt: str) -> None:
    texts = documents(40)
    tokenizer = save_tokenizer(tmp_path / "tokenizer", texts)
    config = {
        "tokenizer_path": str(tokenizer),
        "cache_dir": str(tmp_path / "cache"),
        "validation_fraction": 0.2,
    }
    built = build_dataset("hf-dataset", {**config, "files": [str(write_corpus(tmp_path / fmt, texts, fmt))]})
    reference = build_dataset(
        "hf-dataset", {**config, "files": [str(write_corpus(tmp_path / "r", texts, "json"))]}
    )
    assert isinstance(built, SampledDataset)
    assert built.train_tokens > 300 and built.validation_tokens > 20
    assert built.fingerprint == reference.fingerprint, "one corpus whatever the file format"


def test_batches_follow_the_seed_and_validation_is_held_out(corpus: dict) -> None:
    first, again = build_dataset("hf-dataset", corpus), build_dataset("hf-dataset", corpus)
    seed = derive_seed("hf-run", "peer-a", step=3)
    inputs, targets = first.sample_batch(seed, 8, SEQ_LEN)
    assert inputs.shape == targets.shape == (8, SEQ_LEN) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the inputs shifted by one token"
    again_inputs, again_targets = again.sample_batch(seed, 8, SEQ_LEN)
    assert torch.equal(inputs, again_inputs) and torch.equal(targets, again_targets)
    other, _ = first.sample_batch(derive_seed("hf-run", "peer-b", step=3), 8, SEQ_LEN)
    assert not torch.equal(inputs, other)
    validation = first.validation_batches(2, SEQ_LEN, 2)
    assert [x.shape for x, _ in validation] == [(2, SEQ_LEN)] * 2
    assert all(
        torch.equal(a, b)
        for (a, _), (b, _) in zip(validation, again.validation_batches(2, SEQ_LEN, 2), strict=True)
    )
    assert validation[0][0][0].tolist() == first.validation[:SEQ_LEN].tolist(), (
        "drawn from the held-out split"
    )
    assert 0 < first.validation_tokens < first.train_tokens / 4


def test_validation_files_are_the_validation_split(tmp_path: Path, corpus: dict) -> None:
    extra = write_corpus(tmp_path / "held", documents(140)[120:], "json")
    dataset = build_dataset("hf-dataset", {**corpus, "validation_files": [str(extra)]})
    whole = build_dataset("hf-dataset", {**corpus, "validation_fraction": 0.0})
    assert dataset.train_tokens == whole.train_tokens, "every record of files is training data"
    assert dataset.validation_tokens > 0 and whole.validation_tokens == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer_path": "gpt2"}, r"field 'tokenizer_path': 'gpt2' is not a local folder.*hub name"),
        ({"files": ["wikitext/wikitext-2"]}, r"field 'files': 'wikitext/wikitext-2' is not a local file"),
        ({"files": ["/nonexistent/corpus.jsonl"]}, r"field 'files'.*'/nonexistent/corpus.jsonl'"),
        ({"validation_files": ["/nonexistent/v.jsonl"]}, r"field 'validation_files'"),
        ({"text_field": "body"}, r"field 'text_field'.*'body'.*columns"),
        ({"format": "csv"}, r"field 'format'"),
    ],
)
def test_a_bad_dataset_config_names_the_field(corpus: dict, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_dataset("hf-dataset", {**corpus, **change})


def test_a_folder_that_is_not_a_tokenizer_and_unknown_extensions_are_refused(
    tmp_path: Path, corpus: dict
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="field 'tokenizer_path': no tokenizer could be loaded"):
        build_dataset("hf-dataset", {**corpus, "tokenizer_path": str(tmp_path / "empty")})
    odd = tmp_path / "corpus.data"
    odd.write_text("words")
    with pytest.raises(ConfigError, match="set the field 'format'"):
        build_dataset("hf-dataset", {**corpus, "files": [str(odd)]})
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ConfigError, match="cannot read json files"):
        build_dataset("hf-dataset", {**corpus, "files": [str(broken)]})


def test_a_few_adam_steps_on_the_local_corpus_lower_the_validation_loss(corpus: dict) -> None:
    dataset = build_dataset("hf-dataset", corpus)
    model = build_model("hf-causal-lm", GPT2, seed=0)
    validation = dataset.validation_batches(8, SEQ_LEN, 2)

    def validation_loss() -> float:
        model.eval()
        with torch.no_grad():
            return sum(model.loss(x, y).item() for x, y in validation) / len(validation)

    before = validation_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(30):
        optimizer.zero_grad()
        model.loss(*dataset.sample_batch(derive_seed("hf-run", "peer-a", step), 8, SEQ_LEN)).backward()
        optimizer.step()
    after = validation_loss()
    assert after < before - 1.0, (before, after)


def test_importing_swarm_and_its_registries_loads_no_hugging_face_module() -> None:
    probe = (
        "import sys, swarm, swarm.models, swarm.data, peer.cli, coordinator.cli\n"
        "print(sorted(m for m in ('transformers', 'datasets', 'tokenizers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_the_extra_building_says_how_to_install_it(monkeypatch, corpus: dict) -> None:
    for module in ("transformers", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[hf\]"'):
        build_model("hf-causal-lm", GPT2, seed=0)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[hf\]"'):
        build_dataset("hf-dataset", corpus)
