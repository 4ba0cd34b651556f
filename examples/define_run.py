"""Define a collaborative run in Python, check it, and write the TOML the coordinator reads.

    python examples/define_run.py my-run.toml
    swarm-coordinator start --config my-run.toml                  # the organizer
    swarm-peer join --coordinator HOST:31330 --join-token s3cret   # each volunteer

Everything is validated before anything starts: a wrong field name, an out-of-range value or an
architecture the registry does not have is reported with the field that is wrong.
"""

from __future__ import annotations

import sys

import swarm


def main(path: str) -> None:
    run = swarm.RunConfig(
        run_id="stdlib-gpt-8layer",
        description="An 8-layer byte-level GPT on the Python standard library's source.",
        model={"name": "gpt", "config": {"d_model": 256, "n_layer": 8, "n_head": 8, "seq_len": 256}},
        dataset={"name": "stdlib", "config": {"validation_fraction": 0.02}},
        optimizer={
            "name": "adamw",
            "lr": 6e-4,
            "warmup_steps": 50,
            "total_steps": 5000,
            "schedule": "cosine",
        },
        training={
            "target_batch_size": 512,  # samples per global step, summed over all peers
            "micro_batch_size": 8,  # samples per forward/backward on one peer
            "compression": "fp16",  # what the all-reduce sends
            "aggregator": "mean",  # the rule each reducer applies to its part
            "checkpoint_every_steps": 100,
        },
        admission={"policy": "token", "join_token": "s3cret"},
    )
    swarm.check_components(run)  # the model, dataset and aggregator exist and accept these configs
    model = swarm.build_model(run.model.name, run.model.config, seed=run.training.seed)
    print(f"{run.run_id}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    run.to_toml(path)
    assert swarm.RunConfig.from_toml(path) == run
    print(f"wrote {path}; start it with: swarm-coordinator start --config {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run.toml")
