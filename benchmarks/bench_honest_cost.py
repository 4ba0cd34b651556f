"""What a robust rule costs a run with only honest peers: the demo's optimization, replayed in one process.

``swarm-sim``'s run (model, data, optimizer and learning-rate schedule from ``build_run``) trained with
``--peers`` senders of ``--micro-batches`` micro-batches each. Every step, each sender's mean gradient is
computed on its own fixed batches (seeded like a peer's, so every rule sees the same gradients), and the
step applies each rule's aggregate, cut into the run's chunks as reducers cut it. Each rule trains its own
copy of the model from the same start, so the result is deterministic: no timing, no interleaving needed.

Printed per set of batches (``--batch-seeds``) and rule: validation loss at each evaluation (every ``steps // 4`` steps, as the demo evaluates),
and per step the cosine and norm ratio of the rule's aggregate to the plain mean of the same gradients.

Usage::

    python benchmarks/bench_honest_cost.py                          # the demo model, 12 steps, 3 senders
    python benchmarks/bench_honest_cost.py --quick --json cost.json   # tiny model, 2 steps: smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lab.simconfig import SimConfig, build_run
from swarm.averaging.aggregators import AGGREGATORS, get_aggregator
from swarm.averaging.evidence import DEFAULT_CHUNK_VALUES
from swarm.data.builder import build_dataset
from swarm.data.seeds import derive_seed
from swarm.models.builder import build_model, model_config
from swarm.training.state import apply_flat_gradient, build_optimizer, flat_mean_gradient


def sender_gradients(
    model, dataset, run, seq_len: int, step: int, senders: int, micro: int, batch_seed: int
) -> torch.Tensor:
    """One row per sender: its mean gradient over its own ``micro`` micro-batches of ``step``."""
    params = list(model.parameters())
    rows = []
    for sender in range(senders):
        model.zero_grad()
        samples = 0
        for index in range(micro):
            seed = derive_seed(run.run_id, f"sender-{batch_seed}-{sender}", step, index)
            x, y = dataset.sample_batch(seed, run.training.micro_batch_size, seq_len)
            (model.loss(x, y) * x.shape[0]).backward()
            samples += x.shape[0]
        rows.append(flat_mean_gradient(params, samples))
    return torch.stack(rows)


def aggregate(rule, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    weights = torch.ones(rows.shape[0])
    return torch.cat(
        [
            rule(rows[:, lo : lo + chunk].contiguous(), weights, seed=0)
            for lo in range(0, rows.shape[1], chunk)
        ]
    )


def replay(args, rule_name: str, batch_seed: int) -> dict:
    run = build_run(SimConfig(peers=args.peers, steps=args.steps, model_size=args.model_size))
    rule = get_aggregator(rule_name)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    seq_len = int(model_config(run.model.name, run.model.config).seq_len)
    dataset = build_dataset(run.dataset.name, run.dataset.config)
    validation = dataset.validation_batches(
        run.training.micro_batch_size, seq_len, run.training.validation_batches
    )
    optimizer = build_optimizer(model, run.optimizer)
    params = list(model.parameters())
    every = run.training.validation_every_steps

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(model.loss(x, y)) for x, y in validation]
        model.train()
        return sum(losses) / len(losses)

    history, cosines, norm_ratios = [(0, evaluate())], [], []
    for step in range(args.steps):
        rows = sender_gradients(
            model, dataset, run, seq_len, step, args.peers, args.micro_batches, batch_seed
        )
        mean, out = rows.mean(0), aggregate(rule, rows, args.chunk_values)
        cosines.append(float(torch.nn.functional.cosine_similarity(out, mean, dim=0)))
        norm_ratios.append(float(out.norm() / mean.norm()))
        apply_flat_gradient(model, params, optimizer, run.optimizer, step, out)
        if (step + 1) % every == 0 or step + 1 == args.steps:
            history.append((step + 1, evaluate()))
    return {
        "rule": rule_name, "batch_seed": batch_seed, "val_history": history,
        "cosine_to_mean": cosines, "norm_ratio_to_mean": norm_ratios,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (the demo test runs 12)")
    parser.add_argument("--peers", type=int, default=3, help="honest senders per step")
    parser.add_argument("--micro-batches", type=int, default=3, help="micro-batches per sender and step")
    parser.add_argument("--model-size", default="demo", help="swarm-sim's --model-size")
    parser.add_argument("--rules", default="mean,centered_clip,trimmed_mean", help="comma-separated rules")
    parser.add_argument(
        "--batch-seeds", default="0,1,2", help="comma-separated: each names another set of senders' batches"
    )
    parser.add_argument("--chunk-values", type=int, default=DEFAULT_CHUNK_VALUES, help="values per chunk")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps: a smoke test")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.steps, args.batch_seeds = "tiny", 2, "0"
    rules = [r for r in args.rules.split(",") if r]
    try:
        batch_seeds = [int(s) for s in args.batch_seeds.split(",") if s]
    except ValueError:
        parser.error(f"--batch-seeds must be comma-separated integers, got {args.batch_seeds!r}")
    unknown = sorted(set(rules) - set(AGGREGATORS.names()))
    if unknown or args.steps < 1 or args.peers < 1 or args.micro_batches < 1 or args.chunk_values < 1:
        parser.error(
            f"unknown rule(s) {unknown}; known: {AGGREGATORS.names()}" if unknown
            else "--steps, --peers, --micro-batches and --chunk-values must be >= 1"
        )  # fmt: skip
    torch.set_num_threads(1)  # as a peer's reducer runs
    results = []
    for batch_seed, rule in ((b, r) for b in batch_seeds for r in rules):
        started = time.perf_counter()
        result = replay(args, rule, batch_seed)
        results.append(result)
        losses = "  ".join(f"{step}:{loss:.3f}" for step, loss in result["val_history"])
        worst = min(range(args.steps), key=lambda i: result["cosine_to_mean"][i])
        print(
            f"batches {batch_seed} {rule:>18} | val {losses} | "
            f"lowest cosine to mean {result['cosine_to_mean'][worst]:.2f} "
            f"(norm ratio {result['norm_ratio_to_mean'][worst]:.2f}) at step {worst} | "
            f"{time.perf_counter() - started:.0f}s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
