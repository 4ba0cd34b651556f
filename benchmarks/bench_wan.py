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

Usage::

    python benchmarks/bench_wan.py                              # 4 peers; 100, 20, 10 Mbit/s; 2 of 4 behind NAT at 10
    python benchmarks/bench_wan.py --model-size demo --steps 4  # the demo model (about 15 MB a peer a step)
    python benchmarks/bench_wan.py --quick                      # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sim(
    peers: int, steps: int, model_size: str, up: float, down: float, nat: int, timeout_s: int
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        command = [
            sys.executable, "-m", "coordinator.sim", "--peers", str(peers), "--steps", str(steps),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model-size", choices=["demo", "small", "tiny"], default="small")
    parser.add_argument("--caps", default="100,20,10", help="uplink caps in Mbit/s, comma-separated")
    parser.add_argument("--down", type=float, default=100.0, help="downlink cap in Mbit/s")
    parser.add_argument(
        "--nat", type=int, default=2, help="peers behind NAT in the extra run at the last cap"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=900)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 2 tiny peers, 20 Mbit/s, then one behind NAT"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.steps, args.model_size, args.caps, args.nat = 2, 2, "tiny", "20", 1
    if os.geteuid() != 0:
        raise SystemExit("bench_wan needs root: the WAN lab creates network namespaces and tc qdiscs")
    caps = [float(c) for c in args.caps.split(",")]
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
