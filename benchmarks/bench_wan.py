"""Data-parallel rounds over kernel-capped links, in the WAN lab (needs root).

For each uplink cap it runs ``swarm-sim --peers P --wan up=CAP,down=DOWN [--nat K]`` and reads, per
peer, the bytes the kernel counted leaving its link and the time its trainer spent averaging
(matchmaking plus the all-reduce: ``averaging_s``). Per step it prints:

- *sent*: bytes that left the peer's link (tensors, signatures, DHT and control traffic);
- *link minimum*: sent / uplink, the time the link needs for them at best;
- *averaging*: the measured averaging time, and *link use*, minimum / averaging (1.0: the round ran at
  the uplink's full rate; matchmaking and waiting for slower peers' compute count against it);
- *peak*: the busiest 2 s of the peer's uplink, from the kernel's counters sampled every second, as a
  share of the cap: whether the data path can fill the link while it sends;
- samples/s and compute utilization (the share of wall time spent in forward and backward passes).

Configurations run one after another (each is a whole swarm); ``--repeat`` runs the list again so that
background load is spread over all of them, and the table shows every repeat.

``--scenario churn`` instead kills one of the peers outright while its uplink is busy (mid-round, by
the kernel's counter), reports how long the survivors took to finish a round without it, then restarts
it and reports its state download (size, seconds, and the size / bandwidth minimum).

Usage::

    python benchmarks/bench_wan.py                              # 4 peers; 100, 20, 10 Mbit/s; 2 of 4 behind NAT at 10
    python benchmarks/bench_wan.py --model-size demo --steps 4  # the demo model (about 15 MB a peer a step)
    python benchmarks/bench_wan.py --scenario churn --caps 10   # a peer killed mid-round, then a late joiner
    python benchmarks/bench_wan.py --quick                      # smoke test (tests/test_wanlab.py runs NAT)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from protocols.errors import SwarmError

ROOT = Path(__file__).resolve().parents[1]


def run_sim(
    peers: int, steps: int, model_size: str, up: float, down: float, nat: int, timeout_s: int
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        command = [
            sys.executable, "-m", "lab.sim", "--peers", str(peers), "--steps", str(steps),
            "--model-size", model_size, "--wan", f"up={up}mbit,down={down}mbit", "--nat", str(nat),
            "--json", str(out), "--timeout-s", str(timeout_s),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 120)
        if done.returncode != 0:
            raise SystemExit(
                f"swarm-sim failed ({' '.join(command)}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def summarize(report: dict, up_mbit: float) -> dict:
    steps = report["steps"]
    rows = [p for p in report["peers"] if not p["byzantine"]]
    sent = report["wan"]["link_bytes_sent"]
    per_peer = []
    for row in rows:
        bytes_per_step = sent[row["name"]] / steps
        minimum_s = bytes_per_step * 8 / (up_mbit * 1e6)
        averaging_s = row["averaging_s"] / steps
        per_peer.append((bytes_per_step, minimum_s, averaging_s, row["compute_utilization"]))
    return {
        "sent_mb_per_step": statistics.mean(p[0] for p in per_peer) / 1e6,
        "link_minimum_s": statistics.mean(p[1] for p in per_peer),
        "averaging_s": statistics.mean(p[2] for p in per_peer),
        "link_use": statistics.mean(p[1] / p[2] for p in per_peer if p[2] > 0),
        "peak_use": statistics.mean(report["wan"]["peak_up_mbit"][r["name"]] for r in rows) / up_mbit,
        "samples_per_s": report["samples_per_s"],
        "compute_utilization": statistics.mean(p[3] for p in per_peer),
        "identical": report["peers_agree"],
        "val_loss": (report["initial_val_loss"], report["final_val_loss"]),
    }


# One lab host's averager: ``python -c ROUNDS_PEER DIR INDEX PEERS NUMEL ROUNDS ADDRESS CLIENT_MODE SENDER_S
# ROUND_S`` (the last two: the deadlines' floors, sender_timeout_s and averaging_timeout_s). Peer 0
# writes its DHT address to DIR/dht; each peer writes one JSON line per round (all-reduce seconds, after
# matchmaking, and bytes sent) to DIR/peerINDEX.jsonl.
ROUNDS_PEER = r"""
import asyncio, json, logging, sys, time
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.averager import Averager
from swarm.dht import SpawnedDHT, listen_maddr
from swarm.identity import create_identity

root, index, peers, numel, rounds = Path(sys.argv[1]), *map(int, sys.argv[2:6])
address, client_mode = sys.argv[6], sys.argv[7] == "1"
sender_timeout_s, averaging_timeout_s = float(sys.argv[8]), float(sys.argv[9])
key = create_identity(root / f"peer{index}.key")
initial = [] if index == 0 else json.loads((root / "dht").read_text())
dht = SpawnedDHT(start=True, initial_peers=initial, host_maddrs=[listen_maddr(address, 0)],
                 identity_path=str(root / f"peer{index}.key"), check_if_identity_free=False)
