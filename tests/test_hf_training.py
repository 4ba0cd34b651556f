"""Two real peers (each with its own DHT process on loopback) train a transformers model on a local
`datasets` corpus through the built-in Trainer, and end bit-identical with a lower validation loss."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import run_then_shut_down, start_dhts
from test_hf import GPT2, documents, save_tokenizer, write_corpus
from test_training import trainers_for, wait_for

from lab.localswarm import tiny_run

pytest.importorskip("transformers", reason='the [hf] extra: pip install -e ".[hf]"')

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_two_peers_train_a_transformers_model_on_local_files_to_one_state(tmp_path: Path) -> None:
    texts = documents()
    dataset = {
        "files": [str(write_corpus(tmp_path / "data", texts, "json"))],
        "tokenizer_path": str(save_tokenizer(tmp_path / "tokenizer", texts)),
        "validation_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"),
    }
    run = tiny_run("hf-run", max_steps=4, min_group_size=2, validation_every_steps=2).model_copy(
        update={
            "model": tiny_run().model.model_copy(update={"name": "hf-causal-lm", "config": GPT2}),
            "dataset": tiny_run().dataset.model_copy(update={"name": "hf-dataset", "config": dataset}),
        }
    )
    dhts = start_dhts(2)
    trainers = trainers_for(run, dhts)

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers]
        await wait_for(lambda: all(t.finished for t in trainers), 120, "both peers to reach max_steps")
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    run_then_shut_down(scenario(), dhts)
    first, second = trainers
    assert first.step == second.step == 4
    assert first.param_hash == second.param_hash and first.state_hash == second.state_hash
    assert first.metrics()["rounds_ok"] >= 1
    (_, initial), final = first.peer.first_validation, first.metrics()["val_loss"]
    assert final < initial - 0.2, (initial, final)
