"""Rehearse a swarm on one machine: a coordinator and peers as separate processes on loopback.

Used by the demo script and the tests. Every child runs in its own session so that ``kill_all`` also
reaps its DHT process and p2p daemon; every wait is bounded. A process that started its fork server
with the commands' modules (``COMMAND_MODULES``) forks its coordinators and peers from it
(``lab.forked``) instead of starting an interpreter for each.

Example::

    local = LocalSwarm(Path("/tmp/rehearsal"))
    coordinator = local.start_coordinator()
    local.start_peer(coordinator.extra["address"], "peer0")
    print(peer_states(coordinator.extra["address"]))
    local.kill_all()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lab.forked import ForkedCommand, forkable
from protocols.errors import SwarmError
from swarm.config import MembershipConfig, RunConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.forkserver import ForkServerError

if TYPE_CHECKING:
    from coordinator.node import CoordinatorNode

T = TypeVar("T")
# The checkout or install that holds the packages, so children import the same code.
ROOT = Path(__file__).resolve().parents[1]

# What a rehearsal preloads in its fork server (``swarm.forkserver.start``) to fork its commands from it.
COMMAND_MODULES = ("peer.cli", "coordinator.cli", "swarm.dht")

# Fast liveness so a rehearsal sees offline peers within seconds; real runs use the defaults.
FAST_MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.5, offline_after_s=3.0, certificate_ttl_s=600.0)


def tiny_run(run_id: str = "test-run", **training: object) -> RunConfig:
    """A run small enough that several peers train it on a 2-core machine in seconds per step."""
    return RunConfig(
        run_id=run_id,
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 32}},
        dataset={"name": "stdlib", "config": {"max_bytes": 1_000_000}},
        optimizer={"lr": 3e-3, "warmup_steps": 2, "total_steps": 200},
        training={"target_batch_size": 32, "micro_batch_size": 4, "matchmaking_time_s": 1.0,
                  "progress_interval_s": 0.3, "validation_every_steps": 5, **training},
        membership=FAST_MEMBERSHIP,
    )  # fmt: skip


def wait_until(predicate: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


@contextlib.asynccontextmanager
async def running_coordinator(run: RunConfig, data_dir: Path) -> AsyncIterator[CoordinatorNode]:
    """A coordinator node in this process on loopback (any free ports), stopped on exit."""
    from coordinator.config import CoordinatorConfig
    from coordinator.node import CoordinatorNode

    node = CoordinatorNode(CoordinatorConfig(host="127.0.0.1", port=0, dht_port=0, data_dir=data_dir), run)
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    """A child process with its combined output in a log file."""

    name: str
    process: subprocess.Popen | ForkedCommand
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def group_alive(self) -> bool:
        """Whether any process of this child's process group (its DHT process, p2p daemon) still runs."""
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{self.name} did not exit within {timeout_s:.0f}s:\n{self.output()[-3000:]}"
            ) from None


# Run by the reaper: it learns each child's process group (and each WAN lab namespace) on stdin; when
# stdin closes without "done" (the rehearsal died, even by SIGKILL), it kills them all and removes those.
_REAPER = """
import os, signal, subprocess, sys
groups, namespaces = [], []
for line in sys.stdin:
    word, _, arg = line.strip().partition(" ")
    if word == "done":
        sys.exit(0)
    elif word == "group":
        groups.append(int(arg))
    elif word == "netns":
        namespaces.append(arg)
    elif word == "forget" and arg in namespaces:
        namespaces.remove(arg)
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
for name in reversed(namespaces):
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=20)
"""


