"""The volunteer process: join the run, enter its DHT, heartbeat, and leave cleanly.

Losing the coordinator does not end the peer's part in the run: it keeps its DHT membership, retries
with exponential backoff and says so, re-joins if the coordinator has forgotten it, and re-enters the
coordinator's DHT node if it restarted. Only a ban, a stop signal or the end of the run ends it (the
coordinator's signed heartbeat answer says when the run finished, and raises ``max_steps``); a stop
signal or the run's end first tells the coordinator the peer left.

Example::

    stop = asyncio.Event()
    exit_code = await Volunteer(PeerConfig(coordinator="127.0.0.1:31330", device="cpu")).run(stop)
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import contextlib
import logging
import math
import os
import time

from peer.config import PeerConfig
from peer.control import PeerControl
from peer.device import describe_device, resolve_device
from peer.limits import apply_gpu_memory_limit, upload_limiter
from peer.panel import Panel
from peer.reachability import learn_dialable
from peer.trust import KnownCoordinators, key_mismatch_fix
from protocols.certificates import PeerCertificate
from protocols.errors import (
    AdmissionDenied,
    Banned,
    ConfigError,
    CoordinatorKeyMismatch,
    NetworkError,
    ProtocolError,
    ReplayError,
    SecurityError,
    SwarmError,
)
from protocols.keys import PublicKey, SigningKey
from protocols.messages import MAX_SUSPECT_REPORTS
from swarm.byzantine.attacks import Attack, make_attack
from swarm.components import check_components
from swarm.config import RunConfig
from swarm.coordinator_client import Admission, CoordinatorClient, HeartbeatAnswer
from swarm.data import derive_seed
from swarm.dht import ping_node, start_dht
from swarm.identity import load_or_create_identity
from swarm.keyspace import RunValidator
from swarm.membership import fetch_members, publish_certificate
from swarm.pipeline.trainer import PipelineTrainer
from swarm.pipeline.worker import StageWorker, available_memory_bytes
from swarm.records import RecordSigner
from swarm.training.diloco import trainer_class
from swarm.training.precision import check_precision
from swarm.training.trainer import Trainer

logger = logging.getLogger("swarm.peer")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BANNED = 3
# Waits between attempts to file an accusation the coordinator was too busy to take.
ACCUSE_RETRY_DELAYS_S = (15.0, 30.0, 60.0)
# How long a stopping peer lets a round in flight finish before it leaves.
STOP_GRACE_S = 5.0


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True if ``stop`` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        return False
    return True


class Volunteer:
    """The volunteer process: join, enter the DHT, train in its role, heartbeat, and leave cleanly.

    Args:
        config: the peer's settings (coordinator address, device, identity, role, limits), which
            ``swarm-peer join``'s flags fill in.
    """

    def __init__(self, config: PeerConfig):
        self.config = config
        self.join_token = config.join_token or os.environ.get("SWARM_JOIN_TOKEN") or None
        self.known = KnownCoordinators(config.known_coordinators)
        self.state = "starting"
        self.key: SigningKey | None = None
        self.device = ""
        self.compute_device = "cpu"
        self.run_config: RunConfig | None = None
        self.certificate: PeerCertificate | None = None
        self.coordinator_key: PublicKey | None = None
        self._dht = None
        self.trainer: Trainer | None = None
        self.dialable = True  # learned at join (peer/reachability.py)
        self._started = time.monotonic()
        self.paused = False
        self.upload_limiter = upload_limiter(config)
        self._control: PeerControl | None = None
        self._coordinator_maddrs: list[str] = []
        self._reaching: asyncio.Task | None = None
        self.finished_step: int | None = None  # set once the coordinator says the run has finished

    def _set_state(self, state: str, detail: str = "") -> None:
        if state != self.state:
            self.state = state
            logger.info(
                f"peer {self.key.peer_id if self.key else '?'} state: {state}"
                + (f" ({detail})" if detail else "")
            )

    def _expected_coordinator_key(self, run_id: str) -> PublicKey | None:
        if self.config.coordinator_key:
            try:
                return PublicKey.from_peer_id(self.config.coordinator_key)
            except ProtocolError as e:
                raise ConfigError(f"--coordinator-key: {e}") from None
        return self.known.pinned(run_id)

    async def _join(self, client: CoordinatorClient, stop: asyncio.Event) -> Admission | None:
        config = self.config
        deadline = time.monotonic() + config.join_timeout_s
        delay = 1.0
        while True:
            try:
                admission = await client.join(
                    self.key,
                    config.run_id or "",
                    name=config.name,
                    device=self.device,
                    role=config.role,
                    join_token=self.join_token,
                    coordinator_key=self._expected_coordinator_key,
                )
                break
            except CoordinatorKeyMismatch as e:
                pinned_by = "--coordinator-key" if config.coordinator_key else str(self.known.path)
                raise CoordinatorKeyMismatch(
                    f"{e}; {key_mismatch_fix(e.run_id, e.offered, pinned_by)}",
                    offered=e.offered,
                    run_id=e.run_id,
                ) from None
            except NetworkError as e:
                if time.monotonic() + delay > deadline:
                    raise NetworkError(f"could not join within {config.join_timeout_s:.0f}s: {e}") from None
                logger.warning(f"{e}; retrying in {delay:.0f}s")
                if await _wait(stop, delay):
                    return None
                delay = min(2 * delay, config.max_retry_interval_s)
        try:
            run = RunConfig.parse(admission.run_spec, source="run spec from the coordinator")
        except ConfigError as e:
            raise ProtocolError(str(e)) from None
        await asyncio.to_thread(check_components, run)  # this peer must have the run's model and data
        check_precision(run.training.precision, self.compute_device)  # e.g. fp16 on a CPU: say so now
        if run.coordinator_key and run.coordinator_key != admission.coordinator_key.peer_id:
            raise SecurityError(
                f"the run spec names coordinator {run.coordinator_key}, but it signed with another key"
            )
        self.known.pin(run.run_id, admission.coordinator_key)
        self.run_config, self.certificate, self.coordinator_key = (
            run,
            admission.certificate,
            admission.coordinator_key,
        )
        logger.info(
            f"peer {self.key.peer_id} joined run {run.run_id!r} as {admission.certificate.role} "
            f"on {self.device}; certificate valid for {admission.certificate.expires_in() / 60:.0f} min"
        )
        return admission

    async def _announce(self) -> int:
        """Refresh our DHT member record and count the verified members; DHT trouble is logged, not fatal."""
        run = self.run_config
        try:
            await publish_certificate(
                self._dht, self.key, self.certificate, ttl_s=run.membership.offline_after_s
            )
            return len(await fetch_members(self._dht, run.run_id, self.coordinator_key))
        except Exception as e:
            logger.warning(f"DHT announce failed: {e}")
            return 0

    async def _reach_coordinator_dht(self, client: CoordinatorClient) -> None:
        """Ping the coordinator's DHT node, so that one restarted empty (perhaps on another port) learns
        this peer again and serves the swarm to the peers that join it; failures are only logged."""
        peer_id, timeout_s = self.coordinator_key.peer_id, self.config.rpc_timeout_s
        if await ping_node(self._dht, self._coordinator_maddrs, peer_id=peer_id, timeout_s=timeout_s):
            return
        try:
            fresh = list((await client.status()).dht_initial_peers)
        except SwarmError as e:
            logger.debug(f"cannot ask the coordinator for its DHT addresses: {e}")
            return
        if fresh != self._coordinator_maddrs and await ping_node(
            self._dht, fresh, peer_id=peer_id, timeout_s=timeout_s
        ):
            logger.info(f"re-entered the coordinator's DHT at {' '.join(fresh)}")
            self._coordinator_maddrs = fresh

    def _follow_run_state(self, answer: HeartbeatAnswer) -> bool:
        """Apply the run's ``max_steps`` as the coordinator now signs it (raised by a restart with a
        higher one); True once the run has finished and this peer should leave."""
        if not answer.signed_run_state:
            return False
        training = self.run_config.training
        if answer.max_steps != training.max_steps:
            logger.info(
                f"the run's max_steps is now {answer.max_steps or 'unlimited'} (was {training.max_steps})"
            )
            training.max_steps = answer.max_steps
        if answer.finished_step is None or self.finished_step == answer.finished_step:
            return False
        self.finished_step = answer.finished_step
        if not self.config.leave_when_finished:
            logger.info(f"run {self.run_config.run_id!r} finished at step {answer.finished_step}; staying")
            return False
        self._set_state("finished", f"at step {answer.finished_step}")
        logger.info(
            f"run {self.run_config.run_id!r} finished at step {answer.finished_step}: the coordinator holds "
            "its final checkpoint; leaving. Thank you for your compute!"
        )
        return True

    async def _heartbeats(self, client: CoordinatorClient, stop: asyncio.Event) -> int:
        interval_s = self.run_config.membership.heartbeat_interval_s
        failures = 0
        while True:
            members = await self._announce()
            delay = interval_s
            try:
                answer = await client.heartbeat(
                    self.key,
                    self.run_config.run_id,
                    self.coordinator_key,
                    state="paused" if self.paused else "online",
                    metrics=self._metrics(members),
                    step=self.trainer.step if self.trainer else 0,
                    param_hash=self.trainer.param_hash if self.trainer else "",
                    suspects=self.trainer.suspected(MAX_SUSPECT_REPORTS) if self.trainer else [],
                )
                if failures:
                    logger.info(f"reconnected to the coordinator at {client.address}")
                # In the background: a ping to a coordinator's old address waits out its timeout.
                if self._reaching is None or self._reaching.done():
                    self._reaching = asyncio.create_task(self._reach_coordinator_dht(client))
                failures = 0
                self._set_state("paused" if self.paused else "online")
                if answer.certificate is not None:
                    self.certificate = answer.certificate
                    self.records.certificate = answer.certificate.encoded
                    logger.info(f"certificate renewed (serial {answer.certificate.serial})")
                if self._follow_run_state(answer):
                    stop.set()
                    return EXIT_OK
            except NetworkError as e:
                failures += 1
                delay = min(interval_s * 2**failures, self.config.max_retry_interval_s)
                self._set_state("online, coordinator unreachable")
                logger.warning(f"lost the coordinator: {e}; still in the run, retrying in {delay:.0f}s")
            except AdmissionDenied as e:
                logger.warning(f"the coordinator does not know this peer ({e}); joining again")
                if await self._join(client, stop) is None:
                    return EXIT_OK
            except ReplayError as e:
                logger.warning(f"heartbeat refused: {e}")
            if await _wait(stop, delay):
                return EXIT_OK

    def pause(self) -> None:
        """Stop computing but stay in the run (SIGUSR1, ``swarm-peer pause``); credit is kept."""
        self.paused = True
        self._pass_pause()
        if self.state in ("online", "paused"):
            self._set_state("paused", "swarm-peer resume continues")
        self._publish_control()

    def resume(self) -> None:
        """Compute again (SIGUSR2, ``swarm-peer resume``)."""
        self.paused = False
        self._pass_pause()
        if self.state == "paused":
            self._set_state("online")
        self._publish_control()

    def _accuser(self, client: CoordinatorClient):
        """Files a validator's evidence against a reducer with the coordinator, which judges it."""

        async def accuse(accused: str, evidence, verdict: str) -> None:
            # A busy coordinator (its evidence budget or this peer's accusations spent) says "retry later".
            for delay_s in (*ACCUSE_RETRY_DELAYS_S, None):
                try:
                    answer = await client.accuse(
                        self.key,
                        self.run_config.run_id,
                        accused=accused,
                        reason=verdict,
                        evidence=evidence.to_bytes(),
                    )
                    break
                except NetworkError as e:
                    if delay_s is None:
                        raise
                    logger.info(
                        f"accusation against {accused} not taken yet ({e}); retrying in {delay_s:.0f}s"
                    )
                    await asyncio.sleep(delay_s)
            logger.warning(
                f"accused {accused}; the coordinator banned {answer.banned_peer}: {answer.verdict}"
            )

        return accuse

    def _rehearsed_attack(self) -> Attack | None:
        """The attack this peer plays (``--rehearse-attack``), passed as its trainer's or worker's hooks."""
        config = self.config
        if config.rehearse_attack is None:
            return None
        attack = make_attack(
            config.rehearse_attack,
            group_size=config.rehearse_group_size,
            attackers=min(config.rehearse_attackers, config.rehearse_group_size),
            seed=derive_seed(self.run_config.run_id, self.key.peer_id, 0, 0),
        )
        logger.warning(f"REHEARSAL: this peer plays the {config.rehearse_attack!r} attacker")
        return attack

    def _pass_pause(self) -> None:
        if self.trainer is None:
            return  # the trainer starts paused (see _run)
        if not hasattr(self.trainer, "pause"):
            logger.warning(f"{type(self.trainer).__name__} cannot pause; it keeps working")
            return
        if self.paused:
            self.trainer.pause()
        else:
            self.trainer.resume()

    def _publish_control(self) -> None:
        if self._control is not None:
            status = self.status()
            self._control.publish(paused=self.paused, state=status["state"], step=status.get("step", 0))

    def status(self) -> dict:
        """What the panel and ``swarm-peer pause/resume`` show: state, progress and contribution."""
        status = {
            "state": self.state, "name": self.config.name, "device": self.device,
            "peer_id": self.key.peer_id if self.key else "", "paused": self.paused,
            "run_id": self.run_config.run_id if self.run_config else "",
        }  # fmt: skip
        if self.trainer is not None:
            status.update(self.trainer.metrics())
        return {**status, **self._link_metrics()}

    def _link_metrics(self) -> dict[str, float]:
        """Whether others can dial this peer, and its upload rate as measured in averaging rounds (the
        rate its deadlines count on, see swarm/averaging/deadlines.py)."""
        metrics = {"dialable": float(self.dialable)}
        averager = getattr(self.trainer, "averager", None)
        if averager is not None and averager.link.mbit is not None:
            metrics["uplink_mbit"] = averager.link.mbit
        return metrics

    async def run(self, stop: asyncio.Event) -> int:
        """Take part until ``stop`` is set; returns the process exit code."""
        self._control = PeerControl(self.config.identity_path)
        self._control.start(self.pause, self.resume)
        panel = asyncio.create_task(Panel(self.status, interval_s=self.config.status_interval_s).run(stop))
        try:
            return await self._run(stop)
        finally:
            panel.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await panel
            self._control.close()

    def _metrics(self, members: int) -> dict[str, float]:
        metrics = {
            "uptime_s": time.monotonic() - self._started,
            "dht_members": float(members),
        }
        if self.trainer is not None:
            metrics.update(self.trainer.metrics())
        metrics.update(self._link_metrics())
        return {k: v for k, v in metrics.items() if math.isfinite(v)}  # e.g. no loss before the first step

    async def _pipeline_role(self, device: str, client: CoordinatorClient) -> PipelineTrainer | StageWorker:
        """This peer's part in a run split into pipeline stages: a stage server or a trainer (``--role``)."""
        run, role = self.run_config, self.config.role
        if run.pipeline.stages < 2:
            raise ConfigError(f"--role {role}: run {run.run_id!r} has no pipeline stages; use --role data")
        if role == "data":
            raise ConfigError(
                f"run {run.run_id!r} is split into {run.pipeline.stages} pipeline stages: "
                "join with --role stage, --role trainer or --role auto"
            )
        if role == "trainer":
            return await asyncio.to_thread(
                PipelineTrainer, run, self._dht, peer_id=self.key.peer_id, record_signer=self.records,
                coordinator_key=self.coordinator_key, hooks=self._rehearsed_attack(), accuse=self._accuser(client),
            )  # fmt: skip
        last = run.pipeline.stages - 1
        if self.config.stage is not None and self.config.stage > last:
            raise ConfigError(f"--stage {self.config.stage}: run {run.run_id!r} has stages 0..{last}")
        memory = await asyncio.to_thread(available_memory_bytes, device)
        return StageWorker(
            run, self._dht, peer_id=self.key.peer_id, stage=self.config.stage, device=device,
            coordinator_key=self.coordinator_key, memory_bytes=memory, signing_key=self.key,
            upload_limiter=self.upload_limiter, accuse=self._accuser(client), record_signer=self.records,
            hooks=self._rehearsed_attack(),
        )  # fmt: skip

    async def _leave(self, client: CoordinatorClient) -> None:
        try:
            reason = "volunteer stopped" if self.finished_step is None else "the run finished"
            await client.leave(self.key, self.run_config.run_id, reason=reason)
            self._set_state("left")
        except SwarmError as e:
            logger.warning(
                f"could not tell the coordinator this peer left ({e}); it will show offline shortly"
            )

    async def _run(self, stop: asyncio.Event) -> int:
        config = self.config
        if config.max_cpu_threads:
            import torch

            torch.set_num_threads(config.max_cpu_threads)
        self.key = await asyncio.to_thread(load_or_create_identity, config.identity_path)
        compute_device = self.compute_device = await asyncio.to_thread(resolve_device, config.device)
        self.device = await asyncio.to_thread(describe_device, compute_device)
        await asyncio.to_thread(apply_gpu_memory_limit, config, compute_device)
        logger.info(f"peer {self.key.peer_id} ({config.name!r}, {self.device}) joining {config.coordinator}")
        async with CoordinatorClient(config.coordinator, timeout_s=config.rpc_timeout_s) as client:
            admission = await self._join(client, stop)
            if admission is None:
                return EXIT_OK
            self.dialable = await learn_dialable(client, config.host, config.dialable)
            self._dht = await asyncio.to_thread(
                start_dht,
                self.key,
                config.identity_path,
                host=config.host,
                port=config.port,
                initial_peers=admission.dht_initial_peers,
                upnp=config.upnp,
                validators=[
                    RunValidator(
                        self.run_config.run_id, self.coordinator_key, stages=self.run_config.pipeline.stages
                    )
                ],
                client_mode=not self.dialable,
            )
            self._coordinator_maddrs = list(admission.dht_initial_peers)
            self.records = RecordSigner(self.key, self.certificate.encoded)
            training: asyncio.Task | None = None
            try:
                if self.run_config.pipeline.stages > 1 or config.role in ("stage", "trainer"):
                    self.trainer = await self._pipeline_role(compute_device, client)
                else:
                    self.trainer = await asyncio.to_thread(
                        trainer_class(self.run_config), self.run_config, self._dht, peer_id=self.key.peer_id, device=compute_device,
                        coordinator_key=self.coordinator_key, signing_key=self.key, data_host=config.host,
                        data_port=config.data_port, data_announce_host=config.public_host,
                        upload_limiter=self.upload_limiter, accuse=self._accuser(client),
                        hooks=self._rehearsed_attack(), record_signer=self.records,
                        activation_checkpointing=config.activation_checkpointing,
                        fit_memory=config.max_gpu_memory is not None, client_mode=not self.dialable,
                        coordinator_checkpoint=admission.holds_checkpoint,
                    )  # fmt: skip
                self._pass_pause()
                training = asyncio.create_task(self.trainer.run(stop))
                heartbeats = asyncio.create_task(self._heartbeats(client, stop))
                await asyncio.wait({training, heartbeats}, return_when=asyncio.FIRST_COMPLETED)
                if training.done() and not stop.is_set():
                    heartbeats.cancel()
                    error = training.exception()
                    logger.error("training stopped unexpectedly", exc_info=error)
                    return EXIT_FAILED
                code = await heartbeats
                try:
                    await asyncio.wait_for(asyncio.shield(training), timeout=STOP_GRACE_S)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
                except Exception:
                    logger.exception("training failed while stopping")
                if code == EXIT_OK:
                    await self._leave(client)
                return code
            except Banned as e:
                self._set_state("banned", str(e))
                logger.error(f"this peer is banned: {e}")
                return EXIT_BANNED
            finally:
                if self._reaching is not None:
                    self._reaching.cancel()
                if training is not None and not training.done():
                    training.cancel()
                    with contextlib.suppress(BaseException):
                        await training
                await asyncio.to_thread(self._dht.shutdown)
