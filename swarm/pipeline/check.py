"""A trainer's checks of stage replicas: a drawn micro-batch repeated at a second replica, compared.

A check is a signed retry of one stage's calls (see swarm/pipeline/verify.py); a mismatch becomes
``StageMismatchEvidence`` and is filed with the coordinator. A signed answer that fails the trainer's
check of what it relays becomes ``StageAnswerEvidence`` (``file_bad_answer``), filed the same way.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from protocols import pipeline_pb2 as ppb
from protocols.keys import SigningKey
from protocols.messages import MAX_ATTEMPT
from swarm.averaging.compression import Codec
from swarm.config import RunConfig
from swarm.pipeline.evidence import FILE_SLACK, StageAnswerEvidence, StageMismatchEvidence
from swarm.pipeline.verify import AnswerCheck, replies_differ
from swarm.pipeline.wire import sign_attempt

logger = logging.getLogger(__name__)

#: Replicas a trainer remembers having filed a bad answer of (one filing each; the oldest is forgotten past
#: it, so no number of filings ever stops the next), and filings it has in flight at once.
MAX_FILED_ANSWERS = 256
MAX_FILINGS_IN_FLIGHT = 8


@dataclass
class StageCall:
    """What one stage was sent and answered for one micro-batch: what a check repeats and compares."""

    peer: str
    forward: ppb.ForwardRequest
    forward_reply: ppb.ForwardReply
    backward: ppb.BackwardRequest | None = None
    backward_reply: ppb.BackwardReply | None = None


Caller = Callable[..., Awaitable[object]]


class StageCheck:
    """A trainer's checks of stage replicas: repeat a drawn micro-batch at a second replica and compare.

    Example::

        check = StageCheck(run, key, call=trainer._call, choose=trainer._choose_other, accuse=accuse)
        await check.maybe_check(step, attempt, trace)   # trace: stage -> StageCall of the micro-batch
    """

    def __init__(
        self, run: RunConfig, key: SigningKey, codec: Codec, *, call: Caller,
        choose: Callable[[int, int, str], str | None], accuse=None,
    ):  # fmt: skip
        self.run, self.key, self.codec = run, key, codec
        self.call, self.choose, self.accuse = call, choose, accuse
        self.rng = random.SystemRandom()  # private: a replica cannot predict which micro-batch is checked
        self.stats = {"checks": 0, "mismatches": 0, "bad_answers": 0}
        self.answers = AnswerCheck(run)
        self.filed: dict[str, None] = {}  # replicas whose bad answer was filed, oldest first: one each
        self._filings: set[asyncio.Task] = set()

    def file_bad_answer(self, stage: int, peer: str, forward, backward, reply) -> StageAnswerEvidence | None:
        """File ``peer``'s signed ``reply`` (to ``forward``, and ``backward`` if it answers one) with the
        coordinator if it fails the check past ``FILE_SLACK``; in the background, once per replica."""
        fault = self.answers.fault(stage, reply, forward, backward, slack=FILE_SLACK)
        if fault is None or peer in self.filed or len(self._filings) >= MAX_FILINGS_IN_FLIGHT:
            return None  # a filing in flight for it, or too many at once: its next bad answer files
        self.filed[peer] = None
        while len(self.filed) > MAX_FILED_ANSWERS:
            del self.filed[next(iter(self.filed))]
        self.stats["bad_answers"] += 1
        evidence = StageAnswerEvidence(
            self.run.run_id, stage, self.key.peer_id, peer, forward, backward, reply
        )
        verdict = f"stage {stage} replica {peer} signed an answer that fails the check: {fault}"
        logger.warning(verdict)
        if self.accuse is not None:
            task = asyncio.get_running_loop().create_task(self._file(peer, evidence, verdict))
            self._filings.add(task)
            task.add_done_callback(self._filings.discard)
        return evidence

    async def _file(self, peer: str, evidence: object, verdict: str) -> None:
        try:
            await self.accuse(peer, evidence, verdict)
        except Exception as e:  # not taken: the replica's next bad answer is filed again
            self.filed.pop(peer, None)
            logger.warning(f"accusation of stage replica {peer} not filed: {e!r}")

    def drawn(self) -> bool:
        p = self.run.pipeline.verify_probability
        return p > 0 and self.rng.random() < p

    def drawn_validation(self) -> bool:
        """Whether a validation pass checks one of its batches: every pass while checks are on (a pass
        is a few batches, so a per-batch draw would leave a replica that lies only there unchecked)."""
        return self.run.pipeline.verify_probability > 0

    async def maybe_check(
        self, step: int, attempt: int, trace: dict[int, StageCall], *, drawn: bool | None = None
    ) -> object | None:
        """With probability ``verify_probability`` (or if ``drawn``), check one stage of the micro-batch
        ``trace`` holds; returns the evidence of a mismatch, if one was found (and filed)."""
        if not trace or not (self.drawn() if drawn is None else drawn):
            return None
        order = list(trace)
        self.rng.shuffle(order)
        for stage in order:
            other = self.choose(stage, step, trace[stage].peer)
            if other is not None:
                return await self.check(stage, other, min(attempt + 1, MAX_ATTEMPT), trace[stage])
        return None

    async def check(self, stage: int, other: str, attempt: int, first: StageCall) -> object | None:
        if other == first.peer:
            return None  # its repeat answers what it answered: no check, and no evidence the judge takes
        self.stats["checks"] += 1
        signature = sign_attempt(self.key, self.run.run_id, stage, first.forward.step,
                                 first.forward.microbatch_id, attempt)  # fmt: skip
        forward = ppb.ForwardRequest()
        forward.CopyFrom(first.forward)
        if not forward.inference:  # an inference call counts nothing: it is asked again as it was
            forward.attempt, forward.attempt_signature = attempt, signature
        try:
            reply = await self.call(stage, other, "rpc_forward", forward)
            backward = back = None
            if first.backward is not None:
                # Always sent, even after a mismatching forward: the replica counts the micro-batch (the
                # first replica's copy is superseded) and holds no forward that would delay its step.
                backward = ppb.BackwardRequest()
                backward.CopyFrom(first.backward)
                backward.attempt, backward.attempt_signature = attempt, signature
                back = await self.call(stage, other, "rpc_backward", backward, forward=forward)
            found = None
            tolerance = self.run.pipeline.verify_tolerance
            if replies_differ(first.forward_reply, reply, self.codec, tolerance):
                found = StageMismatchEvidence.of(self.run.run_id, stage, self.key.peer_id,
                                                 (first.peer, first.forward, None, first.forward_reply),
                                                 (other, forward, None, reply))  # fmt: skip
            elif back is not None and replies_differ(first.backward_reply, back, self.codec, tolerance):
                found = StageMismatchEvidence.of(
                    self.run.run_id, stage, self.key.peer_id,
                    (first.peer, first.forward, first.backward, first.backward_reply),
                    (other, forward, backward, back),
                )  # fmt: skip
        except Exception as e:  # a refusal or failure (the trainer's StageFailure): no check made
            logger.info(f"check of stage {stage} at {other} did not complete: {e}")
            return None
        if found is None:
            return None
        self.stats["mismatches"] += 1
        verdict = f"stage {stage} replicas {first.peer} and {other} answered micro-batch {forward.microbatch_id} differently"
        logger.warning(verdict)
        if self.accuse is not None:
            try:
                await self.accuse(first.peer, found, verdict)
            except Exception as e:
                logger.warning(f"accusation of stage {stage}'s replicas not filed: {e!r}")
        return found
