"""What stage servers and trainers announce in the DHT, and the view of the pipeline built from it.

Every member of a pipeline run stores a small record under ``<run_id>.pipeline`` (subkey: its peer ID)
every ``announce_interval_s``: a stage server says which stage it serves, at which step, how fast
(samples/s) and how busy it is, and the hashes of its state and parameters; a trainer says its step, the
samples it completed there and how many micro-batches it has in flight. Records expire unless refreshed,
so a killed peer drops out within a few seconds. Malformed records are ignored with a log line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import hivemind
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

HASH_CHARS = 64


def pipeline_key(run_id: str) -> str:
    return f"{run_id}.pipeline"


@dataclass(frozen=True)
class StageRecord:
    peer_id: str
    stage: int
    step: int
    samples_per_s: float  # measured forward+backward throughput of this replica
    load: float  # fraction of the last seconds spent computing, in [0, 1]
    state_hash: str
    param_hash: str
    updated_at: float
    role: str = "stage"


@dataclass(frozen=True)
class TrainerRecord:
    peer_id: str
    step: int
    samples: int  # samples of completed micro-batches at ``step``
    in_flight: int  # micro-batches started at ``step`` and not yet completed
    updated_at: float
    role: str = "trainer"


def _parse(peer_id: str, value: object) -> StageRecord | TrainerRecord | None:
    try:
        if not isinstance(value, dict):
            raise TypeError("not a map")
        role = value.get("role")
        if role == "stage":
            record = StageRecord(
                peer_id, value["stage"], value["step"], float(value["samples_per_s"]), float(value["load"]),
                value["state_hash"], value["param_hash"], float(value["updated_at"]),
            )  # fmt: skip
            ints = (record.stage, record.step)
            if not all(
                isinstance(h, str) and len(h) == HASH_CHARS for h in (record.state_hash, record.param_hash)
            ):
                raise ValueError("hashes must be 64 hex characters")
            if not (
                math.isfinite(record.samples_per_s) and record.samples_per_s >= 0 and 0 <= record.load <= 1
            ):
                raise ValueError("samples_per_s must be non-negative and load in [0, 1]")
        elif role == "trainer":
            record = TrainerRecord(
                peer_id, value["step"], value["samples"], value["in_flight"], float(value["updated_at"])
            )
            ints = (record.step, record.samples, record.in_flight)
        else:
            raise ValueError(f"unknown role {role!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ints):
            raise ValueError("stage, step and counts must be non-negative integers")
    except (KeyError, TypeError, ValueError) as e:
        logger.debug(f"ignoring pipeline record of {peer_id[:64]!r}: {e}")
        return None
    return record


@dataclass
class PipelineView:
    """Stage servers by stage and trainers, as the DHT showed them at one moment."""

    stages: dict[int, list[StageRecord]] = field(default_factory=dict)
    trainers: list[TrainerRecord] = field(default_factory=list)

    def replicas(self, stage: int, step: int | None = None) -> list[StageRecord]:
        return [r for r in self.stages.get(stage, []) if step is None or r.step == step]

    def run_step(self, num_stages: int) -> int:
        """The latest step every stage serves (with at least one replica); 0 when a stage has none."""
        return min(max((r.step for r in self.stages.get(k, [])), default=0) for k in range(num_stages))

    def throughput(self, stage: int) -> float:
        return sum(r.samples_per_s for r in self.stages.get(stage, []))


async def publish_record(
    dht: hivemind.DHT, run_id: str, record: StageRecord | TrainerRecord, *, ttl_s: float
) -> bool:
    value = asdict(record)
    value.pop("peer_id")
    return bool(
        await dht.store(
            pipeline_key(run_id), value, expiration_time=get_dht_time() + ttl_s, subkey=record.peer_id,
            return_future=True,
        )
    )  # fmt: skip


async def fetch_view(dht: hivemind.DHT, run_id: str, num_stages: int) -> PipelineView:
    found = await dht.get(pipeline_key(run_id), latest=True, return_future=True)
    view = PipelineView()
    if found is None or not isinstance(found.value, dict):
        return view
    for subkey, item in found.value.items():
        if not isinstance(subkey, str):
            continue
        record = _parse(subkey, item.value)
        if isinstance(record, StageRecord) and record.stage < num_stages:
            view.stages.setdefault(record.stage, []).append(record)
        elif isinstance(record, TrainerRecord):
            view.trainers.append(record)
    return view