if index == 0:
    (root / "dht.tmp").write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    (root / "dht.tmp").rename(root / "dht")
times = []

class Timed(ButterflyAllReduce):
    async def run(self):
        started = time.monotonic()
        result = await super().run()
        times.append((time.monotonic() - started, self.group_id.hex(), result.complete, len(self.peer_ids)))
        return result

async def main():
    averager = Averager(dht, prefix="lab-rounds", numel=numel, signing_key=key, data_host=address,
                        matchmaking_time_s=2.0, client_mode=client_mode, runner_type=Timed,
                        sender_timeout_s=sender_timeout_s, averaging_timeout_s=averaging_timeout_s)
    await averager.start()
    (root / f"ready{index}").touch()
    while not all((root / f"ready{i}").exists() for i in range(peers)):
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # every peer's handlers are up before the first leader dials them
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(index))
    with open(root / f"peer{index}.jsonl", "w") as out:
        for r in range(rounds):
            # Every peer starts round r together (a bench of rounds alone has no training step to align them).
            (root / f"round{r}-{index}").touch()
            while not all((root / f"round{r}-{i}").exists() for i in range(peers)):
                await asyncio.sleep(0.05)
            before = len(times)
            await averager.average(vector, 1.0, expected_size=peers)
            if averager.rounds.recent:  # our results must reach the others before the next round starts
                last = next(reversed(averager.rounds.recent.values()))
                if last.revealed is not None:
                    await asyncio.wait([last.revealed], timeout=60)
            if len(times) > before:
                seconds, group, complete, size = times[-1]
                out.write(json.dumps({"s": seconds, "group": group, "complete": complete, "size": size,
                                      "mbit": averager.link.mbit}) + "\n")
                out.flush()
    await averager.shutdown()

asyncio.run(main())
"""


def run_rounds(
    peers: int,
    numel: int,
    rounds: int,
    up: float,
    down: float,
    nat: int,
    timeout_s: int,
    *,
    sender_timeout_s: float = 5.0,
    averaging_timeout_s: float = 30.0,
) -> dict:
    """All-reduce rounds alone (no training) among lab hosts: round time against the link minimum.
    The timeouts are the floors of the rounds' deadlines (the run config's defaults unless given)."""
    from lab.localswarm import LocalSwarm
    from lab.wanlab import LinkSpec, WanLab

    timeline: list[tuple[float, list[int]]] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local = LocalSwarm(root)
        lab = WanLab(hosts=peers, nat=nat, link=LinkSpec(up_mbit=up, down_mbit=down), reaper=local.reaper)
        try:
            lab.up()
            sampler = threading.Thread(target=_sample_links, args=(lab, peers, timeline, stop), daemon=True)
            sampler.start()
            children = []
            for i in range(peers):
                host = lab.host(i + 1)
                args = [str(root), str(i), str(peers), str(numel), str(rounds), host.address,
                        str(int(host.behind_nat)), str(sender_timeout_s), str(averaging_timeout_s)]  # fmt: skip
                children.append(
                    local.spawn(f"peer{i}", ["-c", ROUNDS_PEER, *args], prefix=lab.exec_prefix(i + 1))
                )  # fmt: skip
                if i == 0:
                    while not (root / "dht").exists():
                        if children[0].process.poll() is not None:
                            raise SystemExit(f"peer0 exited:\n{children[0].output()[-3000:]}")
                        time.sleep(0.2)
            for child in children:
                child.wait(timeout_s=timeout_s)
                if child.process.returncode != 0:
                    raise SystemExit(f"{child.name} failed:\n{child.output()[-3000:]}")
            rows = [
                [json.loads(line) for line in (root / f"peer{i}.jsonl").read_text().splitlines()]
                for i in range(peers)
            ]
            warnings = [
                line for child in children for line in child.output().splitlines() if " WARNING " in line
            ]
        finally:
            stop.set()
            local.kill_all()
            lab.down()
    # The busiest member (a reducer) sends the rest of the vector to the other reducers and its part back
    # to every other member: fp16, 2 bytes a value.
    reducers = peers - nat
    part = numel / reducers
    busiest = ((numel - part) + part * (peers - 1)) * 2
    minimum_s = busiest * 8 / (up * 1e6)
    groups: dict[str, list[dict]] = {}
    for row in (x for peer in rows for x in peer):
        groups.setdefault(row["group"], []).append(row)
    done = [
        g for g in groups.values() if len(g) == peers and all(x["complete"] and x["size"] == peers for x in g)
    ]
    # A round lasts until its slowest member has every part; the first round also warms connections up.
    slowest = [max(x["s"] for x in g) for g in done[1:]] or [max(x["s"] for x in g) for g in done]
    return {
        "up_mbit": up, "nat": nat, "peers": peers, "numel": numel, "rounds_complete": len(done),
        "rounds": rounds, "busiest_mb": busiest / 1e6, "minimum_s": minimum_s,
        "round_s": statistics.median(slowest) if slowest else float("nan"),
        "link_use": minimum_s / statistics.median(slowest) if slowest else 0.0,
        "measured_mbit": [r[-1]["mbit"] for r in rows if r],
        "warnings": warnings[-20:],
        "uplink_timeline_mbit": _rates(timeline),
    }  # fmt: skip


def _sample_links(lab, hosts: int, timeline: list, stop: threading.Event, interval_s: float = 0.25) -> None:
    while not stop.wait(interval_s):
        try:
            timeline.append((time.monotonic(), [lab.link_bytes(k + 1)[0] for k in range(hosts)]))
        except SwarmError:  # the lab is being taken down
            return


def _rates(timeline: list[tuple[float, list[int]]]) -> list[list[float]]:
    """Each host's uplink rate, in Mbit/s, between consecutive samples of its kernel counter."""
    return [
        [round((b - a) * 8 / (t1 - t0) / 1e6, 2) for a, b in zip(c0, c1, strict=True)]
        for (t0, c0), (t1, c1) in zip(timeline, timeline[1:], strict=False)
    ]


