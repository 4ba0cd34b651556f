"""One replica of one pipeline stage: its part of the model, optimizer, and the micro-batches it serves.

Compute runs on one worker thread per replica, so requests from many trainers are served in turn and
the event loop never blocks. Micro-batches belong to the trainer that sent them: everything kept of one
is keyed by (caller, micro-batch ID), where the caller is the peer ID the transport authenticated, so a
peer that sends another trainer's ID first only runs a micro-batch of its own. A forward keeps the
micro-batch's graph (dropped after ``forward_state_ttl_s``) until its backward arrives. A backward adds
the micro-batch's gradient to the replica's accumulated gradient once per key and step: a retried
micro-batch that reaches the same replica again from its trainer gets the same answer back and is not
counted twice.

A retry that reaches *another* replica of the stage (the first timed out, but was only slow) is
counted there too; the replica group settles it when the step closes. Every request carries the
trainer's attempt number, and a replica remembers, per micro-batch it counted, the latest attempt that
reached it (``claims``): the trainer's final, successful path holds the latest attempt at every stage.
An attempt above 1 comes with the trainer's signature of it (``swarm.pipeline.wire.attempt_ticket``).
Replicas announce the micro-batches they hold with an attempt above 1, with that signature, and one that
finds another replica holding a later, validly signed attempt of a micro-batch it counted drops it: it
replays that trainer's other micro-batches (their inputs, gradients and random state are kept until the
step closes) from a zero gradient, so the trainer's sum is bit for bit the one it would hold had the
retry never reached it, and the other trainers' sums are left as they are.

Gradients are of the summed loss over the micro-batch's samples. A replica keeps one running sum per
trainer (``by_trainer``), and when the step closes it aggregates the trainers' mean gradients with the
run's robust rule (``training.aggregator``, weighted by each trainer's samples), not a sum: a trainer
that sends outlying ``grad_outputs`` (up to the norm bound, ~1000x an honest one) moves the stage no
more than the rule lets one sender, and is named in ``outliers`` (its distance to the aggregate is over
``OUTLIER_FACTOR`` times the median trainer's, among three or more). With one trainer the result is its
mean gradient, bit for bit what the sum gave.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import torch.nn.functional as F

from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError
from protocols.messages import MAX_RETRIED_CLAIMS
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.compression import get_codec
from swarm.config import RunConfig
from swarm.models import model_config
from swarm.models.gpt import VOCAB_SIZE
from swarm.pipeline.held import (
    MAX_FORWARD_STATES,
    HeldForward,
    Key,
    Refusal,
    forwards_per_caller,
    make_room,
)
from swarm.pipeline.layout import build_stage, stage_layout
from swarm.pipeline.wire import check_attempt, decode_floats, decode_ids, encode_floats
from swarm.training.state import (
    apply_flat_gradient,
    build_optimizer,
    ensure_optimizer_state,
    load_state_tensors,
    params_hash,
    state_hash,
    state_tensors,
)

T = TypeVar("T")

#: Trainers served at one step (each holds a flat gradient copy here); past it a new one is refused (BUSY).
MAX_TRAINERS_PER_STEP = 64
#: A trainer this many times the median trainer's distance from the aggregate is an outlier (suspected).
OUTLIER_FACTOR = 4.0


class StageReplica:
    """Stage ``index`` of ``run``, as one peer holds it.

    Example::

        replica = StageReplica(run, 0)
        reply = await replica.forward(request)        # a ForwardReply, or raises Refusal
    """

    def __init__(self, run: RunConfig, index: int, *, device: str = "cpu"):
        self.run, self.index, self.device = run, index, device
        self.spec = stage_layout(run)[index]
        self.num_stages = run.pipeline.stages
        self.model = build_stage(run, index).to(device)
        self.optimizer = build_optimizer(self.model, run.optimizer)
        ensure_optimizer_state(self.model, self.optimizer)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.codec = get_codec(run.training.compression)
        self.aggregate = get_aggregator(run.training.aggregator, run.training.aggregator_options)
        self.by_trainer: dict[str, torch.Tensor] = {}  # trainer -> its summed gradient at this step (flat)
        self.trainer_samples: Counter[str] = Counter()
        self.outliers: list[str] = []  # trainers far from the aggregate of the step last averaged
        config = model_config(run.model.name, run.model.config)
        self.d_model, self.seq_len = config.d_model, config.seq_len
        self.max_batch = run.training.micro_batch_size
        self.max_trainers = MAX_TRAINERS_PER_STEP
        self.forwards_per_caller = forwards_per_caller(run)
        self.step = 0
        self.samples = 0
        self.claims: dict[Key, int] = {}  # counted micro-batch -> the latest attempt that reached it here
        self._replay: dict[Key, tuple[HeldForward, ppb.Tensor | None]] = {}  # in counting order
        self.forwards: dict[Key, HeldForward] = {}
        self.served: set[str] = set()  # trainers that sent a micro-batch here at this step
        self.closing = False  # the step's gradient is being averaged: no more work for this step
        self.paused = False  # the volunteer paused: no new micro-batches
        self.leaving = False  # draining before a move: backwards of forwards served here only
        self.state_hash = self.param_hash = ""
        self.hashed_step = 0  # the step ``state_hash`` and ``param_hash`` are of
        self.samples_per_s = 0.0
        self.busy_s = 0.0
        self.stats = {"forwards": 0, "backwards": 0, "repeats": 0, "refused": 0, "dropped": 0}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage{index}")

    @property
    def is_first(self) -> bool:
        return self.spec.embed

    @property
    def is_last(self) -> bool:
        return self.spec.head

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- hashes, throughput --------------------------------------------------------------------------

    def _hashes(self) -> tuple[int, str, str]:
        return (
            self.step,
            state_hash(self.step, state_tensors(self.model, self.optimizer)),
            params_hash(self.model),
        )

    async def commit(self) -> None:
        """Hash the state: ``hashed_step`` and the hashes change together, so a record never pairs a new
        step with the old state's hash."""
        self.hashed_step, self.state_hash, self.param_hash = await self.compute(self._hashes)

    def _rate(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-6)
        self.samples_per_s = rate if not self.samples_per_s else 0.8 * self.samples_per_s + 0.2 * rate

    def _measure(self) -> None:
        """One forward and backward of a full micro-batch of random data: this replica's measured speed."""
        shape = (self.max_batch, self.seq_len)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB_SIZE, shape, generator=generator)
        started = time.monotonic()
        x = ids if self.is_first else torch.randn(*shape, self.d_model, generator=generator).requires_grad_()
        out = self.model(x)
        out.float().square().mean().backward()
        self.optimizer.zero_grad(set_to_none=True)
        self._rate(self.max_batch, time.monotonic() - started)

    async def measure(self) -> float:
        await self.compute(self._measure)
        return self.samples_per_s

    # --- requests ------------------------------------------------------------------------------------

    def _refuse(self, code: int, message: str) -> Refusal:
        self.stats["refused"] += 1
        return Refusal(code, message, self.step)

    def _check_request(self, run_id: str, stage: int, step: int, inference: bool, held: bool = False) -> None:
        """``held``: a backward of a forward this replica holds, which a closing step still takes: the
        later stages counted that micro-batch at this step already, so refusing it here would leave
        their rounds holding samples this stage's round lacks."""
        if run_id != self.run.run_id:
            raise self._refuse(ppb.BAD_REQUEST, f"this server serves run {self.run.run_id!r}, not {run_id!r}")
        if stage != self.index:
            raise self._refuse(ppb.BAD_REQUEST, f"this server serves stage {self.index}, not stage {stage}")
        if step != self.step:
            raise self._refuse(ppb.WRONG_STEP, f"this server is at step {self.step}, not {step}")
        if self.closing and not inference and not held:
            raise self._refuse(ppb.BUSY, f"step {self.step} is closed: its gradients are being averaged")
        if self.paused:
            raise self._refuse(ppb.BUSY, "this server is paused by its volunteer")

    def _inputs(self, request: ppb.ForwardRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length = (1, self.max_batch), (1, self.seq_len)
        if self.is_first:
            inputs = decode_ids(request.inputs, [batch, length], what="inputs (token IDs)")
        else:
            inputs = decode_floats(
                request.inputs, self.codec, [batch, length, self.d_model], what="inputs (activations)"
            )
        targets = None
        if self.is_last and not (request.inference and not request.HasField("targets")):
            if not request.HasField("targets"):
                raise ProtocolError("the last stage needs targets to compute the loss")
            targets = decode_ids(request.targets, list(inputs.shape[:2]), what="targets")
        elif request.HasField("targets"):
            raise ProtocolError(
                f"targets go to the last stage ({self.num_stages - 1}), not stage {self.index}"
            )
        return inputs, targets

    def awaiting_backward(self) -> int:
        """Micro-batches run forward here at this step whose backward has not come (expired ones
        dropped); runs on the worker thread."""
        self._purge(time.monotonic())
        return sum(1 for f in self.forwards.values() if f.result is None)

    def _purge(self, now: float) -> None:
        ttl = self.run.pipeline.forward_state_ttl_s
        for key in [k for k, f in self.forwards.items() if f.result is None and now - f.created > ttl]:
            del self.forwards[key]

    def _check_attempt(self, caller: str, request: ppb.ForwardRequest | ppb.BackwardRequest) -> None:
        try:
            check_attempt(self.run.run_id, self.index, request.step, caller, request.microbatch_id,
                          request.attempt, request.attempt_signature)  # fmt: skip
        except ProtocolError as e:
            raise self._refuse(ppb.BAD_REQUEST, str(e)) from None

    def forward(self, request: ppb.ForwardRequest, caller: str = "") -> ppb.ForwardReply:
        """Serve a forward (on the last stage: forward, loss and backward) to ``caller``, the peer ID the
        transport authenticated; runs on the worker thread."""
        self._check_request(request.run_id, request.stage, request.step, request.inference)
        try:
            inputs, targets = self._inputs(request)
        except ProtocolError as e:
            raise self._refuse(ppb.BAD_REQUEST, str(e)) from None
        if request.inference:
            return self._infer(inputs, targets)
        self._check_attempt(caller, request)
        key = (caller, request.microbatch_id)
        known = self.forwards.get(key)
        if known is not None and known.result is not None:
            self.stats["repeats"] += 1  # a retried micro-batch: same answer, counted once
            self._claim(key, request.attempt, request.attempt_signature)
            if self.is_last:  # the repeat answers exactly what the forward answered (a check compares them)
                return ppb.ForwardReply(step=self.step, grad_inputs=known.result, loss=known.loss)
            return ppb.ForwardReply(step=self.step, outputs=known.reply)
        now = time.monotonic()
        self._purge(now)
        if self.leaving:
            raise self._refuse(
                ppb.BUSY, f"this server is leaving stage {self.index}: it takes no new micro-batch"
            )
        if caller not in self.served and len(self.served) >= self.max_trainers:
            raise self._refuse(
                ppb.BUSY, f"this server serves {len(self.served)} trainers at step {self.step}, its limit"
            )
        make_room(self.forwards, key, self.forwards_per_caller)  # one caller never fills the states
        if len(self.forwards) >= MAX_FORWARD_STATES and key not in self.forwards:
            raise self._refuse(
                ppb.BUSY, f"{len(self.forwards)} micro-batches are waiting for their backward here"
            )
        started = time.monotonic()
        leaf = None if self.is_first else inputs.to(self.device).requires_grad_()
        self.model.train()
        x = inputs.to(self.device) if leaf is None else leaf
        self.stats["forwards"] += 1
        self.served.add(caller)
        rng = torch.get_rng_state()
        if self.is_last:
            loss = self.model.loss(x, targets.to(self.device))
            (loss * inputs.shape[0]).backward()  # gradient of the sum; divided by the count when averaged
            entry = HeldForward(leaf, None, inputs.shape[0], now, 0.0, loss=float(loss.detach()))
            entry.request, entry.rng, entry.signature = request, rng, request.attempt_signature
            entry.result = self._grad_reply(leaf)
            self._count(key, entry, time.monotonic() - started, request.attempt, None)
            return ppb.ForwardReply(step=self.step, grad_inputs=entry.result, loss=entry.loss)
        outputs = self.model(x)
        entry = HeldForward(leaf, outputs, inputs.shape[0], now, time.monotonic() - started)
        entry.request, entry.rng, entry.signature = request, rng, request.attempt_signature
        entry.reply = encode_floats(outputs.detach(), self.codec)
        self.forwards[key] = entry
        return ppb.ForwardReply(step=self.step, outputs=entry.reply)

    def _infer(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> ppb.ForwardReply:
        self.model.eval()
        with torch.no_grad():
            outputs = self.model(inputs.to(self.device))
            if self.is_last and targets is not None:
                loss = F.cross_entropy(outputs.reshape(-1, VOCAB_SIZE), targets.to(self.device).reshape(-1))
                return ppb.ForwardReply(step=self.step, loss=float(loss))
        return ppb.ForwardReply(step=self.step, outputs=encode_floats(outputs, self.codec))

    def _grad_reply(self, leaf: torch.Tensor | None) -> ppb.Tensor:
        if leaf is None or leaf.grad is None:
            return ppb.Tensor()
        return encode_floats(leaf.grad, self.codec)

    def _bank(self, trainer: str, samples: int) -> None:
        """Move the gradient one micro-batch left in the parameters into ``trainer``'s running sum."""
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float().cpu()
            for p in self.params
        ])  # fmt: skip
        held = self.by_trainer.get(trainer)
        self.by_trainer[trainer] = flat if held is None else held.add_(flat)
        self.trainer_samples[trainer] += samples
        self.optimizer.zero_grad(set_to_none=True)

    def _count(
        self, key: Key, entry: HeldForward, seconds: float, attempt: int, grad_outputs: ppb.Tensor | None
    ) -> None:
        self._bank(key[0], entry.samples)
        entry.inputs = entry.outputs = None  # the graph is spent; keep only the answer
        entry.compute_s += seconds
        self.forwards[key] = entry
        self.claims[key] = max(attempt, 1)  # 0: a trainer that does not number its attempts
        self._replay[key] = (entry, grad_outputs)
        self.samples += entry.samples
        self.busy_s += entry.compute_s
        self._rate(entry.samples, entry.compute_s)

    def backward(self, request: ppb.BackwardRequest, caller: str = "") -> ppb.BackwardReply:
        """Backward of a micro-batch ``caller`` ran forward here at this step; runs on the worker thread."""
        key = (caller, request.microbatch_id)
        held = key in self.forwards
        self._check_request(request.run_id, request.stage, request.step, inference=False, held=held)
        if self.is_last:
            raise self._refuse(ppb.BAD_REQUEST, "the last stage runs its backward with the forward")
        self._check_attempt(caller, request)
        entry = self.forwards.get(key)
        if entry is None:
            raise self._refuse(
                ppb.UNKNOWN_MICROBATCH,
                f"no forward of micro-batch {request.microbatch_id} at step {self.step} here (expired or never sent)",
            )
        if entry.result is not None:
            self.stats["repeats"] += 1
            self._claim(key, request.attempt, request.attempt_signature)
            return ppb.BackwardReply(step=self.step, grad_inputs=entry.result)
        try:
            grad = decode_floats(
                request.grad_outputs, self.codec, list(entry.outputs.shape), what="grad_outputs (gradients)"
            )
        except ProtocolError as e:
            raise self._refuse(ppb.BAD_REQUEST, str(e)) from None
        norm, bound = float(grad.norm()), self.run.pipeline.max_grad_output_norm
        if not norm <= bound:
            raise self._refuse(
                ppb.BAD_REQUEST,
                f"grad_outputs (gradients) has L2 norm {norm:.4g}, over the run's bound {bound:.4g}",
            )
        started = time.monotonic()
        torch.autograd.backward(entry.outputs, grad.to(self.device, entry.outputs.dtype))
        self.stats["backwards"] += 1
        entry.result = self._grad_reply(entry.inputs)
        if request.attempt > max(entry.request.attempt, 1):
            entry.signature = request.attempt_signature
        self._count(key, entry, time.monotonic() - started, request.attempt, request.grad_outputs)
        return ppb.BackwardReply(step=self.step, grad_inputs=entry.result)

    def _claim(self, key: Key, attempt: int, signature: bytes) -> None:
        if key in self.claims and attempt > self.claims[key]:
            self.claims[key] = attempt
            self.forwards[key].signature = signature

    def retried(self) -> list[tuple[str, int, int, bytes]]:
        """The micro-batches counted here at this step on a retry: (trainer, ID, latest attempt, the
        trainer's signature of it), what the other replicas of the stage need to drop the copies an
        earlier attempt left with them."""
        claims = sorted((a, k) for k, a in list(self.claims.items()) if a > 1)[-MAX_RETRIED_CLAIMS:]
        return sorted((k[0], k[1], a, self.forwards[k].signature) for a, k in claims)

    def superseding(self, claims: list[tuple[str, int, int, bytes]]) -> dict[Key, int]:
        """Of ``claims`` (another replica's ``retried``), those signed by the micro-batch's own trainer
        for this stage and step: micro-batch -> the latest such attempt. The rest are ignored."""
        latest: dict[Key, int] = {}
        for trainer, microbatch_id, attempt, signature in claims:
            try:
                check_attempt(
                    self.run.run_id, self.index, self.step, trainer, microbatch_id, attempt, signature
                )
            except ProtocolError:
                continue
            key = (trainer, microbatch_id)
            latest[key] = max(latest.get(key, 0), attempt)
        return latest

    def drop_superseded(self, latest: dict[Key, int]) -> int:
        """Drop the micro-batches that reached another replica of the stage on a later attempt (``latest``:
        micro-batch -> the latest attempt any other replica holds, from ``superseding``) and rebuild the sums
        of their trainers from the rest of theirs, replayed in counting order; returns the samples dropped."""
        gone = {k for k, a in self.claims.items() if latest.get(k, 0) > a}
        if not gone:
            return 0
        # Sums are per trainer: only the trainers that lost a micro-batch are rebuilt, from their own. Each
        # drop used to replay every trainer's micro-batches, so one trainer's signed retry of its own
        # micro-batch at another replica made this one compute the whole step's backward again.
        trainers = {k[0] for k in gone}
        self.optimizer.zero_grad(set_to_none=True)
        for trainer in trainers:
            self.by_trainer.pop(trainer, None)
            self.samples -= self.trainer_samples.pop(trainer, 0)
        dropped = 0
        for key, (entry, grad_outputs) in list(self._replay.items()):
            if key[0] not in trainers:
                continue
            if key in gone:
                del self._replay[key], self.claims[key], self.forwards[key]
                dropped += entry.samples
                continue
            self._recompute(entry, grad_outputs)
            self._bank(key[0], entry.samples)
            self.samples += entry.samples
        self.stats["dropped"] += len(gone)
        return dropped

    def _recompute(self, entry: HeldForward, grad_outputs: ppb.Tensor | None) -> None:
        """The gradient of one counted micro-batch again, exactly as it was computed when counted."""
        inputs, targets = self._inputs(entry.request)
        x = inputs.to(self.device) if self.is_first else inputs.to(self.device).requires_grad_()
        rng = torch.get_rng_state()
        torch.set_rng_state(entry.rng)
        try:
            self.model.train()
            if self.is_last:
                (self.model.loss(x, targets.to(self.device)) * inputs.shape[0]).backward()
                return
            outputs = self.model(x)
            grad = decode_floats(
                grad_outputs, self.codec, list(outputs.shape), what="grad_outputs (gradients)"
            )
            torch.autograd.backward(outputs, grad.to(self.device, outputs.dtype))
        finally:
            torch.set_rng_state(rng)

    def drained(self) -> bool:
        """Nothing of this step is held here: no counted sample and no forward waiting for its backward
        (a forward whose trainer went elsewhere is dropped after ``forward_state_ttl_s``)."""
        self._purge(time.monotonic())
        return self.samples == 0 and all(f.result is not None for f in self.forwards.values())

    # --- the step ------------------------------------------------------------------------------------

    def mean_gradient(self) -> torch.Tensor:
        """The trainers' mean gradients at this step under the run's robust rule (flat, CPU float32)."""
        trainers = sorted(self.by_trainer)
        self.outliers = []
        if not trainers:
            return torch.zeros(self.numel)
        means = torch.stack([self.by_trainer[t] / max(self.trainer_samples[t], 1) for t in trainers])
        if len(trainers) == 1:
            return means[0]
        weights = torch.tensor([float(self.trainer_samples[t]) for t in trainers], dtype=torch.float64)
        result = self.aggregate(means, weights, seed=self.step)
        if len(trainers) >= 3:
            distances = (means - result).norm(dim=1).tolist()
            typical = statistics.median(distances)
            self.outliers = [
                t for t, d in zip(trainers, distances, strict=True) if d > OUTLIER_FACTOR * typical
            ]
        return result

    def apply(self, averaged: torch.Tensor) -> None:
        """Apply the stage's averaged gradient, exactly as every other replica of the stage does."""
        apply_flat_gradient(self.model, self.params, self.optimizer, self.run.optimizer, self.step, averaged)
        self.step += 1
        self.reset()

    def reset(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.by_trainer.clear()
        self.trainer_samples.clear()
        self.samples = 0
        self.claims.clear()
        self._replay.clear()
        self.forwards.clear()
        self.served.clear()
        self.closing = False

    def load(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        load_state_tensors(self.model, self.optimizer, tensors)
        self.step = step
        self.reset()
