"""Nothing a rehearsal starts outlives it, and a stopping process is gone within seconds.

A test harness's timeout kills ``swarm-sim`` with SIGKILL; before the reaper, its coordinator, peers,
DHT processes and p2p daemons were orphaned and kept using CPU for the best part of an hour.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's bookkeeping remains


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_swarm_sim_killed_outright_takes_its_whole_swarm_with_it(tmp_path: Path) -> None:
    sim = subprocess.Popen(
        [sys.executable, "-m", "lab.sim", "--peers", "2", "--steps", "100000", "--model-size", "tiny",
         "--timeout-s", "600"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    survivors: set[int] = set()
    logs: Path | None = None
    try:
        assert sim.stdout is not None
        header = sim.stdout.readline()
        logs = Path(re.search(r"\(logs in ([^;)]+)", header).group(1))
        deadline = time.monotonic() + 150
        while not all(
            (logs / f"peer{i}.log").exists() and "joined run" in (logs / f"peer{i}.log").read_text()
            for i in range(2)
        ):
            assert sim.poll() is None, f"swarm-sim exited early with {sim.returncode}"
            assert time.monotonic() < deadline, "the peers did not join in time"
            time.sleep(0.5)
        time.sleep(3)  # the peers start their DHT processes and p2p daemons after joining
        swarm = _descendants(sim.pid)
        commands = [_command(pid) for pid in swarm]
        # The coordinator and peers are forked from the rehearsal's fork server, their DHT processes from
        # their own: each carries the command line it was forked from, and a name of its own.
        names = [_name(pid) for pid in swarm]
        assert names.count("swarm-peer") == 2 and names.count("swarm-coord") == 1, names
        assert names.count("swarm-forksrv") == 4 and names.count("swarm-dht") == 3, names
        assert any("p2pd" in c for c in commands), commands

        os.kill(sim.pid, signal.SIGKILL)
        sim.wait(timeout=10)
        deadline = time.monotonic() + 20
        while (survivors := {pid for pid in swarm if _alive(pid)}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not survivors, "still running after swarm-sim was killed:\n" + "\n".join(
            _command(pid) for pid in survivors
        )
    finally:
        for pid in _descendants(sim.pid) | survivors:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if sim.poll() is None:
            sim.kill()
            sim.wait(timeout=10)
        if logs is not None:  # killed outright, swarm-sim could not remove its run's directory
            shutil.rmtree(logs, ignore_errors=True)


@pytest.mark.timeout(60)
def test_a_stop_signal_ends_the_process_even_when_its_shutdown_hangs() -> None:
    script = textwrap.dedent(
        """
        import asyncio, time
        from swarm import runtime

        async def main():
            stop = runtime.stop_event_on_signals(exit_deadline_s=2.0)
            print("ready", flush=True)
            await stop.wait()
            await asyncio.to_thread(time.sleep, 60)  # a shutdown step that never returns (a hung DHT)

        runtime.run(main())
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        assert code == 128 + signal.SIGTERM
        assert time.monotonic() - started < 15
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
