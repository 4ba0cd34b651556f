"""The P2P handlers of a stage server: admit the caller, check the request, compute, answer.

Every answer carries a code. Anything but OK comes with a message naming what was wrong (the field, the
expected and received shape or dtype, the step), so the trainer can log it and retry the micro-batch on
another replica. A bad request never raises past the handler: the server stays up and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2PContext, ServicerBase

from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.inbound import UNARY_MAX_BYTES, BoundedServicer, HandlerBound
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.history import rehash
from swarm.pipeline.hooks import PipelineHooks
from swarm.pipeline.replica import Refusal, StageReplica
from swarm.pipeline.verify import AnswerCheck, seed_forward, sign_reply

logger = logging.getLogger(__name__)

MAX_CALLS_PER_PEER = 64  # forward and backward calls one trainer has in flight at one server


def pipeline_namespace(run_id: str, stage: int) -> str:
    return f"{run_id.replace('.', '_')}_pipeline_stage{stage}"


class StageServicer(BoundedServicer):
    """Serves one replica's forward and backward to trainers (hivemind finds ``rpc_*`` by annotations).

    Example::

        servicer = StageServicer(replica, gate)
        await servicer.add_p2p_handlers(p2p, namespace=pipeline_namespace(run_id, replica.index))
    """

    # Unary: a request is at most what the p2p daemon lets through (activations of one micro-batch).
    bounds = {
        "rpc_forward": lambda self: HandlerBound(UNARY_MAX_BYTES, MAX_CALLS_PER_PEER),
        "rpc_backward": lambda self: HandlerBound(UNARY_MAX_BYTES, MAX_CALLS_PER_PEER),
    }

    def __init__(
        self,
        replica: StageReplica,
        gate: PeerGate,
        *,
        key: SigningKey | None = None,
        hooks: PipelineHooks | None = None,
    ):
        self.replica, self.gate, self.key = replica, gate, key
        self.hooks = hooks if hooks is not None else PipelineHooks()
        # A signed answer that fails the trainer's check is evidence against its signer: check it first.
        self.answers = AnswerCheck(replica.run)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names handlers after the class: a subclass (a test's misbehaving server) must answer
        # under the names trainers call.
        return ServicerBase._get_handle_name.__func__(StageServicer, namespace, method_name)

    async def _serve(self, kind: str, request, context: P2PContext, reply_type: type):
        caller = context.remote_id.to_base58()
        refusal = await self.gate.check(caller)
        if refusal is not None:
            code, message = refusal
            logger.info(f"stage {self.replica.index}: refused {kind} from {caller}: {message}")
            return reply_type(code=code, error=message, step=self.replica.step)
        try:
            return await self.replica.compute(self._answer, kind, request, caller)
        except Refusal as e:
            if e.code == ppb.BAD_REQUEST:
                logger.warning(f"stage {self.replica.index}: bad {kind} from {caller}: {e.message}")
                self.gate.note_bad_request(caller, e.message)
            return reply_type(code=e.code, error=e.message, step=e.step)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or an exhausted device must not take the server down
            logger.exception(f"stage {self.replica.index}: {kind} from {caller} failed")
            return reply_type(
                code=ppb.INTERNAL, error=f"{kind} failed on the server: {e!r}", step=self.replica.step
            )

    def _answer(self, kind: str, request, caller: str):
        """Compute and sign one reply, on the replica's thread. The forward's random state is seeded from
        the micro-batch, so that every replica of the stage (and a recomputation) draws the same dropout."""
        r = self.replica
        if not r.state_hash or r.hashed_step != r.step:
            rehash(r)  # every reply names the state it was computed with, or nobody could judge it
        if kind == "forward":
            seed_forward(r.run.run_id, r.index, request, caller)
            reply, backward = r.forward(request, caller), None
            # A repeat answers what the micro-batch's first forward computed: sign what that was sent.
            held = None if request.inference else r.forwards.get((caller, request.microbatch_id))
            forward = request
            if held is not None and held.request is not request:
                forward = ppb.ForwardRequest()
                forward.CopyFrom(held.request)
                forward.attempt = request.attempt
        else:
            reply, backward = r.backward(request, caller), request
            forward = r.forwards[(caller, request.microbatch_id)].request
            kept = r._replay.get((caller, request.microbatch_id), (None, None))[1]
            if kept is not None and kept is not request.grad_outputs:  # a repeat: the first gradient's answer
                backward = ppb.BackwardRequest()
                backward.CopyFrom(request)
                backward.grad_outputs.CopyFrom(kept)
        try:
            self.answers.check(r.index, reply, forward, backward)
        except ProtocolError as e:  # e.g. grad_inputs over the run's bound: refused, never signed
            raise Refusal(
                ppb.INTERNAL, f"this replica's own answer fails the stage's check: {e}", r.step
            ) from None
        reply = self.hooks.stage_reply(kind, request, reply, r)  # a rehearsed cheat signs a wrong answer
        reply.state_hash = r.state_hash
        if self.key is not None:
            sign_reply(self.key, r.run.run_id, r.index, caller, reply, forward, backward)
        return reply

    async def rpc_forward(self, request: ppb.ForwardRequest, context: P2PContext) -> ppb.ForwardReply:
        return await self._serve("forward", request, context, ppb.ForwardReply)

    async def rpc_backward(self, request: ppb.BackwardRequest, context: P2PContext) -> ppb.BackwardReply:
        return await self._serve("backward", request, context, ppb.BackwardReply)
