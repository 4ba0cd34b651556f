"""Compute utilization, samples/s and bytes on the wire of collaborative training with 2 peers.

Each peer is its own process (spawned, ``torch.set_num_threads(1)``: one core each on a 2-core
machine) running ``swarm.training.trainer.Trainer`` on its own ``SpawnedDHT``, all on loopback. They train the
demo model (the default ``gpt`` config, or ``--model-config``) for ``--steps`` global steps.

Figures are taken over the steady state: from the moment a peer reaches step 1 (its first round done,
connections warm) to the moment it reaches the last step. Compute utilization is the time spent in
forward/backward and the optimizer step (the trainer's own ``compute_s``) over that wall time, per peer. Samples/s counts the
samples of every round in the window (the group's summed weights); bytes on the wire are the all-reduce
payloads every peer sent (DHT traffic and the p2p framing are not counted). The rest of each step's wall
time is split into matchmaking, the all-reduce itself, and other (hashing the state, waiting for a fresh
view of the run's progress).

The target batch is the run config's default, 256 sequences of 256 bytes (65,536 tokens) per global
step, in micro-batches of 8: a common size for a 5M-parameter language model (nanoGPT's character-level
Shakespeare recipe, a model of this size, uses 64 x 256 per step on one GPU; data-parallel runs scale the
batch with the number of workers). ``--target-batch-size 64`` shows how a smaller batch fares.

Usage::

    python benchmarks/bench_training.py                          # demo gpt, 2 peers, 4 steps
    python benchmarks/bench_training.py --quick                  # tiny model, 3 steps (smoke test)
    python benchmarks/bench_training.py --model-config '{"n_layer": 4}' --json results.json
    python benchmarks/bench_training.py --compare-sender-checks 0,1 --verify-probability 1.0 --repeats 2
    python benchmarks/bench_training.py --sync diloco --inner-steps 20 --compression int8 --steps 6 \
        --compare-sender-checks 0,0.5 --repeats 3           # diloco window replays at the run's defaults
    python benchmarks/bench_training.py --peers 3 --sync diloco --inner-steps 20 --compression int8 \
        --steps 6 --compare-sender-checks 0,0.25 --repeats 3   # with the reducers' scores and fits (3+ peers)

``--compare-sender-checks`` prices the sender checks (``swarm.training.sendercheck``) in an honest run:
the same training once per ``training.sender_check_probability`` given, round by round, each one's
samples/s over the first's in the same round, how many senders the validators replayed (and how many of
those the scores or fits pointed to rather than the draw), how many fits the reducers scored, the seconds
the replays and fits took over each peer's seconds of training (min-max over rounds), and the bytes per
sample over the first's. Probability 0 turns every sender check off
(replays, scores and fits); the reducers' scores and fits need 3 inputs to a chunk, so ``--peers 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

PEERS = 2
TARGET_UTILIZATION = 0.90
START_TIMEOUT_S = 90.0
SHUTDOWN_TIMEOUT_S = 15.0
QUICK_MODEL = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 32}


@dataclass(frozen=True)
class Settings:
    model_config: dict
    target_batch_size: int
    micro_batch_size: int
    steps: int
    matchmaking_time_s: float
    max_bytes: int
    threads: int
    sender_check_probability: float | None = None  # None: the run's default
    verify_probability: float | None = None
    sync: str = "every_step"
    inner_steps: int = 20  # diloco: inner steps per outer step (a step of the run)
    compression: str | None = None  # None: the run's (fp16)
    peers: int = PEERS  # processes, all in every round

    def run_config(self):
        from swarm.config import RunConfig

        return RunConfig(
            run_id="bench-training",
            model={"name": "gpt", "config": self.model_config},
            dataset={"name": "stdlib", "config": {"max_bytes": self.max_bytes}},
            training={
                "target_batch_size": self.target_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "max_steps": self.steps,
                "matchmaking_time_s": self.matchmaking_time_s,
                "validation_batches": 1,
                # Every peer takes part in every round: none steps alone, so none falls behind and
                # catches up by download, which would hide its compute from the measured window.
                "min_group_size": self.peers,
                "sync": self.sync,
                **({"inner_steps": self.inner_steps, "window_stretch": 1.0} if self.sync == "diloco" else {}),
                **({} if self.compression is None else {"compression": self.compression}),
                **(
                    {} if self.verify_probability is None else {"verify_probability": self.verify_probability}
                ),
                **(
                    {}
                    if self.sender_check_probability is None
                    else {"sender_check_probability": self.sender_check_probability}
                ),
            },
        )


# --- one peer -------------------------------------------------------------------------------------------


def _instrument(trainer, rounds: list[dict]) -> None:
    """Time each round's all-reduce apart from its matchmaking, through the averager's public hooks."""
    from swarm.averaging.allreduce import ButterflyAllReduce

    runs: dict[bytes, float] = {}

    class TimedAllReduce(ButterflyAllReduce):
        async def run(self):
            started = time.monotonic()
            try:
                return await super().run()
            finally:
                runs[self.group_id] = time.monotonic() - started

    averager = trainer.averager
    averager.runner_type = TimedAllReduce
    average = averager.average

    async def timed_average(vector, weight, extra=None, **kwargs):
        started = time.monotonic()
        outcome = await average(vector, weight, extra, **kwargs)
        record = {"at": time.monotonic(), "round_s": time.monotonic() - started, "ok": False}
        if outcome is not None:
            group, result = outcome
            record.update(
                ok=result.complete, group=len(group.peer_ids), weight=float(weight),
                group_weight=float(sum(group.weights)), allreduce_s=runs.pop(group.group_id, 0.0),
                bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
            )  # fmt: skip
        rounds.append(record)
        return outcome

    averager.average = timed_average


async def _train(conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    import tempfile

    from swarm.dht import SpawnedDHT
    from swarm.identity import create_identity
    from swarm.training.trainer import Trainer

    home = tempfile.TemporaryDirectory(prefix="swarm-bench-")
    identity = Path(home.name) / "peer.key"
    key = create_identity(identity)  # signed rounds over the TCP data path, as a volunteer's
    dht = SpawnedDHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers,
        identity_path=str(identity), check_if_identity_free=False,
    )  # fmt: skip
    try:
        run = settings.run_config()
        trainer = await asyncio.to_thread(Trainer, run, dht, peer_id=key.peer_id, signing_key=key)
        rounds: list[dict] = []
        _instrument(trainer, rounds)
        conn.send(("ready", {"params": trainer.peer.numel}))
        await asyncio.to_thread(conn.recv)  # "go": both peers are built, so neither trains alone at first

        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop))
        steps: list[dict] = []  # the moment each step was reached, with the compute time up to then
        deadline = time.monotonic() + settings.steps * 600
        while not trainer.finished and not task.done() and time.monotonic() < deadline:
            metrics = trainer.metrics()
            if not steps or metrics["step"] > steps[-1]["step"]:
                steps.append(
                    {"step": metrics["step"], "at": time.monotonic(), "compute_s": metrics["compute_s"]}
                )
            await asyncio.sleep(0.02)
        metrics = trainer.metrics()
        if metrics["step"] > steps[-1]["step"]:
            steps.append({"step": metrics["step"], "at": time.monotonic(), "compute_s": metrics["compute_s"]})
        conn.send(
            ("finished", {"steps": steps, "rounds": rounds, "metrics": metrics, "finished": trainer.finished})
        )
        # Keep serving (a slower groupmate may still need this peer) until every peer is done.
        await asyncio.to_thread(conn.recv)
        stop.set()
        await asyncio.wait_for(task, SHUTDOWN_TIMEOUT_S)
    finally:
        dht.shutdown()
        home.cleanup()


def peer_main(conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    import torch

    from swarm.runtime import run

    torch.set_num_threads(settings.threads)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(_train(conn, initial_peers, settings))
    except Exception as e:
        conn.send(("error", repr(e)))
        raise


# --- the swarm and the report ---------------------------------------------------------------------------


def _recv(conn: Connection, timeout_s: float, expect: str):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a peer did not report {expect!r} within {timeout_s:.0f}s")
    kind, payload = conn.recv()
    if kind != expect:
        raise RuntimeError(f"a peer failed: {payload}")
    return payload


def train(settings: Settings) -> list[dict]:
    from bench_allreduce import reap

    from swarm.dht import SpawnedDHT

    context = mp.get_context("spawn")
    bootstrap = SpawnedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
    processes, conns = [], []
    try:
        for _ in range(settings.peers):
            parent, child = context.Pipe()
            process = context.Process(target=peer_main, args=(child, maddrs, settings))
            process.start()
            processes.append(process)
            conns.append(parent)
        for conn in conns:
            _recv(conn, START_TIMEOUT_S, "ready")
        for conn in conns:
            conn.send(("go", None))
        # Bounded: a step cannot take longer than this on any machine this benchmark is meant for.
        run_timeout_s = 120.0 + settings.steps * 300.0
        deadline = time.monotonic() + run_timeout_s
        return [_recv(conn, max(0.1, deadline - time.monotonic()), "finished") for conn in conns]
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", None))
        reap(processes, SHUTDOWN_TIMEOUT_S + 5)
        bootstrap.shutdown()


def summarize(reports: list[dict], settings: Settings) -> dict:
    peers = []
    for report in reports:
        steps = {int(s["step"]): s for s in report["steps"]}
        first, last = steps.get(1), steps.get(settings.steps)
        if first is None or last is None or settings.steps < 2:
            raise RuntimeError(f"a peer did not reach steps 1 and {settings.steps}: {sorted(steps)}")
        wall = last["at"] - first["at"]
        rounds = [r for r in report["rounds"] if first["at"] < r["at"] <= last["at"] + 1e-3]
        done = [r for r in rounds if r["ok"]]
        matchmaking = sum(r["round_s"] - r.get("allreduce_s", 0.0) for r in rounds)
        allreduce = sum(r.get("allreduce_s", 0.0) for r in rounds)
        compute = last["compute_s"] - first["compute_s"]
        peers.append(
            {
                "wall_s": wall, "compute_s": compute, "utilization": compute / wall,
                "matchmaking_s": matchmaking, "allreduce_s": allreduce,
                "other_s": wall - compute - matchmaking - allreduce,
                "samples": sum(r["group_weight"] for r in done), "own_samples": sum(r["weight"] for r in done),
                "bytes_sent": sum(r["bytes_sent"] for r in done), "rounds": len(rounds), "rounds_ok": len(done),
                "trainer_utilization": report["metrics"]["compute_utilization"],
                "senders_checked": report["metrics"].get("senders_checked", 0.0),
                "senders_pointed": report["metrics"].get("senders_outliers", 0.0),
                "fits_scored": report["metrics"].get("senders_fit_scored", 0.0),
                # Seconds the checks took over the seconds of training, over the whole run (each peer's).
                "check_share": (
                    report["metrics"].get("sender_replay_s", 0.0) + report["metrics"].get("sender_fit_s", 0.0)
                ) / max(1e-9, report["metrics"].get("compute_s", 0.0)),
                "group_sizes": sorted({r.get("group", 0) for r in done}),
            }
        )  # fmt: skip
    window_s = statistics.mean(p["wall_s"] for p in peers)
    samples = statistics.mean(p["samples"] for p in peers)
    bytes_sent = sum(p["bytes_sent"] for p in peers)
    steps = settings.steps - 1
    from swarm.models import model_config

    seq_len = int(model_config("gpt", settings.model_config).seq_len)
    return {
        "peers": peers,
        "steps_in_window": steps,
        "window_s": window_s,
        "utilization": statistics.mean(p["utilization"] for p in peers),
        "samples_per_s": samples / window_s,
        "tokens_per_s": samples * seq_len / window_s,
        "bytes_per_sample": bytes_sent / max(samples, 1),
        "step_s": window_s / steps,
    }


def compare_sender_checks(settings: Settings, probabilities: list[float], args) -> int:
    """What sender checks cost an honest run: the same training at each sender-check probability,
    interleaved round by round (A, B, A, B...), each one's samples/s and utilization over the first's."""
    rows: dict[float, list[dict]] = {p: [] for p in probabilities}
    for round_index in range(args.repeats):
        for p in probabilities:
            try:
                result = summarize(train(replace(settings, sender_check_probability=p)), settings)
            except Exception as e:
                print(f"training benchmark failed at sender_check_probability {p}: {e}")
                return 1
            checked = sum(peer["senders_checked"] for peer in result["peers"])
            pointed = sum(peer["senders_pointed"] for peer in result["peers"])
            fits = sum(peer["fits_scored"] for peer in result["peers"])
            share = statistics.mean(peer["check_share"] for peer in result["peers"])
            rows[p].append(result)
            print(
                f"round {round_index + 1}, sender_check_probability {p:g}: {result['samples_per_s']:.2f} "
                f"samples/s, utilization {result['utilization']:.1%}, {checked:.0f} senders replayed "
                f"({pointed:.0f} pointed to by scores or fits), {fits:.0f} fits scored, checks {share:.1%} of "
                f"training time, {result['bytes_per_sample']:.0f} bytes per sample",
                flush=True,
            )
    anchor = probabilities[0]
    print(
        f"\nagainst sender_check_probability {anchor:g} in the same round (min-max over {args.repeats} rounds):"
    )
    print(
        f"{'probability':>11} {'samples/s':>10} {'ratio':>15} {'utilization':>12} {'replayed':>9} "
        f"{'pointed':>8} {'fits':>6} {'check time':>15} {'bytes/sample ratio':>19}"
    )
    summary = []
    for p in probabilities:
        ratios = [r["samples_per_s"] / a["samples_per_s"] for r, a in zip(rows[p], rows[anchor], strict=True)]
        speed = statistics.mean(r["samples_per_s"] for r in rows[p])
        use = statistics.mean(r["utilization"] for r in rows[p])
        replayed = statistics.mean(sum(x["senders_checked"] for x in r["peers"]) for r in rows[p])
        pointed = statistics.mean(sum(x["senders_pointed"] for x in r["peers"]) for r in rows[p])
        fits = statistics.mean(sum(x["fits_scored"] for x in r["peers"]) for r in rows[p])
        shares = [statistics.mean(x["check_share"] for x in r["peers"]) for r in rows[p]]
        wire = [
            r["bytes_per_sample"] / a["bytes_per_sample"] for r, a in zip(rows[p], rows[anchor], strict=True)
        ]
        print(
            f"{p:>11g} {speed:>10.2f} {min(ratios):>7.3f}-{max(ratios):<7.3f} {use:>11.1%} {replayed:>9.1f} "
            f"{pointed:>8.1f} {fits:>6.1f} {min(shares):>6.1%}-{max(shares):<7.1%} {min(wire):>9.3f}-{max(wire):<9.3f}"
        )
        summary.append({"sender_check_probability": p, "samples_per_s": speed, "ratios": ratios,
                        "utilization": use, "replayed": replayed, "pointed": pointed, "fits": fits,
                        "check_shares": shares,
                        "bytes_per_sample_ratios": wire})  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"settings": asdict(settings), "compare": summary}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from swarm.config import TrainingConfig

    run_default = {name: field.default for name, field in TrainingConfig.model_fields.items()}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="{}", help="JSON overrides of the gpt config")
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=run_default["target_batch_size"],
        help="samples per global step",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=run_default["micro_batch_size"],
        help="samples per forward/backward",
    )
    parser.add_argument("--steps", type=int, default=4, help="global steps; the window is steps 1..N")
    parser.add_argument(
        "--matchmaking-time-s",
        type=float,
        default=run_default["matchmaking_time_s"],
        help="matchmaking window",
    )
    parser.add_argument("--max-bytes", type=int, default=4 << 20, help="stdlib corpus cap (bytes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    parser.add_argument(
        "--peers", type=int, default=PEERS,
        help="peer processes, all in every round (3 or more for the reducers' scores: they need 3 inputs)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a tiny model for 3 steps: a smoke test")
    parser.add_argument(
        "--compare-sender-checks",
        metavar="P,P,...",
        help="run once per training.sender_check_probability given, round by round (--repeats rounds), and "
        "print each one's samples/s and utilization against the first's",
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds of --compare-sender-checks")
    parser.add_argument(
        "--verify-probability",
        type=float,
        default=None,
        help="training.verify_probability (default: the run's)",
    )
    parser.add_argument(
        "--sync", choices=["every_step", "diloco"], default="every_step", help="training.sync; "
        "diloco: --steps counts outer steps of --inner-steps inner steps, every window exactly that long",
    )  # fmt: skip
    parser.add_argument("--inner-steps", type=int, default=20, help="diloco: inner steps per outer step")
    parser.add_argument("--compression", default=None, help="training.compression (default: the run's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    model_config = json.loads(args.model_config)
    if args.quick:
        model_config = {**QUICK_MODEL, **model_config}
        # Three steps: a tiny step's compute can fall before the poll that sees the step begin, so a
        # one-step window may hold none of it.
        args.target_batch_size, args.micro_batch_size, args.steps = 16, 8, 3
        args.matchmaking_time_s, args.max_bytes = 1.0, 1 << 20
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the window runs from step 1 to the last)")
    if not 2 <= args.peers <= 8:
        parser.error(f"--peers must be 2 to 8, got {args.peers}")
    settings = Settings(
        model_config, args.target_batch_size, args.micro_batch_size, args.steps, args.matchmaking_time_s,
        args.max_bytes, args.threads, verify_probability=args.verify_probability, sync=args.sync,
        inner_steps=args.inner_steps, compression=args.compression, peers=args.peers,
    )  # fmt: skip
    if args.compare_sender_checks:
        return compare_sender_checks(
            settings, [float(p) for p in args.compare_sender_checks.split(",")], args
        )
    from swarm.components import check_components

    check_components(settings.run_config())

    from bench_allreduce import machine

    info = machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; python {info['python']}, "
        f"torch {info['torch']}, hivemind {info['hivemind']}; load {info['load_1min']}"
    )
    print(
        f"{args.peers} peers, one process each (torch threads {args.threads}); gpt {model_config or 'default config'}; "
        f"target batch {args.target_batch_size} x micro-batch {args.micro_batch_size}; {args.steps} steps; "
        f"matchmaking {args.matchmaking_time_s:g}s",
        flush=True,
    )
    started = time.monotonic()
    try:
        result = summarize(train(settings), settings)
    except Exception as e:
        print(f"training benchmark failed: {e}")
        return 1

    window = f"steps 1..{args.steps} ({result['steps_in_window']} steps, {result['window_s']:.1f}s)"
    print(f"\nsteady state, {window}:")
    columns = ("peer", "wall s", "compute", "matchmk", "allred", "other", "utilization", "rounds")
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, (4, 7, 8, 8, 7, 7, 12, 7), strict=True)))
    for index, p in enumerate(result["peers"]):
        print(
            f"{index:>4} {p['wall_s']:>7.1f} {p['compute_s']:>8.1f} {p['matchmaking_s']:>8.1f} "
            f"{p['allreduce_s']:>7.2f} {p['other_s']:>7.1f} {p['utilization']:>11.1%} "
            f"{p['rounds_ok']:>3}/{p['rounds']:<3}"
        )
    met = "met" if result["utilization"] >= TARGET_UTILIZATION else "MISSED"
    print(f"\ncompute utilization: {result['utilization']:.1%} (target >= {TARGET_UTILIZATION:.0%}: {met})")
    tokens = f"{result['tokens_per_s']:.0f} tokens/s"
    print(f"samples/s: {result['samples_per_s']:.2f} ({tokens}), {result['step_s']:.1f}s per step")
    print(f"bytes on the wire per sample: {result['bytes_per_sample']:.0f}")
    print(
        "the trainer's own compute_utilization over its training window (first micro-batch to last step): "
        + ", ".join(f"{p['trainer_utilization']:.1%}" for p in result["peers"])
    )
    print(f"\ntotal {time.monotonic() - started:.0f}s; 1-minute load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "settings": asdict(settings), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
