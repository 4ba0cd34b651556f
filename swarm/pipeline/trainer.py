"""A pipeline trainer: streams micro-batches through one server per stage, forward then backward.

For each micro-batch (its ID is the sampling seed of run, trainer, step and index, so anyone can
recompute its data) the trainer picks one replica per stage at random, weighted by the throughput it
measured of each (capped at twice the stage's median; stochastic wiring), sends the activations forward
stage by stage, lets the last stage compute the loss and its backward, and sends the gradients back
stage by stage. A refusal, an error or a timeout at any
stage retries the whole micro-batch from the first stage, avoiding the server that failed; stages whose
backward already counted the micro-batch are asked again (they answer without counting it twice). A
micro-batch counts once, when the first stage's backward completes. Nothing is dropped: a micro-batch
that the run outran is issued again at the new step with the same ID.

The trainers together stop at the target batch of a step; the stage servers then average and step, and
the trainers follow. ``microbatches_lost`` counts micro-batches issued that neither completed nor wait
to be issued again; ``microbatches_waiting`` those that wait (at the end of a run: outrun by its last
step, which needed no more samples, so there is no later step to issue them at).

Example::

    trainer = PipelineTrainer(run, dht, peer_id=key.peer_id)
    await trainer.run(stop_event)
    print(trainer.metrics()["microbatches_lost"])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import hivemind
from hivemind.p2p import PeerID

from protocols import pipeline_pb2 as ppb
from protocols.errors import ConfigError, ProtocolError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import MAX_ATTEMPT
from swarm.averaging.compression import get_codec
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.data import build_dataset, derive_seed
from swarm.models import model_config
from swarm.pipeline.balance import Avoidance, Measured, pick_server
from swarm.pipeline.check import StageCall, StageCheck
from swarm.pipeline.hooks import PipelineHooks
from swarm.pipeline.records import PipelineView, TrainerRecord, fetch_view, publish_record
from swarm.pipeline.server import StageServicer, pipeline_namespace
from swarm.pipeline.verify import check_reply
from swarm.pipeline.wire import encode_ids, sign_attempt
from swarm.records import RecordSigner, RecordTrust

logger = logging.getLogger(__name__)

CODE_NAMES = {v: k for k, v in ppb.Code.items()}


class StageFailure(Exception):
    """A stage server refused or failed a micro-batch; ``code`` says why, ``server_step`` where it is."""

    def __init__(self, stage: int, peer: str, code: int, message: str, server_step: int | None = None):
        super().__init__(f"stage {stage} server {peer[-8:]}: {CODE_NAMES.get(code, code)}: {message}")
        self.stage, self.peer, self.code, self.server_step = stage, peer, code, server_step


@dataclass
class MicroBatch:
    """A micro-batch a pipeline trainer sends through the stages, and where it was counted (for retries)."""

    id: int
    step: int  # the step it is (re)issued at
    inputs: object
    targets: object
    attempts: int = 0
    # Stages whose server counted this micro-batch at ``step``: retries go back to them.
    counted_by: dict[int, str] = field(default_factory=dict)
    trace: dict[int, StageCall] = field(default_factory=dict)  # the last attempt's calls, for a check


class PipelineTrainer:
    """A peer that streams micro-batches through one server per stage, forward then backward, with retries.

    Args:
        run: the run's config; ``run.pipeline`` gives the stages and the request timeouts.
        dht: the running DHT this peer is a member of.
        peer_id: this peer's ID (base58); it seeds the micro-batches' data.
        seed: seeds the choice of servers (default: derived from ``peer_id``).
        signing_key: the key of ``peer_id``, which signs this trainer's DHT records.
        record_signer: signs them with the peer's certificate instead (the volunteer passes its own).
        coordinator_key: the coordinator's key; when set, only stage records of certified peers count.
        hooks: what the trainer announces and sends (``swarm.pipeline.hooks``); None: honestly.
        accuse: files the evidence of a stage replica's wrong answer with the coordinator.
    """

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        seed: int | None = None,
        signing_key: SigningKey | None = None,
        record_signer: RecordSigner | None = None,
        coordinator_key: PublicKey | None = None,
        hooks: PipelineHooks | None = None,
        accuse: Accuser | None = None,
    ):
        if record_signer is None and signing_key is None:
            raise ConfigError(
                "a pipeline trainer signs its DHT records: pass signing_key (the key of its peer ID)"
            )
        self.config, self.dht, self.peer_id = run, dht, peer_id
        self.hooks = hooks if hooks is not None else PipelineHooks()
        self.records = record_signer or RecordSigner(signing_key)
        # Stage records count only when signed by a certified peer (any signer, in a run with no coordinator).
        self.trust = RecordTrust(run.run_id, coordinator_key)
        self.num_stages = run.pipeline.stages
        self.dataset = build_dataset(run.dataset.name, run.dataset.config)
        self.seq_len = int(model_config(run.model.name, run.model.config).seq_len)
        self.batch = run.training.micro_batch_size
        self.rng = random.Random(seed if seed is not None else hash(peer_id))
        self.p2p = None
        self.view = PipelineView()
        self.step = 0
        self.samples = 0  # completed at this step
        self.micro = 0
        self.in_flight: set[int] = set()
        self._starting: set[int] = set()  # handed to a task that has not run yet
        self.pending: deque[MicroBatch] = deque()
        self.issued: set[int] = set()
        self.completed: set[int] = set()
        self.completed_at: Counter[int] = Counter()  # step -> samples of micro-batches completed there
        pipeline = run.pipeline
        self.avoid = Avoidance(pipeline.failed_server_cooldown_s, busy_s=pipeline.announce_interval_s)
        self.measured = Measured()  # what this trainer timed of each replica: its only routing input
        self.finished = False
        self.paused = False  # set by pause(): no new micro-batches; those in flight complete
        self.first_validation: tuple[int, float] | None = None
        self._views = 0
        self._started = time.monotonic()
        self._samples_total = 0
        self._stats = {"train_loss": math.nan, "val_loss": math.nan, "val_step": -1.0, "retries": 0.0,
                       "failures": 0.0, "compute_wait_s": 0.0}  # fmt: skip
        self._failures_by_code: dict[str, int] = {}
        self.check = StageCheck(run, self.records.key, get_codec(run.training.compression), call=self._call,
                                choose=self._choose_other, accuse=accuse)  # fmt: skip
        # Answers are checked before they go on to another stage: relayed unchecked, a malformed or
        # over-bound answer was refused there as this trainer's bad request, and got it banned there.
        # The same check files a failing one (``StageCheck.file_bad_answer``).
        self.answers = self.check.answers

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    @property
    def param_hash(self) -> str:
        return ""  # a trainer holds no parameters

    def witnessed(self) -> list[list[bytes]]:
        """No data-parallel rounds here: pipeline roles are credited by what they report (bounded)."""
        return []

    def suspected(self, limit: int) -> list[str]:
        return []  # a trainer averages with nobody; servers that fail it are avoided per call instead

    def metrics(self) -> dict[str, float]:
        wall = max(time.monotonic() - self._started, 1e-9)
        waiting = self.waiting()
        lost = len(self.issued - self.completed - waiting)
        return {
            **self._stats, "step": float(self.step), "samples": float(self.samples),
            "samples_per_s": self._samples_total / wall, "microbatches_issued": float(len(self.issued)),
            "microbatches_completed": float(len(self.completed)), "microbatches_lost": float(lost),
            "microbatches_waiting": float(len(waiting)),
            "stage_checks": float(self.check.stats["checks"]),
            "stage_mismatches": float(self.check.stats["mismatches"]),
            "stage_bad_answers": float(self.check.stats["bad_answers"]),
            "finished": float(self.finished),
            "val_loss_initial": self.first_validation[1] if self.first_validation else math.nan,
            "val_step_initial": float(self.first_validation[0]) if self.first_validation else math.nan,
        }  # fmt: skip

    # --- DHT -----------------------------------------------------------------------------------------

    def _record(self) -> TrainerRecord:
        record = TrainerRecord(self.peer_id, self.step, self.samples, len(self.in_flight), time.time())
        return self.hooks.announce(record)  # a rehearsed liar's rewrite

    async def _publish(self) -> None:
        ttl_s = max(3.0, 6 * self.config.pipeline.announce_interval_s)
        await publish_record(self.dht, self.records, self.config.run_id, self._record(), ttl_s=ttl_s)

    async def _announce_forever(self) -> None:
        while True:
            try:
                await self._publish()
                self.view = await fetch_view(self.dht, self.trust, self.num_stages)
                self._views += 1
            except Exception as e:
                logger.debug(f"pipeline announce failed: {e!r}")
            await asyncio.sleep(self.config.pipeline.announce_interval_s)

    def _samples_at_step(self) -> int:
        others = sum(
            t.samples for t in self.view.trainers if t.step == self.step and t.peer_id != self.peer_id
        )
        return others + self.samples

    # --- calls ---------------------------------------------------------------------------------------

    def _choose(self, stage: int, step: int) -> str | None:
        record = pick_server(
            self.view.replicas(stage, step), self.rng, avoid=self.avoid.current(), measured=self.measured
        )
        return record.peer_id if record else None

    def _choose_other(self, stage: int, step: int, peer: str) -> str | None:
        """A second replica of ``stage`` at ``step`` to check ``peer``'s answer against."""
        others = [r for r in self.view.replicas(stage, step) if r.peer_id != peer]
        record = pick_server(others, self.rng, avoid=self.avoid.current(), measured=self.measured)
        return record.peer_id if record else None

    async def _call(self, stage: int, peer: str, method: str, request, forward=None):
        """One call; its reply must be signed by ``peer`` (``forward``: a backward's forward request)."""
        stub = StageServicer.get_stub(
            self.p2p, PeerID.from_base58(peer), namespace=pipeline_namespace(self.config.run_id, stage)
        )
        timeout = self.config.pipeline.request_timeout_s
        started = time.monotonic()
        try:
            reply = await getattr(stub, method)(request, timeout=timeout)
        except asyncio.TimeoutError:
            raise StageFailure(stage, peer, -1, f"no answer within {timeout:.1f}s") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # libp2p errors share no base class
            raise StageFailure(stage, peer, -1, f"call failed: {e!r}"[:300]) from None
        if reply.code != ppb.OK:
            raise StageFailure(stage, peer, reply.code, reply.error[:500], reply.step)
        sent = (request, None) if forward is None else (forward, request)
        try:
            check_reply(peer, self.config.run_id, stage, self.peer_id, reply, *sent)
        except ProtocolError as e:
            raise StageFailure(stage, peer, ppb.BAD_REQUEST, f"refused: {e}"[:500]) from None
        # Checked before it goes on to another stage; signed, a failing answer is evidence against its signer.
        fault = self.answers.fault(stage, reply, *sent)
        if fault is not None:
            self.check.file_bad_answer(stage, peer, *sent, reply)
            raise StageFailure(
                stage, peer, ppb.BAD_REQUEST, f"refused: stage {stage} replica {peer}: {fault}"[:500]
            )
        self.measured.record(peer, self.batch, time.monotonic() - started)
        return reply

    async def _attempt(self, mb: MicroBatch) -> float:
        route = []
        for stage in range(self.num_stages):
            peer = mb.counted_by.get(stage) or self._choose(stage, mb.step)
            if peer is None:
                raise StageFailure(stage, "-", ppb.BUSY, f"no replica of stage {stage} serves step {mb.step}")
            route.append(peer)
        # The attempt number lets the stage's replicas keep only the latest copy of a retried micro-batch;
        # signed, so that only this trainer can retire a copy of its micro-batch.
        attempt = min(mb.attempts + 1, MAX_ATTEMPT)
        base = dict(run_id=self.config.run_id, step=mb.step, microbatch_id=mb.id, attempt=attempt)
        signed = {
            stage: sign_attempt(self.records.key, self.config.run_id, stage, mb.step, mb.id, attempt)
            if attempt > 1 else b""
            for stage in range(self.num_stages)
        }  # fmt: skip
        hidden = encode_ids(mb.inputs)
        last = self.num_stages - 1
        mb.trace = {}
        for stage in range(last):
            request = ppb.ForwardRequest(stage=stage, inputs=hidden, attempt_signature=signed[stage], **base)
            reply = await self._call(stage, route[stage], "rpc_forward", request)
            mb.trace[stage] = StageCall(route[stage], request, reply)
            hidden = reply.outputs
        request = ppb.ForwardRequest(stage=last, inputs=hidden, targets=encode_ids(mb.targets),
                                     attempt_signature=signed[last], **base)  # fmt: skip
        if self.hooks.front_runs:
            await self._front_run(last, route[last], request)
        reply = await self._call(last, route[last], "rpc_forward", request)
        mb.trace[last] = StageCall(route[last], request, reply)
        mb.counted_by[last] = route[last]
        loss, grad = reply.loss, reply.grad_inputs
        for stage in range(last - 1, -1, -1):
            request = ppb.BackwardRequest(
                stage=stage, grad_outputs=grad, attempt_signature=signed[stage], **base
            )
            forward = mb.trace[stage].forward
            reply = await self._call(stage, route[stage], "rpc_backward", request, forward=forward)
            mb.trace[stage].backward, mb.trace[stage].backward_reply = request, reply
            mb.counted_by[stage] = route[stage]
            grad = reply.grad_inputs
        mb.attempts = attempt  # a check of this micro-batch is its next attempt
        return loss

    async def _front_run(self, stage: int, peer: str, request: ppb.ForwardRequest) -> None:
        """A rehearsed attacker's requests ahead of its own, under the other trainers' public IDs."""
        victims = [
            k
            for t, k in self.view.public_microbatches(self.config.run_id, request.step, self.micro)
            if t != self.peer_id
        ]
        for stolen in self.hooks.front_run(request, victims):
            with contextlib.suppress(StageFailure):
                await self._call(stage, peer, "rpc_forward", stolen)

    def waiting(self) -> set[int]:
        """IDs of the micro-batches issued and not completed that are still to be run: in flight, about to
        be, or waiting to be issued again at the next step."""
        return {mb.id for mb in self.pending} | self.in_flight | self._starting

    async def _process(self, mb: MicroBatch) -> None:
        """Run ``mb`` until it completes, the run moves past its step (it is then issued again), or stop."""
        self._starting.discard(mb.id)
        self.in_flight.add(mb.id)
        try:
            while mb.step == self.step and self.view.run_step(self.num_stages) <= mb.step:
                try:
                    loss = await self._attempt(mb)
                except StageFailure as f:
                    mb.attempts += 1
                    self._stats["failures"] += 1
                    name = CODE_NAMES.get(f.code, "NETWORK")
                    self._failures_by_code[name] = self._failures_by_code.get(name, 0) + 1
                    if f.code == ppb.WRONG_STEP and f.server_step is not None and f.server_step > mb.step:
                        if self.avoid.refused_ahead(f.peer, self._views):
                            logger.warning(f"stage {f.stage} replica {f.peer} keeps refusing step {mb.step} as "
                                           "past while its record serves it; avoiding it")  # fmt: skip
                        await self._wait_for_views(1)
                        continue  # the run is moving on; the loop re-checks the step
                    if f.code == ppb.BUSY and f.peer != "-":
                        self.avoid.busy(f.peer)  # for a moment: the next pick goes elsewhere if it can
                    if f.code in (
                        -1,
                        ppb.BAD_REQUEST,
                        ppb.INTERNAL,
                        ppb.WRONG_STEP,
                        ppb.UNKNOWN_PEER,
                        ppb.BANNED,
                    ):
                        self.avoid.failed(f.peer)
                        if mb.counted_by.get(f.stage) == f.peer:
                            del mb.counted_by[f.stage]  # that replica is gone; its count went with it
                        if f.code == ppb.BAD_REQUEST and f.stage > 0:
                            # The request carried the previous stage's output: that server may be at fault.
                            logger.warning(f"micro-batch {mb.id}: {f}")
                    level = logging.INFO if mb.attempts < 3 else logging.WARNING
                    logger.log(level, f"micro-batch {mb.id} attempt {mb.attempts} failed ({f}); retrying")
                    self._stats["retries"] += 1
                    if mb.attempts % self.config.pipeline.max_attempts == 0:
                        logger.warning(
                            f"micro-batch {mb.id}: {mb.attempts} attempts failed; waiting for the view to change"
                        )
                        await self._wait_for_views(2)
                    else:
                        await asyncio.sleep(min(0.05 * mb.attempts, 1.0))
                    continue
                await self.check.maybe_check(mb.step, mb.attempts, mb.trace)
                self.completed.add(mb.id)
                self.completed_at[mb.step] += self.batch
                self.samples += self.batch
                self._samples_total += self.batch
                previous = self._stats["train_loss"]
                self._stats["train_loss"] = loss if math.isnan(previous) else 0.9 * previous + 0.1 * loss
                return
            mb.counted_by = {}
            self.pending.append(mb)  # outrun by the run: issue it again at the new step, same ID
        finally:
            self.in_flight.discard(mb.id)

    async def _wait_for_views(self, count: int) -> None:
        target = self._views + count
        deadline = time.monotonic() + 10 * self.config.pipeline.announce_interval_s * count + 5
        while self._views < target and time.monotonic() < deadline:
            await asyncio.sleep(self.config.pipeline.announce_interval_s / 4)

    # --- validation ----------------------------------------------------------------------------------

    async def validate(self) -> float:
        """Mean loss on the fixed validation batches, forwarded through the stages (no state kept)."""
        batches = await asyncio.to_thread(
            self.dataset.validation_batches, self.batch, self.seq_len, self.config.training.validation_batches
        )
        losses = []
        # One drawn batch of each validation is checked at a second replica of one stage: a replica that
        # answers only inference calls wrongly would move every trainer's validation loss unseen.
        checked = self.check.rng.randrange(len(batches)) if batches and self.check.drawn_validation() else -1
        for index, (inputs, targets) in enumerate(batches):
            for attempt in range(self.config.pipeline.max_attempts):
                try:
                    losses.append(await self._infer(inputs, targets, check=index == checked))
                    break
                except StageFailure as f:
                    logger.info(f"validation attempt {attempt + 1} failed ({f}); retrying")
                    await self._wait_for_views(1)
            else:
                return math.nan
        loss = sum(losses) / len(losses)
        self._stats["val_loss"], self._stats["val_step"] = loss, float(self.step)
        if self.first_validation is None:
            self.first_validation = (self.step, loss)
        logger.info(f"step {self.step}: validation loss {loss:.4f}")
        return loss

    async def _infer(self, inputs, targets, *, check: bool = False) -> float:
        hidden = encode_ids(inputs)
        trace: dict[int, StageCall] = {}
        for stage in range(self.num_stages):
            peer = self._choose(stage, self.step)
            if peer is None:
                raise StageFailure(
                    stage, "-", ppb.BUSY, f"no replica of stage {stage} serves step {self.step}"
                )
            request = ppb.ForwardRequest(
                run_id=self.config.run_id, stage=stage, step=self.step, inputs=hidden, inference=True
            )
            if stage == self.num_stages - 1:
                request.targets.CopyFrom(encode_ids(targets))
            reply = await self._call(stage, peer, "rpc_forward", request)
            trace[stage] = StageCall(peer, request, reply)
            hidden = reply.outputs
        await self.check.maybe_check(self.step, 0, trace, drawn=check)
        return reply.loss

    # --- the loop ------------------------------------------------------------------------------------

    def _reached_max(self) -> bool:
        max_steps = self.config.training.max_steps
        return max_steps is not None and self.step >= max_steps

    def _new_microbatch(self) -> MicroBatch:
        seed = derive_seed(self.config.run_id, self.peer_id, self.step, self.micro)
        self.micro += 1
        inputs, targets = self.dataset.sample_batch(seed, self.batch, self.seq_len)
        self.issued.add(seed)
        return MicroBatch(seed, self.step, inputs, targets)

    async def _advance(self, step: int) -> None:
        logger.info(f"the stages are at step {step}; trainer moves from step {self.step}")
        self.step, self.samples, self.micro = step, 0, 0
        with contextlib.suppress(Exception):
            await self._publish()
        every = self.config.training.validation_every_steps
        if step % every == 0 or self._reached_max():
            await self.validate()

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set or the run reaches ``max_steps``."""
        self.p2p = await self.dht.replicate_p2p()
        announcer = asyncio.create_task(self._announce_forever())
        tasks: set[asyncio.Task] = set()
        try:
            while not stop.is_set() and not all(self.view.replicas(k) for k in range(self.num_stages)):
                await asyncio.sleep(self.config.pipeline.announce_interval_s)  # every stage needs a server
            if stop.is_set():
                return
            self.step = self.view.run_step(self.num_stages)
            await self.validate()
            target = self.config.training.target_batch_size
            limit = self.config.pipeline.max_inflight_microbatches
            self._started = time.monotonic()
            while not stop.is_set() and not self._reached_max():
                run_step = self.view.run_step(self.num_stages)
                if run_step > self.step and not tasks:
                    await self._advance(run_step)
                    continue
                wanted = self._samples_at_step() + len(self.in_flight) * self.batch < target
                if (
                    len(tasks) < limit
                    and run_step == self.step
                    and (self.pending or wanted)
                    and not self.paused
                ):
                    mb = self.pending.popleft() if self.pending else self._new_microbatch()
                    mb.step = self.step
                    # Until its task first runs it is in neither ``pending`` nor ``in_flight``: a count of
                    # lost micro-batches taken then (``waiting``) must not see it lost.
                    self._starting.add(mb.id)
                    tasks.add(asyncio.create_task(self._process(mb)))
                    continue
                if tasks:
                    done, tasks = await asyncio.wait(tasks, timeout=self.config.pipeline.announce_interval_s / 2,
                                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                    for task in done:
                        task.result()
                else:
                    await asyncio.sleep(self.config.pipeline.announce_interval_s / 4)
            self.finished = self._reached_max()
            if self.finished:
                counts = self.metrics()
                logger.info(f"reached step {self.step}: {len(self.completed)} micro-batches completed, "
                            f"{counts['microbatches_waiting']:.0f} left over (the last step needed no more), "
                            f"{counts['microbatches_lost']:.0f} lost")  # fmt: skip
                with contextlib.suppress(Exception):
                    await self._publish()
                await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            announcer.cancel()
