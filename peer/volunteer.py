"""The volunteer process: a run's membership (``swarm.session.Session``: join, DHT, heartbeats, leave)
plus this peer's role in it (a trainer, a stage worker or a pipeline trainer), its status panel and
its pause control.

Only a ban, a stop signal or the end of the run ends it; a stop signal or the run's end first tells the
coordinator the peer left.

Example::

    stop = asyncio.Event()
    exit_code = await Volunteer(PeerConfig(coordinator="127.0.0.1:31330", device="cpu")).run(stop)
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import contextlib
import logging
import time

from peer.config import PeerConfig
from peer.control import PeerControl
from peer.device import describe_device, resolve_device
from peer.limits import apply_gpu_memory_limit, upload_limiter
from peer.panel import Panel
from protocols.errors import Banned, ConfigError
from swarm import journal
from swarm.byzantine.attacks import Attack, make_attack
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.data import derive_seed
from swarm.identity import load_or_create_identity
from swarm.pipeline.trainer import PipelineTrainer
from swarm.pipeline.worker import StageWorker, available_memory_bytes
from swarm.session import Session
from swarm.training.precision import check_precision
from swarm.training.trainer import Trainer

logger = logging.getLogger("swarm.peer")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BANNED = 3
# How long a stopping peer lets a round in flight finish before it leaves.
STOP_GRACE_S = 5.0


class Volunteer:
    """The volunteer process: a session in the run, a role in it, the status panel and pause control.

    Args:
        config: the peer's settings (coordinator address, device, identity, role, limits), which
            ``swarm-peer join``'s flags fill in.
    """

    def __init__(self, config: PeerConfig):
        self.config = config
        self.session = Session(config, device="", check_run=self._check_run, metrics=self._process_metrics)
        self.compute_device = "cpu"
        self.trainer: Trainer | None = None
        self._started = time.monotonic()
        self.upload_limiter = upload_limiter(config)
        self._control: PeerControl | None = None
        self.session.paused = config.start_paused  # its heartbeats say "paused" until it is resumed

    @property
    def key(self):
        return self.session.key

    @property
    def device(self) -> str:
        """This peer's compute as the organizer sees it (``"cpu: 2 cores"``); empty until it is known."""
        return self.session.device

    @property
    def paused(self) -> bool:
        return self.session.paused

    @property
    def run_config(self) -> RunConfig | None:
        return self.session.run_config

    @property
    def state(self) -> str:
        return self.session.state

    def _check_run(self, run: RunConfig) -> None:
        check_precision(run.training.precision, self.compute_device)  # e.g. fp16 on a CPU: say so now
        if run.model.name == "external":
            raise ConfigError(
                f"run {run.run_id!r} trains a model defined in its researchers' own code (model 'external'): "
                "swarm-peer join has no code for it; join from that code with session.collaborate (README)"
            )

    def pause(self) -> None:
        """Stop computing but stay in the run (SIGUSR1, ``swarm-peer pause``); credit is kept."""
        self.session.paused = True
        self._pass_pause()
        if self.state in ("online", "paused"):
            self.session.set_state("paused", "swarm-peer resume continues")
        self._publish_control()

    def resume(self) -> None:
        """Compute again (SIGUSR2, ``swarm-peer resume``)."""
        self.session.paused = False
        self._pass_pause()
        if self.state == "paused":
            self.session.set_state("online")
        self._publish_control()

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
        metrics = {"dialable": float(self.session.dialable)}
        averager = getattr(self.trainer, "averager", None)
        if averager is not None and averager.link.mbit is not None:
            metrics["uplink_mbit"] = averager.link.mbit
        return metrics

    def _process_metrics(self) -> dict[str, float]:
        return {"uptime_s": time.monotonic() - self._started, **self._link_metrics()}

    async def run(self, stop: asyncio.Event) -> int:
        """Take part until ``stop`` is set; returns the process exit code."""
        self._control = PeerControl(self.config.identity_path)
        self._control.start(self.pause, self.resume)
        panel = asyncio.create_task(Panel(self.status, interval_s=self.config.status_interval_s).run(stop))
        opened = journal.open_journal(self.config.round_journal) if self.config.round_journal else None
        try:
            return await self._run(stop)
        finally:
            if opened is not None:
                journal.close_journal(opened)
            panel.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await panel
            self._control.close()

    async def _pipeline_role(self, device: str, client: CoordinatorClient) -> PipelineTrainer | StageWorker:
        """This peer's part in a run split into pipeline stages: a stage server or a trainer (``--role``)."""
        run, role, session = self.run_config, self.config.role, self.session
        if run.pipeline.stages < 2:
            raise ConfigError(f"--role {role}: run {run.run_id!r} has no pipeline stages; use --role data")
        if role == "data":
            raise ConfigError(
                f"run {run.run_id!r} is split into {run.pipeline.stages} pipeline stages: "
                "join with --role stage, --role trainer or --role auto"
            )
        if role == "trainer":
            return await asyncio.to_thread(
                PipelineTrainer, run, session.dht, peer_id=self.key.peer_id, record_signer=session.records,
                coordinator_key=session.coordinator_key, hooks=self._rehearsed_attack(), accuse=session.accuser(),
            )  # fmt: skip
        last = run.pipeline.stages - 1
        if self.config.stage is not None and self.config.stage > last:
            raise ConfigError(f"--stage {self.config.stage}: run {run.run_id!r} has stages 0..{last}")
        memory = await asyncio.to_thread(available_memory_bytes, device)
        return StageWorker(
            run, session.dht, peer_id=self.key.peer_id, stage=self.config.stage, device=device,
            coordinator_key=session.coordinator_key, memory_bytes=memory, signing_key=self.key,
            upload_limiter=self.upload_limiter, accuse=session.accuser(), record_signer=session.records,
            hooks=self._rehearsed_attack(),
        )  # fmt: skip

    async def _data_role(self, device: str, client: CoordinatorClient) -> Trainer:
        config, session, run = self.config, self.session, self.run_config
        return await asyncio.to_thread(
            Trainer, run, session.dht, peer_id=self.key.peer_id, device=device,
            coordinator_key=session.coordinator_key, signing_key=self.key, data_host=config.host,
            data_port=config.data_port, data_announce_host=config.public_host,
            upload_limiter=self.upload_limiter, accuse=session.accuser(),
            hooks=self._rehearsed_attack(), record_signer=session.records,
            activation_checkpointing=config.activation_checkpointing,
            fit_memory=config.max_gpu_memory is not None, client_mode=not session.dialable,
            coordinator_checkpoint=session.admission.holds_checkpoint, standing=session.standing,
        )  # fmt: skip

    async def _run(self, stop: asyncio.Event) -> int:
        config, session = self.config, self.session
        if config.max_cpu_threads:
            import torch

            torch.set_num_threads(config.max_cpu_threads)
        session.key = await asyncio.to_thread(load_or_create_identity, config.identity_path)
        compute_device = self.compute_device = await asyncio.to_thread(resolve_device, config.device)
        session.device = await asyncio.to_thread(describe_device, compute_device)
        await asyncio.to_thread(apply_gpu_memory_limit, config, compute_device)
        logger.info(f"peer {self.key.peer_id} ({config.name!r}, {self.device}) joining {config.coordinator}")
        async with CoordinatorClient(
            config.coordinator, timeout_s=config.rpc_timeout_s, reconnect_s=config.max_retry_interval_s
        ) as client:
            training: asyncio.Task | None = None
            try:
                if not await session.start(client, stop):
                    return EXIT_OK
                if self.run_config.pipeline.stages > 1 or config.role in ("stage", "trainer"):
                    self.trainer = await self._pipeline_role(compute_device, client)
                else:
                    self.trainer = await self._data_role(compute_device, client)
                session.progress = self.trainer
                self._pass_pause()
                training = asyncio.create_task(self.trainer.run(stop))
                heartbeats = asyncio.create_task(session.heartbeats(stop))
                await asyncio.wait({training, heartbeats}, return_when=asyncio.FIRST_COMPLETED)
                if training.done() and not stop.is_set():
                    heartbeats.cancel()
                    error = training.exception()
                    logger.error("training stopped unexpectedly", exc_info=error)
                    return EXIT_FAILED
                await heartbeats
                try:
                    await asyncio.wait_for(asyncio.shield(training), timeout=STOP_GRACE_S)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
                except Exception:
                    logger.exception("training failed while stopping")
                await session.leave()
                return EXIT_OK
            except Banned as e:
                session.set_state("banned", str(e))
                logger.error(f"this peer is banned: {e}")
                return EXIT_BANNED
            finally:
                if training is not None and not training.done():
                    training.cancel()
                    with contextlib.suppress(BaseException):
                        await training
                await session.close()
