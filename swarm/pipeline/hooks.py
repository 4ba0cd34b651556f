"""``PipelineHooks``: what a stage replica or a pipeline trainer announces and sends, honest by default.

``StageWorker``, ``StageServicer`` and ``PipelineTrainer`` call these where a pipeline peer could lie;
the default returns what it is given, so they call it unconditionally. Two flags are read instead where
the honest peer has nothing to compute (the other trainers' public micro-batch IDs):

- ``announce(record) -> record``: the ``StageRecord`` or ``TrainerRecord`` the peer signs and publishes;
- ``heard(microbatches)``, when ``hears_microbatches``: the (trainer, micro-batch ID) pairs the trainers
  in a replica's view issue at its step, given before each ``announce``;
- ``front_run(request, victim_ids) -> [request]``, when ``front_runs``: forwards a trainer sends to the
  last stage's server just before its own ``request``;
- ``stage_reply(kind, request, reply, replica) -> reply``: the reply a replica signs and answers to a
  ``kind`` (``"forward"`` or ``"backward"``) request.

Rehearsed attacks (``swarm.byzantine.pipeline_attacks``) implement these; the library never imports them.

Example::

    servicer = StageServicer(replica, gate, key=key, hooks=PipelineHooks())  # honest
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from protocols import pipeline_pb2 as ppb

if TYPE_CHECKING:
    from swarm.pipeline.replica import StageReplica

Record = TypeVar("Record")
Reply = TypeVar("Reply", ppb.ForwardReply, ppb.BackwardReply)


class PipelineHooks:
    """An honest pipeline peer: announces its true record, sends only its own requests, answers honestly."""

    #: Whether ``heard`` wants the micro-batches the trainers in view issue (computed only then).
    hears_microbatches: ClassVar[bool] = False
    #: Whether ``front_run`` sends anything (the victims' IDs are computed only then).
    front_runs: ClassVar[bool] = False

    def announce(self, record: Record) -> Record:
        """The pipeline record (``StageRecord`` or ``TrainerRecord``) this peer signs and publishes."""
        return record

    def heard(self, microbatches: Sequence[tuple[str, int]]) -> None:
        """The (trainer, micro-batch ID) pairs the trainers in a stage replica's view issue at its step."""

    def front_run(self, request: ppb.ForwardRequest, victim_ids: Sequence[int]) -> list[ppb.ForwardRequest]:
        """Forward requests a pipeline trainer sends to a stage server just before ``request``."""
        return []

    def stage_reply(self, kind: str, request: object, reply: Reply, replica: StageReplica) -> Reply:
        """The reply a stage replica signs and answers to ``request``, a ``kind`` ("forward"/"backward")."""
        return reply


__all__ = ["PipelineHooks"]
