"""Attacks on the SWARM pipeline: what one admitted stage replica or trainer can announce or send.

Each rewrites what its peer announces in the DHT (``Attack.announce``, called on the pipeline record
before it is signed) or what it sends to a stage server:

- ``stage_throughput_lie``: a replica claims ``samples_per_s`` samples/s and no load, to draw every
  micro-batch to itself;
- ``stuck_in_flight``: a trainer claims ``in_flight`` micro-batches forever, to hold every stage's step;
- ``forged_retried``: a replica claims a later attempt (``attempt``) of every micro-batch it heard of, so
  that the stage's honest replicas drop what they counted;
- ``front_runner``: a trainer sends its own data under an honest trainer's micro-batch ID first
  (``request_as``), so that its data is counted for the honest one and the honest one gets its answer;
- ``stage_poison``: a replica answers scaled forward outputs and ``grad_inputs`` inflated to the norm
  bound, signed (``Attack.stage_reply``), for the stage's checks to catch.

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
from swarm.pipeline.wire import decode_floats, encode_floats


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


class StagePoisonOptions(AttackOptions):
    scale: float = Field(
        1.5, ge=-1e3, le=1e3, description="factor on the forward outputs the replica answers"
    )
    grad_norm_share: float = Field(
        0.99,
        ge=0,
        le=100,
        description="grad_inputs are answered at this share of the run's norm bound (over 1: the trainer "
        "refuses them and avoids the replica)",
    )
    share: float = Field(1.0, gt=0, le=1, description="share of micro-batches poisoned (drawn per ID)")


@register_attack("stage_poison", StagePoisonOptions)
class StagePoison(Attack):
    """A stage replica that answers scaled forward outputs and ``grad_inputs`` inflated to (nearly) the
    norm bound, and signs them: what the stage's checks must catch."""

    pipeline_role = "stage"

    def _poisoned(self, microbatch_id: int) -> bool:
        return (microbatch_id * 0x9E3779B97F4A7C15 % (1 << 64)) / (1 << 64) < self.options.share

    def stage_reply(self, kind: str, request, reply: ppb.ForwardReply | ppb.BackwardReply, replica) -> object:
        if reply.code != ppb.OK or not self._poisoned(request.microbatch_id):
            return reply
        if kind == "forward" and reply.outputs.data:
            values = decode_floats(reply.outputs, replica.codec, list(reply.outputs.shape), what="outputs")
            reply.outputs.CopyFrom(encode_floats(values * self.options.scale, replica.codec))
        if reply.grad_inputs.data:
            values = decode_floats(
                reply.grad_inputs, replica.codec, list(reply.grad_inputs.shape), what="grads"
            )
            bound = self.options.grad_norm_share * replica.run.pipeline.max_grad_output_norm
            inflated = values * (bound / max(float(values.norm()), 1e-12))
            reply.grad_inputs.CopyFrom(encode_floats(inflated, replica.codec))
        return reply
