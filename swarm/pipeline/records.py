"""What stage servers and trainers announce in the DHT, and the view of the pipeline built from it.

Every member of a pipeline run stores a small signed record (``swarm.records``: signed by the member,
carrying its certificate) under ``<run_id>.pipeline`` (subkey: its peer ID) every ``announce_interval_s``: a stage server says which stage it serves, at which step, how fast
(samples/s) and how busy it is, and the hashes of its state and parameters; a trainer says its step, the
samples it completed there and how many micro-batches it has in flight. Records expire unless refreshed,
so a killed peer drops out within a few seconds. Records that are unsigned, uncertified, banned or
malformed are ignored with one log line each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import hivemind

from swarm.data.seeds import derive_seed
from swarm.records import RecordSigner, RecordTrust, record_key


def pipeline_key(run_id: str) -> str:
    return record_key(run_id, "pipeline")


@dataclass(frozen=True)
class StageRecord:
    """A stage replica's signed record in the DHT: the stage it serves, its step, state and load."""

    peer_id: str
    stage: int
    step: int
    samples_per_s: float  # measured forward+backward throughput of this replica
    load: float  # fraction of the last seconds spent computing, in [0, 1]
    state_hash: str
    param_hash: str
    updated_at: float
    role: str = "stage"
    serving: bool = True  # False: loading the stage's state, or draining before it leaves; serves no one
    joining: bool = False  # it sits out the current step of the stage it joined: it takes no round
    closing: bool = False  # it closed ``step``: what it counted there is final
    # (trainer, micro-batch, attempt, the trainer's signature of it) it counted at ``step`` on a retry
    retried: tuple[tuple[str, int, int, bytes], ...] = ()


@dataclass(frozen=True)
class TrainerRecord:
    """A pipeline trainer's signed record in the DHT: its step and the micro-batches it has done and in flight."""

    peer_id: str
    step: int
    samples: int  # samples of completed micro-batches at ``step``
    in_flight: int  # micro-batches started at ``step`` and not yet completed
    updated_at: float
    role: str = "trainer"


@dataclass
class PipelineView:
    """Stage servers by stage and trainers, as the DHT showed them at one moment.

    ``stages`` holds the replicas that serve trainers; ``holders`` every replica of a stage, also those
    loading its state or draining before they leave (they still average with the stage)."""

    stages: dict[int, list[StageRecord]] = field(default_factory=dict)
    trainers: list[TrainerRecord] = field(default_factory=list)
    holders: dict[int, list[StageRecord]] = field(default_factory=dict)

    def replicas(self, stage: int, step: int | None = None) -> list[StageRecord]:
        return [r for r in self.stages.get(stage, []) if step is None or r.step == step]

    def members(self, stage: int) -> list[StageRecord]:
        """Every replica of ``stage``, serving or not."""
        return list(self.holders.get(stage, []))

    def averaging(self, stage: int, step: int) -> list[StageRecord]:
        """The replicas of ``stage`` to expect in its round of ``step``, or ahead of it. A replica that
        joined at ``step`` sits it out; one that joined at ``step - 1`` takes part (a view a beat old
        may still show it joining)."""
        return [
            r for r in self.holders.get(stage, [])
            if (r.step >= step if not r.joining else r.step != step and r.step + 1 >= step)
        ]  # fmt: skip

    def run_step(self, num_stages: int) -> int:
        """The latest step every stage serves (with at least one replica); 0 when a stage has none."""
        return min(max((r.step for r in self.stages.get(k, [])), default=0) for k in range(num_stages))

    def public_microbatches(self, run_id: str, step: int, per_trainer: int) -> list[tuple[str, int]]:
        """(trainer, micro-batch ID) of the first ``per_trainer`` micro-batches each trainer in view issues
        at ``step``: IDs are public seeds, so anyone who read the code knows them."""
        return [
            (t.peer_id, derive_seed(run_id, t.peer_id, step, i))
            for t in self.trainers
            if t.step == step
            for i in range(per_trainer)
        ]

    def throughput(self, stage: int) -> float:
        return sum(r.samples_per_s for r in self.stages.get(stage, []))


async def publish_record(
    dht: hivemind.DHT, signer: RecordSigner, run_id: str, record: StageRecord | TrainerRecord, *, ttl_s: float
) -> bool:
    body = asdict(record)
    for name in ("peer_id", "updated_at"):
        body.pop(name)
    for name in ("samples_per_s", "load"):
        if name in body:
            body[name] = float(body[name])
    if "retried" in body:
        body["retried"] = [list(claim) for claim in body["retried"]]
    return await signer.publish(dht, "pipeline", run_id, body, ttl_s=ttl_s)


async def fetch_view(dht: hivemind.DHT, trust: RecordTrust, num_stages: int) -> PipelineView:
    """The stage servers and trainers with a valid signed record, by role."""
    found = await dht.get(pipeline_key(trust.run_id), latest=True, return_future=True)
    view = PipelineView()
    for peer_id, r in trust.open_dictionary("pipeline", found).items():
        b = r.body
        if b.role == "stage" and b.stage < num_stages:
            record = StageRecord(peer_id, b.stage, b.step, b.samples_per_s, b.load, b.state_hash, b.param_hash,
                                 r.issued_at, serving=b.serving, joining=b.joining, closing=b.closing,
                                 retried=tuple(tuple(c) for c in b.retried))  # fmt: skip
            view.holders.setdefault(b.stage, []).append(record)
            if b.serving:
                view.stages.setdefault(b.stage, []).append(record)
        elif b.role == "trainer":
            view.trainers.append(TrainerRecord(peer_id, b.step, b.samples, b.in_flight, r.issued_at))
    return view
