"""Rehearse the swarm's membership on this machine: a coordinator and volunteers as real processes.

Starts a coordinator serving the demo run and N volunteer peers on loopback, shows them join, then
kills one outright and stops another cleanly, and shows the coordinator's view after each step.
Exits 0 only when every step was observed.

    python scripts/demo_swarm.py --peers 3
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from coordinator.cli import format_status, status_to_dict
from coordinator.localswarm import FAST_MEMBERSHIP, LocalSwarm, peer_states, status, wait_until
from swarm.config import RunConfig


def show(address: str, title: str) -> None:
    print(f"\n== {title}\n{format_status(status_to_dict(status(address)))}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peers", type=int, default=3, choices=range(2, 9), metavar="2..8", help="volunteers"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and data dir afterwards")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    local = LocalSwarm(root)
    started = time.monotonic()
    try:
        run = RunConfig.demo().model_copy(update={"membership": FAST_MEMBERSHIP})
        address = local.start_coordinator(run).extra["address"]
        print(f"coordinator of run {run.run_id!r} serving on {address} (logs in {root})", flush=True)
        names = [f"volunteer{i}" for i in range(args.peers)]
        peers = {name: local.start_peer(address, name) for name in names}
        wait_until(
            lambda: peer_states(address) == dict.fromkeys(names, "online"), timeout_s=120, what="peers online"
        )
        show(address, f"{args.peers} volunteers joined ({time.monotonic() - started:.1f}s)")

        peers[names[0]].process.kill()
        wait_until(
            lambda: peer_states(address)[names[0]] == "offline", timeout_s=30, what="the killed peer offline"
        )
        show(address, f"{names[0]} was killed outright: the coordinator shows it offline")

        peers[names[1]].signal(signal.SIGTERM)
        peers[names[1]].wait(timeout_s=30)
        show(address, f"{names[1]} was stopped with SIGTERM: it left cleanly")

        for name in names[2:]:
            peers[name].signal(signal.SIGINT)
            peers[name].wait(timeout_s=30)
        states = peer_states(address)
        expected = {names[0]: "offline", **dict.fromkeys(names[1:], "left")}
        print(f"\nfinal states: {states}; expected {expected}")
        return 0 if states == expected else 1
    except Exception as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        local.kill_all()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        print(f"done in {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