def _log_times(text: str, pattern: str) -> list[tuple[float, re.Match]]:
    """(seconds since midnight, match) of each log line (``HH:MM:SS LEVEL ...``) matching ``pattern``."""
    found = []
    for line in text.splitlines():
        match = re.search(pattern, line)
        stamp = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
        if match and stamp:
            h, m, sec = map(int, stamp.groups())
            found.append((h * 3600 + m * 60 + sec, match))
    return found


def _clock_s(t: float) -> float:
    local = time.localtime(t)
    return local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + (t % 1)


def run_churn(peers: int, model_size: str, up: float, down: float, timeout_s: int) -> dict:
    """Kill the last peer while its uplink is busy; time the survivors' next round, then its state download."""
    from coordinator.cli import status_to_dict
    from lab.localswarm import LocalSwarm, status
    from lab.simconfig import SimConfig, build_run
    from lab.wanlab import LinkSpec, WanLab

    run = build_run(SimConfig(peers=peers, steps=10_000, model_size=model_size, churn=True))
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalSwarm(Path(tmp))
        lab = WanLab(hosts=peers + 1, link=LinkSpec(up_mbit=up, down_mbit=down), reaper=local.reaper)
        try:
            lab.up()
            coordinator = local.start_coordinator(run, host=lab.host(1).address, prefix=lab.exec_prefix(1))
            address, control = coordinator.extra["address"], coordinator.extra["socket"]
            names = [f"peer{i}" for i in range(peers)]
            children = {
                name: local.start_peer(address, name, host=lab.host(i + 2).address, prefix=lab.exec_prefix(i + 2))
                for i, name in enumerate(names)
            }  # fmt: skip
            victim, host = names[-1], peers + 1
            deadline = time.monotonic() + timeout_s

            def steps() -> dict[str, int]:
                snapshot = status_to_dict(status(str(control)))
                return {p["name"]: p["step"] for p in snapshot["peers"] if p["state"] == "online"}

            while min(steps().values(), default=0) < 3 or len(steps()) < peers:
                if time.monotonic() > deadline:
                    raise SystemExit(f"no step 3 within {timeout_s}s: {steps()}")
                time.sleep(1.0)
            # Mid-round: the victim's uplink carried more than half its cap over the last half second.
            last = (time.monotonic(), lab.link_bytes(host)[0])
            while True:
                time.sleep(0.1)
                now = (time.monotonic(), lab.link_bytes(host)[0])
                if (now[1] - last[1]) * 8 / (now[0] - last[0]) / 1e6 > 0.5 * up and now[0] - last[0] >= 0.5:
                    break
                if now[0] - last[0] >= 0.5:
                    last = now
            killed_at = time.time()
            os.killpg(children[victim].process.pid, signal.SIGKILL)
            children[victim].process.wait(timeout=30)
            survivors = names[:-1]
            finished: dict[str, float] = {}
            while len(finished) < len(survivors) and time.monotonic() < deadline:
                time.sleep(1.0)
                for name in survivors:
                    rounds = _log_times(
                        children[name].output(), rf"step \d+: averaged with {peers - 1} peers"
                    )
                    after = [t for t, _ in rounds if t >= int(_clock_s(killed_at))]
                    if after and name not in finished:
                        finished[name] = after[0] - _clock_s(killed_at)
            restarted_at = time.time()
            children[victim] = local.start_peer(
                address, victim, host=lab.host(host).address, prefix=lab.exec_prefix(host)
            )
            pattern = r"loaded the state of step (\d+) .*; ([\d.]+) MiB of tensors in ([\d.]+)s\)"
            loaded = None
            while loaded is None and time.monotonic() < deadline:
                time.sleep(1.0)
                # The restart appends to the same log: only a download after it counts.
                found = [(t, m) for t, m in _log_times(children[victim].output(), pattern)
                         if t >= int(_clock_s(restarted_at))]  # fmt: skip
                loaded, loaded_t = (found[0][1], found[0][0]) if found else (None, 0.0)
            if loaded is None:
                raise SystemExit(
                    f"{victim} loaded no state within {timeout_s}s:\n{children[victim].output()[-3000:]}"
                )
            mib, seconds = float(loaded.group(2)), float(loaded.group(3))
            joined = loaded_t - _clock_s(restarted_at)
            since_kill = [
                line for line in children[survivors[0]].output().splitlines()
                if (t := _log_times(line, r"swarm\.")) and t[0][0] >= int(_clock_s(killed_at))
            ][:12]  # fmt: skip
            return {
                "up_mbit": up, "peers": peers, "model_size": model_size,
                "survivors_finished_s": finished, "state_mib": mib, "download_s": seconds,
                "download_minimum_s": mib * 2**20 * 8 / (up * 1e6), "restart_to_loaded_s": joined,
                "survivor_log_after_kill": since_kill,
            }  # fmt: skip
        finally:
            local.kill_all()
            lab.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model-size", choices=["demo", "small", "tiny"], default="small")
    parser.add_argument("--caps", default="100,20,10", help="uplink caps in Mbit/s, comma-separated")
    parser.add_argument("--down", type=float, default=100.0, help="downlink cap in Mbit/s")
    parser.add_argument(
        "--nat",
        type=int,
        default=None,
        help="peers behind NAT in the extra run at the last cap (2; --quick: 0)",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=900)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--scenario", choices=["training", "allreduce", "churn"], default="training",
        help="training: swarm-sim runs; allreduce: rounds alone; churn: a peer killed mid-round, a late joiner",
    )  # fmt: skip
    parser.add_argument("--numel", type=int, default=4_000_000, help="allreduce: values averaged")
    parser.add_argument("--rounds", type=int, default=5, help="allreduce: rounds per configuration")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 tiny peers at 20 Mbit/s (--nat 1 adds a run behind NAT)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.steps, args.model_size, args.caps = 2, 2, "tiny", "20"
    if args.nat is None:
        args.nat = 0 if args.quick else 2
    if os.geteuid() != 0:
        raise SystemExit("bench_wan needs root: the WAN lab creates network namespaces and tc qdiscs")
    caps = [float(c) for c in args.caps.split(",")]
    if args.scenario == "allreduce":
        configs = [(cap, 0) for cap in caps] + ([(caps[-1], args.nat)] if args.nat else [])
        for cap, nat in configs:
            row = run_rounds(args.peers, args.numel, args.rounds, cap, args.down, nat, args.timeout_s)
            print(json.dumps(row), flush=True)
        return 0
    if args.scenario == "churn":
        for cap in caps:
            row = run_churn(args.peers, args.model_size, cap, args.down, args.timeout_s)
            print(json.dumps(row), flush=True)
        return 0
    configs = [(cap, 0) for cap in caps] + ([(caps[-1], args.nat)] if args.nat else [])
    print(f"{args.peers} peers, model {args.model_size}, {args.steps} steps, downlink {args.down} Mbit/s")
    print(
        "uplink | NAT | sent MB/step | link minimum s | averaging s | link use | peak | samples/s | compute util"
        " | identical"
    )
    results = []
    for _ in range(args.repeat):
        for cap, nat in configs:
            report = run_sim(args.peers, args.steps, args.model_size, cap, args.down, nat, args.timeout_s)
            row = {"up_mbit": cap, "nat": nat, **summarize(report, cap)}
            results.append(row)
            print(f"{cap:6.0f} | {nat:3d} | {row['sent_mb_per_step']:12.2f} | {row['link_minimum_s']:14.2f} | "
                  f"{row['averaging_s']:11.2f} | {row['link_use']:8.2f} | {row['peak_use']:4.2f} | {row['samples_per_s']:9.2f} | "
                  f"{row['compute_utilization']:12.2f} | {row['identical']}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
