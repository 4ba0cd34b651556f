"""``swarm-sim --protocol-attack hostile``: start the hostile process once training runs, and judge it.

The hostile process (``swarm.byzantine.hostile``) starts with the peers and mounts once it sees their
records; each process's memory when every honest peer has reached step 1 is the baseline: from then on every honest peer's and the
coordinator's process group (its DHT child and p2p daemon included) is sampled every second, and its peak
may exceed the baseline by at most ``RSS_GROWTH_BOUND_BYTES``. The hostile process is told the
coordinator's address and the data planes a scan of the honest peers' listening ports finds, and writes
what it sent and what its audits of the honest DHT nodes found to a report the verdict reads.

Example::

    watch = HostileWatch(local, run_id, coordinator, honest_peers)
    watch.spawn()
    watch.maybe_start(steps)  # every loop
    verdict, reason = watch.verdict()
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.localswarm import Child, LocalSwarm
from lab.procmem import data_planes, group_rss_bytes

# Each honest process may grow by at most this much over its baseline while under attack. Unbounded, one
# oversized stream claim alone (192 MiB) would pass it; a clean run grows by less (docs/robustness.md).
RSS_GROWTH_BOUND_BYTES = 128 << 20


class HostileWatch:
    """Starts the hostile process at the right moment and measures what it did to the honest ones."""

    def __init__(self, local: LocalSwarm, run_id: str, coordinator: Child, honest: dict[str, Child]) -> None:
        self.local, self.run_id, self.coordinator, self.honest = local, run_id, coordinator, honest
        self.report_path: Path = local.root / "hostile-report.json"
        self.addresses_path: Path = local.root / "hostile-data-addresses.txt"
        self.baseline: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.data_addresses: list[str] = []
        self.started = False

    def _groups(self) -> dict[str, int]:
        return {"coordinator": self.coordinator.process.pid} | {
            n: c.process.pid for n, c in self.honest.items()
        }

    def spawn(self) -> None:
        """Start the hostile process (it reads the library for seconds, and mounts once it sees holders)."""
        self.local.spawn("hostile", [
            "-m", "swarm.byzantine.protocol_attacks", "--run-id", self.run_id,
            "--initial-peers", *self.coordinator.extra["dht_initial_peers"], "--attack", "hostile",
            "--coordinator", self.coordinator.extra["address"], "--report", str(self.report_path),
            "--data-addresses-file", str(self.addresses_path),
        ])  # fmt: skip

    def mounts(self) -> int:
        """Mounts the hostile process completed (audits it reported) so far."""
        try:
            return len(json.loads(self.report_path.read_text())["hostile"]["audits"])
        except (OSError, ValueError, KeyError):
            return 0

    def maybe_start(self, steps: dict[str, int]) -> None:
        """Take the baseline once every honest peer reports step 1 or more, then sample memory."""
        if not self.started and len(steps) == len(self.honest) and min(steps.values()) >= 1:
            self.baseline = {name: group_rss_bytes(pgid) for name, pgid in self._groups().items()}
            self.data_addresses = data_planes([c.process.pid for c in self.honest.values()])
            self.addresses_path.write_text("\n".join(self.data_addresses))
            self.started = True
        if self.started:
            for name, pgid in self._groups().items():
                self.peak[name] = max(self.peak.get(name, 0), group_rss_bytes(pgid))

    def result(self) -> dict:
        report = (
            json.loads(self.report_path.read_text()).get("hostile", {}) if self.report_path.exists() else {}
        )
        audits = report.get("audits", [])
        return {
            "started": self.started,
            "data_addresses": self.data_addresses,
            "rss_baseline_bytes": self.baseline,
            "rss_peak_bytes": self.peak,
            "rss_growth_bytes": {n: self.peak.get(n, 0) - b for n, b in self.baseline.items()},
            "rss_growth_bound_bytes": RSS_GROWTH_BOUND_BYTES,
            "hostile_entries_kept": max((a["hostile_entries"] for a in audits), default=None),
            "most_entries_held": max((a["most_entries"] for a in audits), default=None),
            "audits": len(audits),
            "sent": report.get("sent", {}),
            "outcome": report.get("outcome", {}),
        }

    def verdict(self, result: dict) -> str | None:
        """Why the honest side did not hold under the hostile process, or None when it did."""
        if not result["started"] or not result["audits"]:
            return "the hostile process never completed a mount"
        grown = {n: g for n, g in result["rss_growth_bytes"].items() if g >= RSS_GROWTH_BOUND_BYTES}
        if grown:
            return f"memory grew past {RSS_GROWTH_BOUND_BYTES >> 20} MiB: {grown}"
        if result["hostile_entries_kept"]:
            return f"honest DHT nodes kept {result['hostile_entries_kept']} of the hostile process's entries"
        return None