class Reaper:
    """A watchdog process that kills every registered process group if this process dies first.

    Children run in their own sessions (so a group kill also takes their DHT process and p2p daemon),
    which means they would outlive a rehearsal killed outright. The reaper runs in a session of its own
    too, holding the read end of a pipe only this process writes to: the pipe closes when this process
    dies, however it dies, and the reaper then kills every group it was told about."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def watch(self, group: int) -> None:
        self._tell(f"group {group}")

    def watch_netns(self, name: str) -> None:
        """Remove network namespace ``name`` if this process dies before removing it itself."""
        self._tell(f"netns {name}")

    def forget_netns(self, names: list[str]) -> None:
        for name in names:
            self._tell(f"forget {name}")

    def _tell(self, line: str) -> None:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _REAPER], stdin=subprocess.PIPE, start_new_session=True, text=True
            )
        assert self._process.stdin is not None
        self._process.stdin.write(f"{line}\n")
        self._process.stdin.flush()

    def release(self) -> None:
        """Every group is already reaped: let the reaper exit without killing anything."""
        if self._process is None:
            return
        with contextlib.suppress(BrokenPipeError, ValueError):
            assert self._process.stdin is not None
            self._process.stdin.write("done\n")
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        self._process = None


class LocalSwarm:
    """Starts coordinators and peers as separate processes under ``root``; ``kill_all`` reaps them.

    Every child dies with this process, even when it is killed outright (see :class:`Reaper`)."""

    def __init__(self, root: Path):
        self.root = root
        self.children: list[Child] = []
        self.env = {**os.environ, "HOME": str(root / "home"), "PYTHONUNBUFFERED": "1"}
        self.reaper = Reaper()

    def spawn(self, name: str, args: list[str], *, prefix: Sequence[str] = ()) -> Child:
        """Start ``python ARGS`` (after ``prefix``, such as a WAN lab host's ``ip netns exec NS``)."""
        log_path = self.root / f"{name}.log"
        process: subprocess.Popen | ForkedCommand | None = None
        if not prefix and forkable(args):
            try:
                process = ForkedCommand(args, log_path=log_path, env=self.env, cwd=ROOT)
            except ForkServerError as e:
                print(f"starting {name} anew: {e}", file=sys.stderr)
        if process is None:
            log = open(log_path, "ab")  # noqa: SIM115 - owned by the child until it exits
            process = subprocess.Popen(
                [*prefix, sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
            log.close()
        self.reaper.watch(process.pid)
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def write_config(self, run: RunConfig, name: str = "run.toml") -> Path:
        path = self.root / name
        run.to_toml(path)
        return path

    def start_coordinator(
        self,
        run: RunConfig | None = None,
        *,
        name: str = "coordinator",
        port: int = 0,
        data_dir: Path | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 60.0,
    ) -> Child:
        """A coordinator process on ``host``; returns once it serves, with its ``endpoint.json`` (address,
        DHT peers, the dashboard's URL when ``extra_args`` turns it on) in ``child.extra``."""
        run = run or tiny_run()
        data_dir = data_dir or self.root / f"{name}-data"
        endpoint = data_dir / "endpoint.json"
        endpoint.unlink(missing_ok=True)
        child = self.spawn(
            name,
            ["-m", "coordinator.cli", "start", "--config", str(self.write_config(run, f"{name}.toml")),
             "--host", host, "--port", str(port), "--dht-port", "0", "--data-dir", str(data_dir), *extra_args],
            prefix=prefix,
        )  # fmt: skip

        def ready() -> dict | None:
            if child.process.poll() is not None:
                raise SwarmError(f"{name} exited with {child.process.returncode}:\n{child.output()}")
            return json.loads(endpoint.read_text()) if endpoint.exists() else None

        child.extra.update(
            wait_until(ready, timeout_s=ready_timeout_s, what=f"{name} to serve"), data_dir=data_dir
        )
        return child

    def start_peer(
        self,
        coordinator_address: str,
        name: str,
        *extra_args: str,
        device: Literal["cpu", "gpu"] = "cpu",
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        leave_when_finished: bool = False,
    ) -> Child:
        """A volunteer process; unless ``leave_when_finished``, it stays after the run finishes, so that a
        rehearsal reads every peer's end state."""
        stay = [] if leave_when_finished else ["--no-leave-when-finished"]
        child = self.spawn(
            name,
            ["-m", "peer.cli", "join", "--coordinator", coordinator_address, f"--{device}", "--host", host,
             "--name", name, "--identity", str(self.root / f"{name}.key"),
             "--known-coordinators", str(self.root / f"{name}-known.json"), "--max-cpu-threads", "1",
             *stay, *extra_args],
            prefix=prefix,
        )  # fmt: skip
        child.extra["identity"] = self.root / f"{name}.key"
        return child

    def kill_all(self) -> None:
        for child in self.children:
            # The whole group: a peer's DHT process and p2p daemon may outlive a killed leader.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait(timeout=10)
        self.reaper.release()


def status(address: str, run_id: str = "") -> Any:
    async def fetch() -> Any:
        async with CoordinatorClient(address, timeout_s=5) as client:
            return await client.full_status(run_id)

    return asyncio.run(fetch())


def peer_states(address: str) -> dict[str, str]:
    return {p.name: p.state for p in status(address).peers}
