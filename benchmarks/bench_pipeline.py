"""SWARM pipeline: throughput with one stage replica killed against all alive, and the square-cube law.

1. **Throughput under failure.** 2 stages x 2 replicas and 2 trainers, each stage server and trainer on
   its own ``SpawnedDHT`` (their own libp2p daemons) on loopback, in this process. It trains ``--steps``
   global steps with every replica alive, then kills one replica of the last stage outright (its DHT and
   daemon die, so its connections drop mid-request) and trains ``--steps`` more. Throughput is samples
   of completed micro-batches per second of wall time; lost micro-batches must stay 0.
   Where the time goes, per stage replica, over the all-alive phase: **compute** (forward and backward
   on the replica's compute thread), **averaging** (the step's all-reduce with the stage's other
   replicas, matchmaking included), **settling** (waiting for the stage's replicas to close the step:
   the exactly-once check) and **waiting** (the rest: no micro-batch to serve, the step not yet
   closed). Against it, one process trains the whole model on the same cores (the faster of 1 and
   CPU-count torch threads) with the same micro-batches and target batch: what one machine would get.
2. **Communication-to-compute ratio as the hidden size doubles.** For one middle stage of ``--blocks``
   transformer blocks and a micro-batch of B x T tokens, it measures the forward plus backward time and
   counts the bytes that cross the wire for it (fp16 activations in, fp16 gradients back: 2 x B x T x d x 2
   bytes). Compute grows as d^2 and traffic as d, so the ratio should roughly halve with each doubling
   (the SWARM paper's square-cube argument). The time that traffic would take is shown at
   ``--bandwidth-mbps``.

Usage::

    python benchmarks/bench_pipeline.py                 # defaults: 4 + 4 steps, d = 256, 512, 1024
    python benchmarks/bench_pipeline.py --quick         # smoke test: tiny model, 2 + 2 steps, d = 64..256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from swarm.config import RunConfig  # noqa: E402
from swarm.models.gpt import GPTConfig, GPTStage  # noqa: E402

STEP_TIMEOUT_S = 60.0


def square_cube(
    widths: list[int], blocks: int, batch: int, seq_len: int, bandwidth_mbps: float, repeats: int
) -> list[dict]:
    rows = []
    for d in widths:
        config = GPTConfig(d_model=d, n_layer=blocks, n_head=max(1, d // 64), seq_len=seq_len)
        stage = GPTStage(config, first_block=0, last_block=blocks, embed=False, head=False)
        x = torch.randn(batch, seq_len, d, generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(repeats + 1):
            leaf = x.clone().requires_grad_()
            started = time.perf_counter()
            out = stage(leaf)
            out.backward(torch.ones_like(out))
            if i:  # the first run warms up allocators and kernels
                times.append(time.perf_counter() - started)
        compute_s = statistics.median(times)
        wire_bytes = 2 * batch * seq_len * d * 2
        comm_s = wire_bytes * 8 / (bandwidth_mbps * 1e6)
        rows.append({"d_model": d, "compute_s": compute_s, "wire_bytes": wire_bytes, "comm_s": comm_s,
                     "comm_to_compute": comm_s / compute_s})  # fmt: skip
    return rows


def pipeline_run(model: dict, target_batch_size: int, micro_batch_size: int) -> RunConfig:
    return RunConfig.parse({
        "run_id": "bench-pipeline",
        "model": {"name": "gpt", "config": model},
        "dataset": {"name": "stdlib", "config": {"max_bytes": 2_000_000}},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 100},
        "training": {"target_batch_size": target_batch_size, "micro_batch_size": micro_batch_size,
                     "matchmaking_time_s": 1.0, "min_group_size": 1},
        "pipeline": {"stages": 2, "announce_interval_s": 0.25, "request_timeout_s": 5.0,
                     "failed_server_cooldown_s": 3.0, "rebalance_interval_s": 3600},
    })  # fmt: skip


async def _train(run: RunConfig, steps: int) -> dict:
    import shutil
    import tempfile

    from swarm.dht import start_local_dhts
    from swarm.pipeline.trainer import PipelineTrainer
    from swarm.pipeline.worker import StageWorker

    keys_dir = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))  # the nodes' identities, removed at the end
    nodes = start_local_dhts(6, keys_dir)
    dhts, keys = [d for d, _ in nodes], [k for _, k in nodes]
    ids = [k.peer_id for k in keys]
    workers = [StageWorker(run, dhts[i], peer_id=ids[i], stage=i // 2, members=set(ids), signing_key=keys[i])
               for i in range(4)]  # fmt: skip
    trainers = [PipelineTrainer(run, dhts[4 + i], peer_id=ids[4 + i], seed=i, signing_key=keys[4 + i])
                for i in range(2)]  # fmt: skip
    stop, victim_stop = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(w.run(victim_stop if i == 3 else stop)) for i, w in enumerate(workers)]
    tasks += [asyncio.create_task(t.run(stop)) for t in trainers]

    killed: set[int] = set()  # a killed replica's task may end in an error on its closed DHT: expected

    async def reach(step: int) -> float:
        deadline = time.monotonic() + STEP_TIMEOUT_S * max(1, step)
        while min(t.step for t in trainers) < step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pipeline did not reach step {step}")
            for i, task in enumerate(tasks):
                if i not in killed and task.done() and task.exception():
                    raise task.exception()
            await asyncio.sleep(0.05)
        return time.monotonic()

    def completed() -> int:
        return sum(len(t.completed) for t in trainers) * run.training.micro_batch_size

    def marks() -> list[tuple[float, float, float]]:
        return [(w.replica.busy_s, w._stats["averaging_s"], w._stats["settle_s"]) for w in workers]

    try:
        t0 = await reach(1)  # warm: every connection made, one step done
        s0, m0 = completed(), marks()
        t1 = await reach(1 + steps)
        s1, m1 = completed(), marks()
        wall = t1 - t0
        breakdown = []
        for i, (a, b) in enumerate(zip(m0, m1, strict=True)):
            compute, averaging, settle = (b[j] - a[j] for j in range(3))
            breakdown.append({"replica": i, "stage": workers[i].stage, "compute_s": compute, "averaging_s": averaging,
                              "settle_s": settle, "waiting_s": max(0.0, wall - compute - averaging - settle),
                              "wall_s": wall})  # fmt: skip
        # Kill one replica of stage 1 outright: its daemon dies and with it every open request.
        workers[3].replica.paused = False
        killed.add(3)
        dhts[3].shutdown()
        victim_stop.set()
        t2 = await reach(1 + 2 * steps)
        s2 = completed()
        lost = sum(len(t.issued - t.completed - t.waiting()) for t in trainers)
        return {
            "all_alive_samples_per_s": (s1 - s0) / (t1 - t0),
            "one_killed_samples_per_s": (s2 - s1) / (t2 - t1),
            "lost_microbatches": lost,
            "retries": sum(t.metrics()["retries"] for t in trainers),
            "breakdown": breakdown,
        }
    finally:
        stop.set()
        victim_stop.set()
        await asyncio.wait(tasks, timeout=30)
        for i, dht in enumerate(dhts):
            if i != 3:
                dht.shutdown()
        shutil.rmtree(keys_dir, ignore_errors=True)


def whole_model_samples_per_s(run: RunConfig, steps: int, threads: int) -> float:
    """One process trains the whole model on this machine's cores: micro-batches summed to the target
    batch, then an optimizer step, as the stages do together."""
    from swarm.data import build_dataset, derive_seed
    from swarm.models import build_model
    from swarm.training.state import build_optimizer

    torch.set_num_threads(threads)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    optimizer = build_optimizer(model, run.optimizer)
    dataset = build_dataset(run.dataset.name, run.dataset.config)
    batch, seq_len = run.training.micro_batch_size, int(run.model.config["seq_len"])
    per_step = -(-run.training.target_batch_size // batch)
    started, samples = None, 0
    for step in range(steps + 1):
        if step == 1:
            started, samples = time.perf_counter(), 0  # the first step warms up
        for micro in range(per_step):
            inputs, targets = dataset.sample_batch(
                derive_seed(run.run_id, "whole", step, micro), batch, seq_len
            )
            (model.loss(inputs, targets) * batch).backward()
            samples += batch
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rate = samples / (time.perf_counter() - started)
    torch.set_num_threads(1)
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument(
        "--steps", type=int, default=4, help="steps measured alive, then with a replica killed"
    )
    parser.add_argument("--blocks", type=int, default=2, help="blocks of the middle stage in the ratio test")
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0, help="link speed for the ratio test")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("swarm.pipeline").setLevel(os.environ.get("BENCH_LOG", "WARNING"))
    torch.set_num_threads(1)
    if args.quick:
        model = {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32}
        run, steps, widths, seq, repeats = pipeline_run(model, 32, 4), 2, [64, 128, 256], 64, 3
    else:
        model = {"d_model": 128, "n_layer": 4, "n_head": 4, "seq_len": 128}
        run, steps, widths, seq, repeats = pipeline_run(model, 64, 8), args.steps, [256, 512, 1024], 128, 5
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread per compute", flush=True)

    rows = square_cube(widths, args.blocks, 8, seq, args.bandwidth_mbps, repeats)
    print(f"\ncommunication to compute, one stage of {args.blocks} blocks, 8 x {seq} tokens, "
          f"{args.bandwidth_mbps:.0f} Mbit/s:")  # fmt: skip
    print("  d_model | compute ms | wire KiB | comm ms | comm/compute | vs previous")
    for i, row in enumerate(rows):
        change = f"{row['comm_to_compute'] / rows[i - 1]['comm_to_compute']:.2f}x" if i else "-"
        print(f"  {row['d_model']:7d} | {1e3 * row['compute_s']:10.1f} | {row['wire_bytes'] / 1024:8.0f} | "
              f"{1e3 * row['comm_s']:7.1f} | {row['comm_to_compute']:12.3f} | {change}")  # fmt: skip

    print(f"\nthroughput, 2 stages x 2 replicas, 2 trainers, model {model}, {steps} steps each:", flush=True)
    result = asyncio.run(_train(run, steps))
    ratio = result["one_killed_samples_per_s"] / result["all_alive_samples_per_s"]
    print(f"  all alive: {result['all_alive_samples_per_s']:.1f} samples/s")
    print(
        f"  one replica of stage 1 killed: {result['one_killed_samples_per_s']:.1f} samples/s ({ratio:.2f}x)"
    )
    print(f"  lost micro-batches: {result['lost_microbatches']}, retries: {result['retries']:.0f}")
    print("\n  where the time goes, all alive (seconds of the phase's wall time, per stage replica):")
    print("  stage | replica | compute | averaging | settling | waiting | wall")
    for row in result["breakdown"]:
        wall = row["wall_s"]
        print(f"  {row['stage']:5d} | {row['replica']:7d} | " + " | ".join(
            f"{row[k]:5.1f} ({100 * row[k] / wall:3.0f}%)" for k in ("compute_s", "averaging_s", "settle_s", "waiting_s"))
            + f" | {wall:.1f}")  # fmt: skip
    # On a loaded machine more torch threads than free cores can be far slower: take the best.
    rates = {n: whole_model_samples_per_s(run, max(2, steps), n) for n in sorted({1, os.cpu_count() or 1})}
    threads = max(rates, key=rates.get)
    whole = result["whole_model_samples_per_s"] = rates[threads]
    result["whole_model_by_threads"] = rates
    print(f"\n  one process, whole model, {threads} threads: {whole:.1f} samples/s "
          f"({', '.join(f'{n} threads: {r:.1f}' for n, r in rates.items())}); the pipeline all alive: "
          f"{result['all_alive_samples_per_s'] / whole:.2f}x of it")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"square_cube": rows, "throughput": result, "model": model}, indent=2)
        )
    return 0 if result["lost_microbatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
