"""A peer's membership in a run: join, enter its DHT, heartbeat, renew the certificate, and leave.

``Session`` is what every kind of participant needs before it computes anything, and what it keeps
doing while it computes: the volunteer process (``peer/volunteer.py``) builds its role on one, and a
researcher's own program gets one from ``connect``. Losing the coordinator does not end a session: it
keeps its DHT membership, retries with exponential backoff and says so, re-joins if the coordinator has
forgotten it, and re-enters the coordinator's DHT node if it restarted. Only a ban, a stop or the end of
the run ends it (the coordinator's signed heartbeat answer says when the run finished, and raises
``max_steps``).

What a session reports in its heartbeats (step, parameter hash, suspects, metrics) comes from the
``Progress`` it is given: the trainer, once there is one.

A program of its own trains through ``collaborate`` (``swarm.training.collaboration``).

Example::

    with swarm.connect("203.0.113.7:31330", identity="~/.swarm/identity.key") as session:
        print(session.run_config.run_id, session.certificate.role)
        collab = session.collaborate(model)  # then collab.step(samples) after each backward
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocols.certificates import PeerCertificate
from protocols.errors import (
    AdmissionDenied,
    ConfigError,
    CoordinatorKeyMismatch,
    DHTStartFailed,
    NetworkError,
    ProtocolError,
    ReplayError,
    SecurityError,
    SwarmError,
)
from protocols.keys import PublicKey, SigningKey
from protocols.messages import MAX_SUSPECT_REPORTS
from swarm.config import RUN_ID_PATTERN, RunConfig
from swarm.identity import DEFAULT_IDENTITY, load_or_create_identity
from swarm.standing import Standing
from swarm.trust import KnownCoordinators, key_mismatch_fix

if TYPE_CHECKING:  # the CLIs' --help reads SessionConfig: it must not load grpc or torch
    from swarm.coordinator_client import Admission, CoordinatorClient, HeartbeatAnswer
    from swarm.training.collaboration import Collaboration

logger = logging.getLogger("swarm.peer")


class SessionConfig(BaseModel):
    """How to join a run and stay in it: the coordinator, this peer's identity and network settings."""

    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(description="coordinator address HOST:PORT")
    name: str = Field(
        default_factory=lambda: socket.gethostname()[:64] or "peer",
        min_length=1,
        max_length=64,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="display name shown to the organizer (default: host name)",
    )
    identity: Path = Field(DEFAULT_IDENTITY, description="key file; created with mode 0600 if missing")
    role: Literal["auto", "data", "stage", "trainer"] = Field(
        "auto",
        description="what this peer does: data-parallel training (data), host a pipeline stage (stage), "
        "stream micro-batches through the stages (trainer); auto: data, or in a pipeline run the stage most "
        "short of throughput",
    )
    run_id: str | None = Field(
        None, pattern=RUN_ID_PATTERN, description="run to join (default: the coordinator's)"
    )
    coordinator_key: str | None = Field(
        None, description="peer ID of the coordinator's key, to trust no other (default: pin on first join)"
    )
    join_token: str | None = Field(None, description="the run's join token (or set SWARM_JOIN_TOKEN)")
    host: str = Field("0.0.0.0", description="address the DHT and the averaging data port listen on")
    port: int = Field(0, ge=0, le=65535, description="DHT (libp2p) port (0: any free port)")
    upnp: bool = Field(False, description="ask the router to forward the DHT port (UPnP)")
    dialable: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="whether other peers can connect to this machine; auto: the coordinator dials back at "
        "join; a peer that cannot be dialed (behind NAT) never leads an averaging group",
    )
    known_coordinators: Path = Field(
        Path("~/.swarm/known_coordinators.json"), description="where pinned coordinator keys are kept"
    )
    join_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="give up joining after this many seconds"
    )
    rpc_timeout_s: float = Field(10.0, gt=0, le=300, description="timeout of one call to the coordinator")
    max_retry_interval_s: float = Field(30.0, ge=1, le=3600, description="longest wait between retries")
    dht_start_attempts: int = Field(
        4, ge=1, le=100,
        description="tries to start the DHT node (each waits up to 3 minutes for it; a busy machine may "
        "need more than one) before giving up",
    )  # fmt: skip
    leave_when_finished: bool = Field(
        True,
        description="leave and exit 0 once the coordinator says the run finished; --no-leave-when-finished "
        "keeps serving the final state until stopped (rehearsals that read every peer's end state)",
    )

    @field_validator("coordinator")
    @classmethod
    def _host_port(cls, address: str) -> str:
        from swarm.coordinator_client import parse_address

        try:
            parse_address(address)
        except SwarmError as e:
            raise ValueError(str(e)) from None
        return address

    @field_validator("name")
    @classmethod
    def _printable_text(cls, name: str) -> str:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("name must be valid UTF-8 text") from None
        return name

    @property
    def identity_path(self) -> Path:
        return self.identity.expanduser()


