"""The coordinator node: DHT bootstrap peer, gRPC service, SQLite record, the liveness sweeper, the
metrics history and (with ``dashboard_port``) the web dashboard.

Example::

    node = CoordinatorNode(CoordinatorConfig(host="127.0.0.1", port=0, dht_port=0), RunConfig.demo())
    await node.start()
    print(node.address, node.dht_initial_peers)
    await node.stop()
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import time
from pathlib import Path

import grpc

from coordinator.checkpoints import CheckpointKeeper
from coordinator.config import CoordinatorConfig
from coordinator.contributions import PeerContributionStates
from coordinator.dashboard import Dashboard
from coordinator.datadir import STORE_FILE, DataDirLock
from coordinator.dialback import DialBackService
from coordinator.limits import ServiceLimits
from coordinator.metrics import MetricsLogger, history_point, run_snapshot
from coordinator.roundinputs import PeerRoundInputs
from coordinator.service import CoordinatorService
from coordinator.standing import Standing
from coordinator.store import Store
from protocols.errors import ConfigError, NetworkError
from swarm.bans import MAX_BANNED, publish_ban_list
from swarm.components import check_components
from swarm.config import RunConfig
from swarm.dht import start_dht, visible_maddrs
from swarm.identity import load_or_create_identity
from swarm.keyspace import RunValidator
from swarm.rpc import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

ENDPOINT_FILE = "endpoint.json"
SOCKET_FILE = "coordinator.sock"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


BAN_LIST_INTERVAL_S = 2.0
# The longest a running peer waits between attempts to reach a coordinator that was down (swarm-peer's
# default --max-retry-interval-s), plus a few of its heartbeat intervals.
RECONNECT_GRACE_S = 35.0
# A banned peer's certificate is never renewed; once it has expired by this much (clock skew between
# peers), no peer accepts it and the published list no longer needs to name it.
BAN_CERT_GRACE_S = 600.0


class CoordinatorNode:
    """A whole coordinator: DHT bootstrap peer, gRPC service, store, sweeper, checkpoints, dashboard.

    Args:
        config: where and how it listens (host, ports, data dir, identity, dashboard).
        run: the run it serves; its components are checked against this machine's registries at start.
        limits: the service's per-caller limits (default: ``ServiceLimits()``).
    """

    def __init__(self, config: CoordinatorConfig, run: RunConfig, limits: ServiceLimits | None = None):
        self.config = config
        self.run = run
        self.limits = limits or ServiceLimits()
        self.address = ""
        self.coordinator_peer_id = ""
        self.dht_initial_peers: list[str] = []
        self._dht = None
        self._store: Store | None = None
        self._lock: DataDirLock | None = None
        self._server: grpc.aio.Server | None = None
        self._service: CoordinatorService | None = None
        self._sweeper: asyncio.Task | None = None
        self._checkpoints: asyncio.Task | None = None
        self._history: asyncio.Task | None = None
        self._bans: asyncio.Task | None = None
        self._metrics_logger: MetricsLogger | None = None
        self.dashboard: Dashboard | None = None
        self.keeper: CheckpointKeeper | None = None

    async def start(self) -> None:
        config, run = self.config, self.run
        data_dir = config.data_path
        await asyncio.to_thread(check_components, run)
        self._lock = DataDirLock.acquire(data_dir)
        try:
            await self._start(config, run, data_dir)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            raise

    async def _start(self, config: CoordinatorConfig, run: RunConfig, data_dir: Path) -> None:
        key = await asyncio.to_thread(load_or_create_identity, config.identity_path)
        self.coordinator_peer_id = key.peer_id
        if run.coordinator_key is not None and run.coordinator_key != key.peer_id:
            raise ConfigError(
                f"run config pins coordinator_key {run.coordinator_key}, but identity {config.identity_path} "
                f"is {key.peer_id}"
            )
        self._store = await asyncio.to_thread(
            Store.open_sync,
            data_dir / STORE_FILE,
            run.run_id,
            # A peer may overshoot the target batch by up to one micro-batch before its round starts.
            max_samples_per_step=float(run.training.target_batch_size + run.training.micro_batch_size),
            max_verified_steps_per_s=run.training.max_verified_steps_per_s,
        )
        try:
            self._dht = await asyncio.to_thread(
                start_dht,
                key,
                config.identity_path,
                host=config.host,
                port=config.dht_port,
                initial_peers=[],
                upnp=config.upnp,
                validators=[RunValidator(run.run_id, key.public_key, stages=run.pipeline.stages)],
            )
            self.dht_initial_peers = visible_maddrs(self._dht)
            standing = Standing(self._store)  # one for the heartbeat answers and the keeper's catch-up
            keeper = self.keeper = CheckpointKeeper(run, self._dht, key, data_dir / "checkpoints", standing)
            await keeper.start()
            self._store.follow_checkpoints(
                lambda: keeper.latest.step if keeper.latest else None, run.training.checkpoint_every_steps
            )
            service = CoordinatorService(
                run, key, self._store, self.dht_initial_peers, self.limits,
                holds_checkpoint=lambda: keeper.latest is not None or bool(keeper.stages),
                finished_step=lambda: keeper.finished_step,
                checkpoint_step=lambda: keeper.latest.step if keeper.latest else None,
                outside_dht=keeper.outside_dht, stage_checkpoint=lambda stage: keeper.stages.get(stage),
                stage_states=keeper.recent, round_inputs=PeerRoundInputs(keeper.p2p), standing=standing,
                contribution_states=PeerContributionStates(run, keeper.p2p),
            )  # fmt: skip
            self._service = service
            # grpc sets SO_REUSEPORT by default: a second server on a used port would bind and the kernel
            # would split the clients between the two.
            self._server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
            self._server.add_generic_rpc_handlers(
                (service.generic_handler(), DialBackService().generic_handler())
            )
            bind = _host_port(config.host, config.port)
            try:
                port = self._server.add_insecure_port(bind)
            except RuntimeError as e:
                port, reason = 0, str(e)
            else:
                reason = "the port is in use or the address is not local"
            if port == 0:
                raise NetworkError(f"cannot serve gRPC on {bind}: {reason}")
            # The same service on a socket file in the data dir, for tools on this machine: it reaches
            # a coordinator in another network namespace (the WAN lab), where no route may lead.
            self.socket_path.unlink(missing_ok=True)
            try:
                socket_bound = self._server.add_insecure_port(f"unix:{self.socket_path}") != 0
            except RuntimeError:  # a path too long for a socket address, for one
                socket_bound = False
            await self._server.start()
            if socket_bound:
                os.chmod(self.socket_path, 0o600)
            else:
                logger.warning(f"not serving on the socket {self.socket_path}: grpc could not bind it")
            if config.log_to != "none":
                self._metrics_logger = await asyncio.to_thread(
                    MetricsLogger, config.log_to, config.log_path, run.run_id
                )
            if config.dashboard_port is not None:
                self.dashboard = Dashboard(
                    self.snapshot, host=config.dashboard_host or config.host, port=config.dashboard_port
                )
                await self.dashboard.start()
        except BaseException:
            await self.stop()
            raise
        unspecified = ipaddress.ip_address(config.host).is_unspecified
        self.address = _host_port("127.0.0.1" if unspecified else config.host, port)
        self._sweeper = asyncio.create_task(self._sweep_offline())
        self._checkpoints = asyncio.create_task(keeper.run_forever())
        self._history = asyncio.create_task(self._record_history())
        self._bans = asyncio.create_task(self._publish_bans(key))
        self._write_endpoint(key.peer_id)
        logger.info(f"coordinator {key.peer_id} serves run {run.run_id!r} on {_host_port(config.host, port)}")
        logger.info(f"DHT initial peers: {' '.join(self.dht_initial_peers)}")

    @property
    def socket_path(self) -> Path:
        return self.config.data_path / SOCKET_FILE

    def _write_endpoint(self, peer_id: str) -> None:
        endpoint = {
            "address": self.address,
            "run_id": self.run.run_id,
            "coordinator_peer_id": peer_id,
            "dht_initial_peers": self.dht_initial_peers,
            "pid": os.getpid(),
            "dashboard_url": self.dashboard.url if self.dashboard else None,
            "socket": f"unix:{self.socket_path}" if self.socket_path.exists() else None,
        }
        path = self.config.data_path / ENDPOINT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(endpoint, indent=2))
        tmp.replace(path)

    async def _sweep_offline(self) -> None:
        membership = self.run.membership
        interval_s = min(1.0, membership.heartbeat_interval_s)
        # After a restart the record still holds the peers seen before it, whose heartbeats stopped only
        # because this node was down: they get until they can have reconnected before one is offline.
        started = time.time()
        while True:
            await asyncio.sleep(interval_s)
            try:
                now = time.time()
                seen_since = started if now - started < RECONNECT_GRACE_S else 0.0
                silent_since = now - membership.offline_after_s
                for peer_id in await self._store.mark_offline(silent_since, seen_since=seen_since):
                    logger.info(f"{peer_id} is offline: no heartbeat for {membership.offline_after_s:.0f}s")
            except Exception:
                logger.exception("liveness sweep failed; retrying")

    async def _publish_bans(self, key) -> None:
        """Keep the signed ban list in the DHT current, bans made by `swarm-coordinator ban` included.

        It names every banned peer that may still hold a valid certificate; past what a list can hold it
        keeps convictions before false accusers' self-bans, the newest first (``coordinator.banlist``).
        ``changed_at`` moves only when the names do."""
        interval_s = min(BAN_LIST_INTERVAL_S, self.run.membership.heartbeat_interval_s)
        ttl_s = 10 * interval_s + 30
        published: frozenset[str] | None = None
        changed_at = published_at = time.time()
        while True:
            try:
                banned = await self._store.enforced_bans(time.time(), grace_s=BAN_CERT_GRACE_S)
                if len(banned) > MAX_BANNED:
                    logger.error(
                        f"{len(banned)} banned peers hold unexpired certificates; the ban list names the "
                        f"{MAX_BANNED} convictions and newest bans first (a shorter certificate_ttl_s shortens the list)"
                    )
                    banned = banned[:MAX_BANNED]
                changed = published is None or frozenset(banned) != published
                if changed and published is not None:
                    changed_at = max(time.time(), changed_at + 1e-3)
                # An unchanged list is only refreshed before it expires: a long one is many records.
                due = changed or time.time() - published_at > ttl_s / 3
                if due and await publish_ban_list(
                    self._dht, key, self.run.run_id, banned, changed_at=changed_at, ttl_s=ttl_s
                ):
                    published, published_at = frozenset(banned), time.time()
            except Exception:
                logger.exception("publishing the ban list failed; retrying")
            await asyncio.sleep(interval_s)

    async def snapshot(self) -> dict:
        """The run as ``/api/status`` serves it."""
        latest = self.keeper.latest if self.keeper else None
        return await run_snapshot(
            self._store, self.run, self.coordinator_peer_id,
            checkpoint_step=latest.step if latest else None,
            finished_step=self.keeper.finished_step if self.keeper else None,
            outside_dht=self.keeper.outside_dht if self.keeper else None,
        )  # fmt: skip

    async def _record_history(self) -> None:
        """Sample the run (loss, throughput, peers online) from the peers' latest heartbeats."""
        while True:
            await asyncio.sleep(self.config.history_interval_s)
            try:
                point = history_point(await self._store.list_peers(), time.time())
                await self._store.append_history(point)
                if self._metrics_logger is not None:
                    await asyncio.to_thread(self._metrics_logger.log, point)
            except Exception:
                logger.exception("recording the metrics history failed; retrying")

    async def stop(self) -> None:
        for task in (self._sweeper, self._checkpoints, self._history, self._bans):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = self._checkpoints = self._history = self._bans = None
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
        if self._metrics_logger is not None:
            await asyncio.to_thread(self._metrics_logger.close)
            self._metrics_logger = None
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
        if self._service is not None:  # judgments outlive their calls: end them before the store closes
            await self._service.close()
            self._service = None
        if self._dht is not None:
            await asyncio.to_thread(self._dht.shutdown)
            self._dht = None
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None
        for path in (self.config.data_path / ENDPOINT_FILE, self.socket_path):
            with contextlib.suppress(OSError):
                path.unlink()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
