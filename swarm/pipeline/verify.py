"""Stage servers are verified: signed replies, and checks that look like retries.

Every reply of a stage replica carries the hash of the state it computed with and its signature of a
domain-separated digest (``reply_digest``) of (run, stage, step, state hash, trainer, micro-batch,
attempt, SHA-256 of what it was sent, SHA-256 of what it answered). A trainer refuses, and avoids, a
replica whose reply is unsigned or mis-signed (``check_reply``).

With probability ``pipeline.verify_probability`` per micro-batch, drawn from the trainer's private
randomness, the trainer sends the same micro-batch again to a second replica of one stage as a signed
retry (``StageCheck``, swarm/pipeline/check.py): the replica cannot tell it from a retry after a timeout, and the stage's
replicas keep only the latest attempt, so the micro-batch is still counted once. Replicas of a stage
at a step hold bit-identical state, and their forward is deterministic (the random state is seeded from
the micro-batch, ``microbatch_seed``), so on one kind of device both replies must be bit-equal. A
mismatch becomes ``StageMismatchEvidence`` (swarm/pipeline/evidence.py), filed with the coordinator.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.compression import Codec, get_codec
from swarm.config import RunConfig
from swarm.models import model_config
from swarm.pipeline.wire import decode_floats
from swarm.training.sync import is_state_hash

SIGNATURE_BYTES = 64


def tensor_sha256(*tensors: ppb.Tensor) -> bytes:
    """SHA-256 over each tensor's dtype, shape and bytes (an absent tensor hashes as an empty one)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(struct.pack(">II", t.dtype, len(t.shape)))
        h.update(struct.pack(f">{len(t.shape)}I", *t.shape))
        h.update(struct.pack(">Q", len(t.data)))
        h.update(t.data)
    return h.digest()


def sent_sha256(forward: ppb.ForwardRequest, backward: ppb.BackwardRequest | None = None) -> bytes:
    """What a replica was sent: a forward's inputs and targets, and for a backward also its grad_outputs
    (the backward's result depends on the forward's inputs too, so the signature binds both)."""
    tensors = [forward.inputs, forward.targets]
    if backward is not None:
        tensors.append(backward.grad_outputs)
    return tensor_sha256(*tensors)


def answer_sha256(outputs: ppb.Tensor, grad_inputs: ppb.Tensor, loss: float) -> bytes:
    return hashlib.sha256(tensor_sha256(outputs, grad_inputs) + struct.pack(">d", loss)).digest()


def reply_digest(
    call: str, run_id: str, stage: int, step: int, state_hash: str, trainer: str, microbatch_id: int,
    attempt: int, sent: bytes, answer: bytes,
) -> bytes:  # fmt: skip
    """What a replica signs for one reply (``call``: "forward", "inference" or "backward")."""
    # v2: a replica checks its own answer before signing (AnswerCheck), so a signed answer that fails the
    # check convicts its signer; a v1 signature, which made no such promise, verifies for nothing now.
    head = f"swarm-pipeline-reply-v2\0{call}\0{run_id}\0{stage}\0{step}\0{state_hash}\0{trainer}\0"
    return hashlib.sha256(f"{head}{microbatch_id}\0{attempt}\0".encode() + sent + answer).digest()


def _answer(reply: ppb.ForwardReply | ppb.BackwardReply) -> bytes:
    outputs = reply.outputs if isinstance(reply, ppb.ForwardReply) else ppb.Tensor()
    loss = reply.loss if isinstance(reply, ppb.ForwardReply) else 0.0
    return answer_sha256(outputs, reply.grad_inputs, loss)


def _digest(run_id: str, stage: int, trainer: str, reply, forward, backward) -> bytes:
    # An inference answer differs from a training one to the same inputs: the call names which it was.
    call = "backward" if backward is not None else "inference" if forward.inference else "forward"
    request = forward if backward is None else backward
    return reply_digest(call, run_id, stage, reply.step, reply.state_hash, trainer, request.microbatch_id,
                        request.attempt, sent_sha256(forward, backward), _answer(reply))  # fmt: skip


def sign_reply(
    key: SigningKey, run_id: str, stage: int, trainer: str, reply, forward: ppb.ForwardRequest,
    backward: ppb.BackwardRequest | None = None,
) -> None:  # fmt: skip
    """Sign ``reply`` (its ``state_hash`` set) in place for ``trainer``."""
    reply.signature = key.sign(_digest(run_id, stage, trainer, reply, forward, backward))


def check_reply(
    replica: str, run_id: str, stage: int, trainer: str, reply, forward: ppb.ForwardRequest,
    backward: ppb.BackwardRequest | None = None,
) -> None:  # fmt: skip
    """Raise a ProtocolError unless ``replica`` signed ``reply`` to exactly what ``trainer`` sent."""
    if len(reply.signature) != SIGNATURE_BYTES:
        raise ProtocolError(f"stage {stage} replica {replica} sent an unsigned reply")
    try:
        PublicKey.from_peer_id(replica).verify(
            reply.signature, _digest(run_id, stage, trainer, reply, forward, backward)
        )
    except SwarmError as e:
        raise ProtocolError(f"stage {stage} replica {replica} sent a mis-signed reply: {e}") from None


