"""The run as the dashboard, ``/api/status`` and ``/metrics`` show it, built from the coordinator's store.

Everything here is derived from what peers report in their heartbeats and from the store's durable
records (credit, bans, history). Nothing secret goes in: no keys, certificates or join tokens, and of
the run config only what a volunteer is told anyway.

Example::

    snapshot = await run_snapshot(store, run, coordinator_peer_id)
    print(snapshot["step"], [p["name"] for p in snapshot["peers"]])
    text = prometheus_text(snapshot)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from coordinator.store import EVIDENCE_PREVIEW_BYTES, Ban, HistoryPoint, PeerRecord, Store, diverged_peers
from protocols.errors import ConfigError
from protocols.version import PROTOCOL_VERSION
from swarm.config import RunConfig

logger = logging.getLogger(__name__)

# Peer metrics shown per peer (all floats the peer reported; this list only fixes the order).
PEER_METRICS = (
    "train_loss",
    "val_loss",
    "samples_per_s",
    "compute_utilization",
    "rounds_ok",
    "rounds_failed",
    "peak_memory_bytes",
)


def _metric(record: PeerRecord, name: str) -> float | None:
    value = record.metrics.get(name)
    return float(value) if value is not None and math.isfinite(value) else None


def is_paused(record: PeerRecord) -> bool:
    return record.state == "online" and record.metrics.get("paused", 0.0) >= 1.0


def history_point(records: list[PeerRecord], now: float) -> HistoryPoint:
    """The run now: the furthest step, mean losses, summed throughput and the online peers."""
    online = [r for r in records if r.state == "online"]
    losses = [v for r in online if (v := _metric(r, "train_loss")) is not None]
    # Peers validate at different steps; the freshest validation is the one that describes the run.
    validated = [
        (r.metrics.get("val_step", -1.0), v) for r in online if (v := _metric(r, "val_loss")) is not None
    ]
    latest_val_step = max((s for s, _ in validated), default=None)
    val_losses = [v for s, v in validated if s == latest_val_step]
    return HistoryPoint(
        t=now,
        step=max((r.step for r in online), default=0),
        train_loss=sum(losses) / len(losses) if losses else None,
        val_loss=sum(val_losses) / len(val_losses) if val_losses else None,
        samples_per_s=sum(_metric(r, "samples_per_s") or 0.0 for r in online if not is_paused(r)),
        peers_online=len(online),
    )


def _evidence(ban: Ban) -> dict[str, Any] | None:
    if not ban.evidence_bytes:
        return None
    preview = ban.evidence_preview[:EVIDENCE_PREVIEW_BYTES]
    try:
        text, kind = preview.decode("utf-8"), "text"
    except UnicodeDecodeError:
        text, kind = preview.hex(), "hex"
    return {
        "bytes": ban.evidence_bytes,
        "kind": kind,
        "preview": text,
        "truncated": ban.evidence_bytes > len(preview),
    }


def leaderboard(records: list[PeerRecord]) -> list[dict[str, Any]]:
    """Peers ranked by credited samples, each with its share of the ranked peers' total. A banned peer is
    left out: it shows in the bans, and its credit no longer earns it a place above honest peers."""
    ranked = sorted(
        (r for r in records if r.contributed_samples > 0 and r.state != "banned"),
        key=lambda r: -r.contributed_samples,
    )
    total = sum(r.contributed_samples for r in ranked)
    return [
        {
            "rank": rank,
            "peer_id": r.peer_id,
            "name": r.name,
            "contributed_samples": r.contributed_samples,
            "share": r.contributed_samples / total,
        }
        for rank, r in enumerate(ranked, start=1)
    ]


async def run_snapshot(
    store: Store,
    run: RunConfig,
    coordinator_peer_id: str,
    *,
    history_points: int = 500,
    checkpoint_step: int | None = None,
    finished_step: int | None = None,
    outside_dht: Callable[[list[PeerRecord], float], set[str]] | None = None,
) -> dict[str, Any]:
    """The JSON document served at ``/api/status``; ``finished_step`` is the final checkpoint's step once
    the run has reached ``max_steps``; ``outside_dht`` names the peers split from the coordinator's DHT
    (shown as diverged)."""
    records = await store.list_peers()
    bans = await store.list_bans()
    refused = await store.credit_refused()
    suspected = await store.suspicion_counts()
    history = await store.history(max_points=history_points)
    now = time.time()
    current = history_point(records, now)
    diverged = diverged_peers(records, outside_dht(records, now) if outside_dht else ())
    names = {r.peer_id: r.name for r in records}
    total_credit = sum(r.contributed_samples for r in records)
    peers = [
        {
            "peer_id": r.peer_id,
            "name": r.name,
            "role": r.role,
            "device": r.device,
            "state": r.state,
            "paused": is_paused(r),
            "step": r.step,
            "samples_per_s": _metric(r, "samples_per_s") or 0.0,
            "contributed_samples": r.contributed_samples,
            "credit_refused": refused.get(r.peer_id, 0.0),
            "last_seen": r.last_seen,
            "joined_at": r.joined_at,
            "diverged": r.peer_id in diverged,
            # How many online peers avoid it now for breaking their rounds (withholding, denying a round).
            "suspected_by": suspected.get(r.peer_id, 0),
            "ban_reason": r.ban_reason,
            "metrics": {k: v for k in PEER_METRICS if (v := _metric(r, k)) is not None},
        }
        for r in records
    ]
    training = run.training
    return {
        "run_id": run.run_id,
        "protocol_version": PROTOCOL_VERSION,
        "coordinator_peer_id": coordinator_peer_id,
        "server_time": now,
        "run": {
            "model": run.model.name,
            "dataset": run.dataset.name,
            "target_batch_size": training.target_batch_size,
            "max_steps": training.max_steps,
            "aggregator": training.aggregator,
            "admission": run.admission.policy,
            # With diloco a step is an outer step (inner_steps local steps each), everywhere in status.
            "sync": training.sync,
            "inner_steps": training.inner_steps if training.sync == "diloco" else 1,
        },
        "step": current.step,
        "checkpoint_step": checkpoint_step,
        "finished": finished_step is not None,
        "finished_step": finished_step,
        "samples_per_s": current.samples_per_s,
        "train_loss": current.train_loss,
        "val_loss": current.val_loss,
        "peers_online": current.peers_online,
        "peers_paused": sum(1 for r in records if is_paused(r)),
        "contributed_samples": total_credit,
        "peers": peers,
        "leaderboard": leaderboard(records),
        "bans": [
            {
                "peer_id": b.peer_id,
                "name": names.get(b.peer_id, ""),
                "reason": b.reason,
                "banned_at": b.banned_at,
                "evidence": _evidence(b),
            }
            for b in bans
        ],
        "history": [
            {
                "t": p.t,
                "step": p.step,
                "train_loss": p.train_loss,
                "val_loss": p.val_loss,
                "samples_per_s": p.samples_per_s,
                "peers_online": p.peers_online,
            }
            for p in history
        ],
    }


class _SnapshotCollector:
    """Prometheus families for one snapshot (the registry is rebuilt per scrape, so values are current)."""

    def __init__(self, snapshot: dict[str, Any]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self.snapshot
        yield InfoMetricFamily(
            "swarm_run", "the run this coordinator serves",
            value={"run_id": s["run_id"], "coordinator_peer_id": s["coordinator_peer_id"]},
        )  # fmt: skip
        yield GaugeMetricFamily("swarm_step", "furthest training step of the online peers", value=s["step"])
        yield GaugeMetricFamily(
            "swarm_samples_per_second",
            "summed training throughput of the online peers",
            value=s["samples_per_s"],
        )
        for name, key, doc in (
            ("swarm_train_loss", "train_loss", "mean training loss of the online peers"),
            ("swarm_val_loss", "val_loss", "validation loss at the latest validated step"),
        ):
            if s[key] is not None:
                yield GaugeMetricFamily(name, doc, value=s[key])
        states = GaugeMetricFamily("swarm_peers", "peers by state", labels=["state"])
        counts = {state: 0 for state in ("online", "offline", "left", "banned")}
        for p in s["peers"]:
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        for state, count in counts.items():
            states.add_metric([state], count)
        yield states
        yield GaugeMetricFamily(
            "swarm_peers_paused", "online peers that paused their work", value=s["peers_paused"]
        )
        yield GaugeMetricFamily("swarm_bans", "banned peers", value=len(s["bans"]))
        yield GaugeMetricFamily(
            "swarm_run_finished", "1 once the run reached max_steps and its final checkpoint is saved",
            value=float(s["finished"]),
        )  # fmt: skip
        if s["checkpoint_step"] is not None:
            yield GaugeMetricFamily(
                "swarm_checkpoint_step", "the step of the newest checkpoint", value=s["checkpoint_step"]
            )
        yield GaugeMetricFamily(
            "swarm_diverged_peers", "online peers whose parameters differ from the majority",
            value=sum(1 for p in s["peers"] if p["diverged"]),
        )  # fmt: skip
        yield CounterMetricFamily(
            "swarm_contributed_samples", "samples credited to all peers", value=s["contributed_samples"]
        )
        labels = ["peer_id", "name"]
        credit = CounterMetricFamily(
            "swarm_peer_contributed_samples", "samples credited to a peer", labels=labels
        )
        speed = GaugeMetricFamily(
            "swarm_peer_samples_per_second", "a peer's training throughput", labels=labels
        )
        step = GaugeMetricFamily("swarm_peer_step", "the step a peer last reported", labels=labels)
        suspected = GaugeMetricFamily(
            "swarm_peer_suspected_by",
            "online peers that avoid a peer for breaking their rounds",
            labels=labels,
        )
        for p in s["peers"]:
            credit.add_metric([p["peer_id"], p["name"]], p["contributed_samples"])
            if p["state"] == "online":
                speed.add_metric([p["peer_id"], p["name"]], p["samples_per_s"])
                step.add_metric([p["peer_id"], p["name"]], p["step"])
            if p["suspected_by"]:
                suspected.add_metric([p["peer_id"], p["name"]], p["suspected_by"])
        yield from (credit, speed, step, suspected)


def prometheus_text(snapshot: dict[str, Any]) -> bytes:
    """The Prometheus text exposition of a snapshot; every metric name starts with ``swarm_``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))  # type: ignore[arg-type]
    return generate_latest(registry)


class MetricsLogger:
    """Sends each history point to wandb or tensorboard, whichever the organizer chose and installed."""

    def __init__(self, kind: str, log_dir: Path, run_id: str):
        self.kind = kind
        self._writer: Any = None
        self._wandb: Any = None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "--log-to tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(log_dir / run_id))
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise ConfigError("--log-to wandb needs the wandb package: pip install wandb") from None
            log_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project="swarm", name=run_id, dir=str(log_dir), resume="allow", id=run_id
            )
        elif kind != "none":
            raise ConfigError(f"--log-to must be none, wandb or tensorboard, not {kind!r}")

    def log(self, point: HistoryPoint) -> None:
        values = {
            "samples_per_s": point.samples_per_s,
            "peers_online": float(point.peers_online),
            **({"train_loss": point.train_loss} if point.train_loss is not None else {}),
            **({"val_loss": point.val_loss} if point.val_loss is not None else {}),
        }
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(f"run/{name}", value, global_step=point.step, walltime=point.t)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({**values, "step": point.step})

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
