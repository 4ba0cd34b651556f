"""Attacks on the SWARM pipeline: what one admitted stage replica or trainer can announce or send.

Each rewrites what its peer announces in the DHT (``Attack.announce``, called on the pipeline record
before it is signed) or what it sends to a stage server:

- ``stage_throughput_lie``: a replica claims ``samples_per_s`` samples/s and no load, to draw every
  micro-batch to itself;
- ``stuck_in_flight``: a trainer claims ``in_flight`` micro-batches forever, to hold every stage's step;
- ``forged_retried``: a replica claims a later attempt (``attempt``) of every micro-batch it heard of, so
  that the stage's honest replicas drop what they counted;
- ``front_runner``: a trainer sends its own data under an honest trainer's micro-batch ID first
  (``request_as``), so that its data is counted for the honest one and the honest one gets its answer.

Example::

    attack = make_attack("stage_throughput_lie", group_size=3, attackers=1)
    record = attack.announce(record)        # a StageRecord claiming 1e12 samples/s
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pydantic import Field

from protocols import pipeline_pb2 as ppb
from swarm.byzantine.attacks import Attack, AttackOptions, register_attack


class ThroughputLieOptions(AttackOptions):
    samples_per_s: float = Field(1e12, ge=0, le=1e12, description="the throughput the replica claims")


@register_attack("stage_throughput_lie", ThroughputLieOptions)
class StageThroughputLie(Attack):
    pipeline_role = "stage"

    def announce(self, record: object) -> object:
        if getattr(record, "role", None) != "stage":
            return record
        return dataclasses.replace(record, samples_per_s=self.options.samples_per_s, load=0.0)


class StuckInFlightOptions(AttackOptions):
    in_flight: int = Field(1, ge=1, le=1 << 20, description="the micro-batches the trainer claims in flight")


@register_attack("stuck_in_flight", StuckInFlightOptions)
class StuckInFlight(Attack):
    pipeline_role = "trainer"

    def announce(self, record: object) -> object:
        if getattr(record, "role", None) != "trainer":
            return record
        return dataclasses.replace(record, in_flight=max(record.in_flight, self.options.in_flight))


class ForgedRetriedOptions(AttackOptions):
    attempt: int = Field(1 << 16, ge=2, le=1 << 16, description="the attempt claimed for every micro-batch")


@register_attack("forged_retried", ForgedRetriedOptions)
class ForgedRetried(Attack):
    """Claims, for each (trainer, micro-batch) in ``victims``, a later attempt than any honest one; the
    signature it cannot make is replaced by its own."""

    pipeline_role = "stage"
    signature = bytes(64)

    def __init__(self, options: ForgedRetriedOptions, context: object) -> None:
        super().__init__(options, context)
        self.victims: list[tuple[str, int]] = []

    def heard(self, microbatches: Sequence[tuple[str, int]]) -> None:
        self.victims = list(microbatches)[:64]

    def announce(self, record: object) -> object:
        if getattr(record, "role", None) != "stage":
            return record
        forged = tuple((t, k, self.options.attempt, self.signature) for t, k in self.victims)
        return dataclasses.replace(record, retried=forged[:64])


class FrontRunnerOptions(AttackOptions):
    victims: int = Field(4, ge=1, le=64, description="honest micro-batch IDs sent ahead of each own one")


@register_attack("front_runner", FrontRunnerOptions)
class FrontRunner(Attack):
    pipeline_role = "trainer"

    def request_as(self, mine: ppb.ForwardRequest, victim_id: int) -> ppb.ForwardRequest:
        """The attacker's own forward, sent under the victim's micro-batch ID."""
        stolen = ppb.ForwardRequest()
        stolen.CopyFrom(mine)
        stolen.microbatch_id = victim_id
        return stolen

    def front_run(self, request: ppb.ForwardRequest, victim_ids: Sequence[int]) -> list[ppb.ForwardRequest]:
        return [self.request_as(request, v) for v in list(victim_ids)[: self.options.victims]]