def microbatch_seed(run_id: str, stage: int, step: int, trainer: str, microbatch_id: int) -> int:
    """The random state a stage's forward of one micro-batch runs with (dropout): every replica of the
    stage, and the coordinator's recomputation, draw the same."""
    tag = f"swarm-pipeline-dropout\0{run_id}\0{stage}\0{step}\0{trainer}\0{microbatch_id}".encode()
    return int.from_bytes(hashlib.sha256(tag).digest()[:8], "big") >> 1


def differ(a: ppb.Tensor, b: ppb.Tensor, codec: Codec, tolerance: float) -> bool:
    """Whether two answered tensors differ: in any bit at ``tolerance`` 0, else by more than it."""
    if tolerance == 0 or a.dtype != b.dtype or list(a.shape) != list(b.shape) or not a.data or not b.data:
        return tensor_sha256(a) != tensor_sha256(b)
    shape = list(a.shape)
    try:
        x = decode_floats(a, codec, shape, what="answer")
        y = decode_floats(b, codec, shape, what="answer")
    except ProtocolError:
        return True
    return bool((x - y).abs().max() > tolerance)


def replies_differ(a, b, codec: Codec, tolerance: float) -> bool:
    if isinstance(a, ppb.ForwardReply):
        if differ(a.outputs, b.outputs, codec, tolerance):
            return True
        bits = struct.pack(">d", a.loss) != struct.pack(">d", b.loss)
        if bits if tolerance == 0 else not abs(a.loss - b.loss) <= tolerance:
            return True
    return differ(a.grad_inputs, b.grad_inputs, codec, tolerance)


def seed_forward(run_id: str, stage: int, request: ppb.ForwardRequest, trainer: str) -> None:
    torch.manual_seed(microbatch_seed(run_id, stage, request.step, trainer, request.microbatch_id))


class AnswerCheck:
    """The checks a stage makes of what a trainer relays to it, made by the trainer on the answer first:
    forward ``outputs`` (to the next stage) and ``grad_inputs`` (to the previous one's backward) must be
    in the run's codec, of the call's shape (the rows and length of its inputs, within the micro-batch's),
    finite, and ``grad_inputs`` within ``max_grad_output_norm``; a loss is a finite cross-entropy (>= 0) at
    the last stage's forward and 0 anywhere else. A failure raises a ProtocolError naming the stage and
    the field.

    Example::

        AnswerCheck(run).check(stage, reply, forward)            # a forward's reply
        AnswerCheck(run).check(stage, reply, forward, backward)  # a backward's reply
    """

    def __init__(self, run: RunConfig):
        config = model_config(run.model.name, run.model.config)
        self.codec = get_codec(run.training.compression)
        self.rows, self.length, self.width = run.training.micro_batch_size, config.seq_len, config.d_model
        self.last, self.bound = run.pipeline.stages - 1, run.pipeline.max_grad_output_norm

    def _shape(self, stage: int, forward: ppb.ForwardRequest) -> list[int]:
        """The answer's shape: the rows and length of the call's inputs, which the stage accepts only
        within the micro-batch's (a replica that answered other inputs deviated)."""
        shape = list(forward.inputs.shape)
        if len(shape) < 2 or not (1 <= shape[0] <= self.rows and 1 <= shape[1] <= self.length):
            raise ProtocolError(f"stage {stage} answered a call whose inputs have shape {shape[:4]}")
        return [shape[0], shape[1], self.width]

    def check(
        self, stage: int, reply, forward: ppb.ForwardRequest, backward: ppb.BackwardRequest | None = None,
        *, slack: float = 0.0,
    ) -> None:  # fmt: skip
        """``slack``: how far over the norm bound (relatively) still passes; a judge allows for another
        machine's rounding."""
        shape = self._shape(stage, forward)
        answers_loss = backward is None and stage == self.last and forward.HasField("targets")
        loss = reply.loss if isinstance(reply, ppb.ForwardReply) else 0.0
        if answers_loss and not (math.isfinite(loss) and loss >= 0):
            raise ProtocolError(f"stage {stage}'s loss {loss!r} is not a finite cross-entropy")
        if not answers_loss and loss != 0:
            raise ProtocolError(f"stage {stage} answered a loss ({loss!r}) to a call that has none")
        if backward is None and stage < self.last:
            decode_floats(reply.outputs, self.codec, shape, what=f"stage {stage}'s outputs")
        # A training call's grad_inputs go on to the previous stage's backward (stage 0 answers none).
        if stage == 0 or (backward is None and (stage < self.last or forward.inference)):
            return
        what = f"stage {stage}'s grad_inputs"
        grad = decode_floats(reply.grad_inputs, self.codec, shape, what=what)
        norm = float(grad.norm())
        if not norm <= self.bound * (1.0 + slack):
            raise ProtocolError(f"{what} has L2 norm {norm:.6g}, over the run's bound {self.bound:.6g}")

    def fault(
        self, stage: int, reply, forward: ppb.ForwardRequest, backward: ppb.BackwardRequest | None = None,
        *, slack: float = 0.0,
    ) -> str | None:  # fmt: skip
        """What is wrong with a signed ``reply`` that no honest replica would sign, or None: it names
        no state, or ``check`` refuses it. Deterministic from the reply's bytes, so a judge can repeat it."""
        if not is_state_hash(reply.state_hash):  # a reply that names no state cannot be judged
            return f"it names no state it was computed with (state_hash {reply.state_hash[:80]!r})"
        try:
            self.check(stage, reply, forward, backward, slack=slack)
        except ProtocolError as e:
            return str(e)
        return None