class Progress(Protocol):
    """What a session's heartbeats report about the work done in it (``TrainingPeer``, the built-in ``Trainer``
    and the pipeline roles)."""

    step: int
    param_hash: str

    def suspected(self, limit: int) -> list[str]: ...

    def witnessed(self) -> list[list[bytes]]: ...

    def metrics(self) -> dict[str, float]: ...


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True if ``stop`` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        return False
    return True


class Session:
    """One peer's membership in a run (see the module docstring).

    Args:
        config: where to join and how to be reached.
        device: this peer's compute, as the organizer sees it (``"cpu: 2 cores"``).
        check_run: called with each run spec the coordinator sends, before the session accepts it (a
            role's own requirement, such as a precision the device must support); raises to refuse.
        metrics: extra heartbeat metrics of the process (uptime, link), merged over the progress's.
    """

    def __init__(
        self,
        config: SessionConfig,
        *,
        device: str = "cpu",
        check_run: Callable[[RunConfig], None] | None = None,
        metrics: Callable[[], dict[str, float]] | None = None,
    ):
        self.config, self.device, self.check_run, self.extra_metrics = config, device, check_run, metrics
        self.join_token = config.join_token or os.environ.get("SWARM_JOIN_TOKEN") or None
        self.known = KnownCoordinators(config.known_coordinators)
        self.key: SigningKey | None = None
        self.run_config: RunConfig | None = None
        self.certificate: PeerCertificate | None = None
        self.coordinator_key: PublicKey | None = None
        self.admission: Admission | None = None
        self.client: CoordinatorClient | None = None
        self.dht = None
        self.records = None
        self.dialable = True
        self.progress: Progress | None = None
        self.paused = False
        self.state = "starting"
        self.finished_step: int | None = None  # set once the coordinator says the run has finished
        self.standing = Standing()  # the credit the coordinator last signed; catch-up weighs votes by it
        self._coordinator_maddrs: list[str] = []
        self._reaching: asyncio.Task | None = None
        self._early_beats: asyncio.Task | None = None  # heartbeats from the admission until the loop's
        self._early_done = asyncio.Event()
        self._members = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None  # the session's own: set when it ends
        self._collaborations: list[Collaboration] = []

    def set_state(self, state: str, detail: str = "") -> None:
        if state != self.state:
            self.state = state
            logger.info(
                f"peer {self.key.peer_id if self.key else '?'} state: {state}"
                + (f" ({detail})" if detail else "")
            )

    # --- joining ------------------------------------------------------------------------------------

    async def start(self, client: CoordinatorClient, stop: asyncio.Event) -> bool:
        """Join through ``client``, learn whether others can dial this machine, and start the DHT node;
        False if ``stop`` was set before the DHT node was up (after a join, the peer leaves again)."""
        from swarm.dht import start_dht
        from swarm.keyspace import RunValidator
        from swarm.reachability import learn_dialable
        from swarm.records import RecordSigner

        self.client, self._loop, self._stop = client, asyncio.get_running_loop(), stop
        if self.key is None:
            self.key = await asyncio.to_thread(load_or_create_identity, self.config.identity_path)
        if await self.join(stop) is None:
            return False
        self._early_done = asyncio.Event()
        self._early_beats = asyncio.create_task(self._heartbeats_before_the_loop(stop, self._early_done))
        run = self.run_config
        try:
            self.dialable = await learn_dialable(client, self.config.host, self.config.dialable)
            self.dht = await self._start_dht(
                stop, lambda: start_dht(
                    self.key, self.config.identity_path, host=self.config.host, port=self.config.port,
                    initial_peers=self.admission.dht_initial_peers, upnp=self.config.upnp,
                    validators=[RunValidator(run.run_id, self.coordinator_key, stages=run.pipeline.stages)],
                    client_mode=not self.dialable,
                ),
            )  # fmt: skip
        except BaseException:
            await self._end_early_beats()
            raise
        if self.dht is None:  # stopped while the node was still starting: the coordinator admitted us
            await self.leave()
            return False
        self._coordinator_maddrs = list(self.admission.dht_initial_peers)
        self.records = RecordSigner(self.key, self.certificate.encoded)
        return True

    async def _heartbeats_before_the_loop(self, stop: asyncio.Event, done: asyncio.Event) -> None:
        """Heartbeat from the admission until ``done`` is set (``heartbeats`` takes over): while the peer
        checks its reachability, its DHT node starts and the caller builds its trainer (each seconds, a
        minute or more on a busy machine), so that the coordinator does not show a peer it has just
        admitted as offline meanwhile. They report no process metrics (so no uptime: the coordinator
        flags a peer that has been up a minute outside its DHT as diverged), and keep what the answers
        carry (``_take_answer``); the run's end is for the loop to act on. A beat in flight when ``done``
        is set completes: the coordinator sends each version of its standing once."""
        interval_s = self.run_config.membership.heartbeat_interval_s
        while not await wait_or_stop(done, interval_s) and not stop.is_set():
            try:
                self._take_answer(await self._heartbeat(metrics={"dht_members": 0.0}))
            except NetworkError as e:
                logger.debug(f"heartbeat before the heartbeat loop: {e}")
            except SwarmError as e:  # a ban, or a coordinator that forgot this peer: the loop acts on it
                logger.info(f"heartbeat before the heartbeat loop refused: {e}")

    async def _end_early_beats(self) -> None:
        """End the heartbeats before the loop, after the beat in flight if any (bounded by the call's
        timeout); the caller's own cancellation is not passed on to it, nor swallowed."""
        task, self._early_beats = self._early_beats, None
        if task is not None:
            self._early_done.set()
            await asyncio.shield(task)

    async def _start_dht(self, stop: asyncio.Event, start: Callable[[], Any]) -> Any:
        """``start()`` in a thread, tried again with backoff while the node does not come up in time (a
        busy machine), up to ``dht_start_attempts`` times; None if ``stop`` was set meanwhile. Any other
        failure, such as a port in use, is raised at once: waiting would not fix it."""
        attempts, delay = self.config.dht_start_attempts, 1.0
        for attempt in range(1, attempts + 1):
            try:
                return await asyncio.to_thread(start)
            except DHTStartFailed as e:
                if attempt == attempts:
                    raise DHTStartFailed(
                        f"{e}, {attempts} times: the machine may be too busy, or a firewall blocks the "
                        "DHT port; free some CPU or raise --dht-start-attempts"
                    ) from None
                logger.warning(f"{e}; trying again in {delay:.0f}s (attempt {attempt + 1} of {attempts})")
                if await wait_or_stop(stop, delay):
                    return None
                delay = min(2 * delay, self.config.max_retry_interval_s)
        return None

    def _expected_coordinator_key(self, run_id: str) -> PublicKey | None:
        if self.config.coordinator_key:
            try:
                return PublicKey.from_peer_id(self.config.coordinator_key)
            except ProtocolError as e:
                raise ConfigError(f"--coordinator-key: {e}") from None
        return self.known.pinned(run_id)

    async def join(self, stop: asyncio.Event) -> Admission | None:
        """Ask the coordinator to admit this peer, retrying while it cannot be reached (up to
        ``join_timeout_s``); None if ``stop`` was set meanwhile."""
        config, client = self.config, self.client
        deadline = time.monotonic() + config.join_timeout_s
        delay = 1.0
        while True:
            try:
                admission = await client.join(
                    self.key, config.run_id or "", name=config.name, device=self.device, role=config.role,
                    join_token=self.join_token, coordinator_key=self._expected_coordinator_key,
                )  # fmt: skip
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
                if await wait_or_stop(stop, delay):
                    return None
                delay = min(2 * delay, config.max_retry_interval_s)
        try:
            run = RunConfig.parse(admission.run_spec, source="run spec from the coordinator")
        except ConfigError as e:
            raise ProtocolError(str(e)) from None
        from swarm.components import check_components

        await asyncio.to_thread(check_components, run)  # this peer must have the run's model and data
        if self.check_run is not None:
            self.check_run(run)
        if run.coordinator_key and run.coordinator_key != admission.coordinator_key.peer_id:
            raise SecurityError(
                f"the run spec names coordinator {run.coordinator_key}, but it signed with another key"
            )
        self.known.pin(run.run_id, admission.coordinator_key, replace=bool(self.config.coordinator_key))
        if self.run_config is not None and self.run_config.run_id == run.run_id:
            # Joining again (a restarted coordinator forgot this peer): the roles built on the run config
            # keep reading it, so it takes the new max_steps in place instead of being replaced.
            self._apply_max_steps(run.training.max_steps)
            run = self.run_config
        self.admission, self.run_config = admission, run
        self.certificate, self.coordinator_key = admission.certificate, admission.coordinator_key
        logger.info(
            f"peer {self.key.peer_id} joined run {run.run_id!r} as {admission.certificate.role} "
            f"on {self.device}; certificate valid for {admission.certificate.expires_in() / 60:.0f} min"
        )
        return admission

    # --- staying in the run -------------------------------------------------------------------------

    async def _announce(self) -> int:
        """Refresh our DHT member record and count the verified members; DHT trouble is logged, not fatal."""
        from swarm.membership import fetch_members, publish_certificate

        run = self.run_config
        # The record must outlive the slowest heartbeat loop: its DHT work and its coordinator call (up to
        # rpc_timeout_s) come on top of the interval. With offline_after_s alone, one slow loop on a loaded
        # machine let the record expire, and groupmates refused this peer's parts as "not a certified
        # member" until the next loop.
        membership = run.membership
        ttl_s = membership.offline_after_s + membership.heartbeat_interval_s + self.config.rpc_timeout_s
        try:
            await publish_certificate(self.dht, self.key, self.certificate, ttl_s=ttl_s)
            return len(await fetch_members(self.dht, run.run_id, self.coordinator_key))
        except Exception as e:
            logger.warning(f"DHT announce failed: {e}")
            return 0

    async def _reach_coordinator_dht(self) -> None:
        """Ping the coordinator's DHT node, so that one restarted empty (perhaps on another port) learns
        this peer again and serves the swarm to the peers that join it; failures are only logged."""
        from swarm.dht import ping_node

        peer_id, timeout_s = self.coordinator_key.peer_id, self.config.rpc_timeout_s
        if await ping_node(self.dht, self._coordinator_maddrs, peer_id=peer_id, timeout_s=timeout_s):
            return
        try:
            fresh = list((await self.client.status()).dht_initial_peers)
        except SwarmError as e:
            logger.debug(f"cannot ask the coordinator for its DHT addresses: {e}")
            return
        if fresh != self._coordinator_maddrs and await ping_node(
            self.dht, fresh, peer_id=peer_id, timeout_s=timeout_s
        ):
            logger.info(f"re-entered the coordinator's DHT at {' '.join(fresh)}")
            self._coordinator_maddrs = fresh

    def _take_answer(self, answer: HeartbeatAnswer) -> None:
        """Keep what a heartbeat's answer carries: a renewed certificate, and from the coordinator's
        signed run state its standing (sent once per version) and the run's ``max_steps`` (raised by a
        restart with a higher one)."""
        if answer.certificate is not None:
            self.certificate = answer.certificate
            if self.records is not None:  # else made with this certificate once the DHT node is up
                self.records.certificate = answer.certificate.encoded
            logger.info(f"certificate renewed (serial {answer.certificate.serial})")
        if answer.signed_run_state:
            self.standing.take(answer.standing_at, answer.standing)
            self._apply_max_steps(answer.max_steps)

    def _follow_run_state(self, answer: HeartbeatAnswer) -> bool:
        """True once the coordinator's signed run state says the run has finished and this peer should
        leave."""
        if not answer.signed_run_state:
            return False
        if answer.finished_step is None or self.finished_step == answer.finished_step:
            return False
        self.finished_step = answer.finished_step
        if not self.config.leave_when_finished:
            logger.info(f"run {self.run_config.run_id!r} finished at step {answer.finished_step}; staying")
            return False
        self.set_state("finished", f"at step {answer.finished_step}")
        logger.info(
            f"run {self.run_config.run_id!r} finished at step {answer.finished_step}: the coordinator holds "
            "its final checkpoint; leaving. Thank you for your compute!"
        )
        return True

    def _apply_max_steps(self, max_steps: int | None) -> None:
        training = self.run_config.training
        if max_steps != training.max_steps:
            logger.info(f"the run's max_steps is now {max_steps or 'unlimited'} (was {training.max_steps})")
            training.max_steps = max_steps

    def metrics(self) -> dict[str, float]:
        """What the heartbeat reports: the progress's metrics, the DHT members seen, the process's own."""
        metrics = {"dht_members": float(self._members)}
        if self.progress is not None:
            metrics.update(self.progress.metrics())
        if self.extra_metrics is not None:
            metrics.update(self.extra_metrics())
        return {k: v for k, v in metrics.items() if math.isfinite(v)}  # e.g. no loss before the first step

    async def heartbeats(self, stop: asyncio.Event) -> bool:
        """Heartbeat until ``stop`` is set (False) or the run has finished and this peer leaves (True);
        ``Banned`` ends it with that error."""
        await self._end_early_beats()
        interval_s = self.run_config.membership.heartbeat_interval_s
        failures = 0
        while True:
            self._members = await self._announce()
            delay = interval_s
            try:
                answer = await self._heartbeat()
                if failures:
                    logger.info(f"reconnected to the coordinator at {self.client.address}")
                # In the background: a ping to a coordinator's old address waits out its timeout.
                if self._reaching is None or self._reaching.done():
                    self._reaching = asyncio.create_task(self._reach_coordinator_dht())
                failures = 0
                self.set_state("paused" if self.paused else "online")
                self._take_answer(answer)
                if self._follow_run_state(answer):
                    stop.set()
                    return True
            except NetworkError as e:
                failures += 1
                delay = min(interval_s * 2**failures, self.config.max_retry_interval_s)
                self.set_state("online, coordinator unreachable")
                logger.warning(f"lost the coordinator: {e}; still in the run, retrying in {delay:.0f}s")
            except AdmissionDenied as e:
                logger.warning(f"the coordinator does not know this peer ({e}); joining again")
                if await self.join(stop) is None:
                    return False
            except ReplayError as e:
                logger.warning(f"heartbeat refused: {e}")
            if await wait_or_stop(stop, delay):
                return False

    async def _heartbeat(self, metrics: dict[str, float] | None = None) -> HeartbeatAnswer:
        progress = self.progress
        return await self.client.heartbeat(
            self.key, self.run_config.run_id, self.coordinator_key,
            state="paused" if self.paused else "online", metrics=self.metrics() if metrics is None else metrics,
            step=progress.step if progress else 0, param_hash=progress.param_hash if progress else "",
            suspects=progress.suspected(MAX_SUSPECT_REPORTS) if progress else [],
            rounds=progress.witnessed() if progress else [], standing_at=self.standing.at,
        )  # fmt: skip

    # --- leaving ------------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Tell the coordinator this peer left (it shows offline shortly if it cannot be told), after one
        last heartbeat, so that its record keeps the step and parameter hash this peer ended on."""
        await self._end_early_beats()
        if self.progress is not None:
            try:
                await self._heartbeat()
            except SwarmError as e:
                logger.info(f"could not report the last step to the coordinator: {e}")
        try:
            reason = "volunteer stopped" if self.finished_step is None else "the run finished"
            await self.client.leave(self.key, self.run_config.run_id, reason=reason)
            self.set_state("left")
        except SwarmError as e:
            logger.warning(
                f"could not tell the coordinator this peer left ({e}); it will show offline shortly"
            )

    # --- accusing and training -----------------------------------------------------------------------

    def accuser(self):
        """Files a validator's evidence against a reducer with the coordinator, which judges it."""

        from swarm.coordinator_client import ACCUSE_IN_FLIGHT_WAIT_S
        from swarm.training.sendercheck import KIND as SENDER_CHECK

        async def accuse(accused: str, evidence, verdict: str) -> None:
            # A sender check's accuser serves the state its judgment downloads at its turn, one at a time
            # (``SenderChecks``): it waits out an earlier accusation. Others give up as before, never piling up.
            patient = getattr(evidence, "kind", None) == SENDER_CHECK
            answer = await self.client.accuse_until_taken(
                self.key,
                self.run_config.run_id,
                accused=accused,
                reason=verdict,
                evidence=evidence.to_bytes(),
                in_flight_wait_s=ACCUSE_IN_FLIGHT_WAIT_S if patient else 0.0,
            )
            logger.warning(
                f"accused {accused}; the coordinator banned {answer.banned_peer}: {answer.verdict}"
            )

        return accuse

    async def acollaborate(self, model, optimizer=None, *, strategy=None, validate=None) -> Collaboration:
        """This joined session's part in training ``model`` from the caller's own loop: a
        ``swarm.training.collaboration.Collaboration`` (its docstring says what it checks and does)."""
        from swarm.training.collaboration import Collaboration

        collab = await Collaboration.start(
            self, model, optimizer, strategy=strategy, validate=validate, stop=self._stop
        )
        self._collaborations.append(collab)
        return collab

    def collaborate(self, model, optimizer=None, *, strategy=None, validate=None) -> Collaboration:
        """``acollaborate`` from a synchronous program whose session runs in the background (``swarm.connect``)."""
        from swarm.training.collaboration import call_on

        work = self.acollaborate(model, optimizer, strategy=strategy, validate=validate)
        return call_on(self._loop, work, "session.collaborate")

    async def close(self) -> None:
        """Stop the background work and the DHT node (after ``leave``, or instead of it on a ban)."""
        await self._end_early_beats()
        for collab in self._collaborations:
            await collab.close()
        if self._reaching is not None:
            self._reaching.cancel()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None
