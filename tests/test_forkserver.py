"""Children forked from the fork server (``swarm.forkserver``): what reaches them, what comes back, and what
a DHT node forked this way costs. ``lab.testsession`` starts this process's server, as the commands do."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from lab.forked import ForkedCommand
from swarm import dht as dht_module
from swarm import forkserver


class Reporter(mp.Process):
    """Sends what it finds in its process, then exits with ``code`` (or sleeps until it is stopped)."""

    _Popen = staticmethod(forkserver.ForkServerPopen)

    def __init__(self, conn, code: int | None) -> None:
        super().__init__(name="swarm-reporter", daemon=True)
        self.conn, self.code = conn, code

    def run(self) -> None:
        self.conn.send(
            {
                "mark": os.environ.get("SWARM_FORKSERVER_TEST_MARK"),
                "cwd": os.getcwd(),
                "parent": os.getppid(),
                "name": Path("/proc/self/comm").read_text().strip(),
                "torch_imported": "torch" in sys.modules,
            }
        )
        if self.code is None:
            time.sleep(60)
        warnings.warn("a warning from the forked child", UserWarning, stacklevel=1)
        sys.stderr.flush()
        sys.exit(self.code)


def _private_mib(pid: int) -> float:
    fields = dict(line.split()[:2] for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return (int(fields["Private_Clean:"]) + int(fields["Private_Dirty:"])) / 1024


@pytest.mark.timeout(60)
def test_a_forked_child_gets_the_parents_current_environment_and_directory_and_its_exit_code_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert forkserver.running()
    # Set after the server was forked: a child must see the parent as it is now, as a spawned one does.
    monkeypatch.setenv("SWARM_FORKSERVER_TEST_MARK", "now")
    monkeypatch.chdir(tmp_path)
    receive, send = mp.Pipe(duplex=False)
    child = Reporter(send, code=3)
    child.start()
    assert receive.poll(20), "the forked child sent nothing"
    seen = receive.recv()
    child.join(20)
    assert child.exitcode == 3
    assert seen["mark"] == "now" and seen["cwd"] == str(tmp_path)
    assert seen["parent"] == forkserver._server.pid != os.getpid()
    assert seen["name"] == "swarm-reporter" and seen["torch_imported"]


@pytest.mark.timeout(60)
def test_a_forked_child_writes_where_its_parent_writes_now_and_shows_its_warnings(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The server copy was made before this test's capture began; a spawned child would write into it,
    # and would show a warning as a fresh interpreter does, not into a recorder of pytest's.
    receive, send = mp.Pipe(duplex=False)
    child = Reporter(send, code=0)
    child.start()
    child.join(20)
    assert child.exitcode == 0
    assert "UserWarning: a warning from the forked child" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_a_forked_child_that_is_terminated_reports_the_signal() -> None:
    receive, send = mp.Pipe(duplex=False)
    child = Reporter(send, code=None)
    child.start()
    assert receive.poll(20)
    assert child.is_alive()
    child.terminate()
    child.join(20)
    assert child.exitcode == -signal.SIGTERM and not child.is_alive()


@pytest.mark.timeout(120)
def test_a_dht_node_forked_from_the_server_serves_records_and_shares_the_servers_pages(
    tmp_path: Path,
) -> None:
    from hivemind.utils import get_dht_time

    nodes = dht_module.start_local_dhts(2, tmp_path)
    try:
        (first, _), (second, _) = nodes
        assert first.store("forked", b"yes", get_dht_time() + 60)
        found = second.get("forked", latest=True)
        assert found is not None and found.value == b"yes"
        for node, _ in nodes:
            assert Path(f"/proc/{node.pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(
                forkserver._server.pid
            )
            # A spawned DHT process holds about 180 MiB of its own (its own torch and hivemind); a
            # forked one shares those pages with the server.
            assert _private_mib(node.pid) < 80, (
                f"the DHT process holds {_private_mib(node.pid):.0f} MiB of its own"
            )
    finally:
        for node, _ in nodes:
            node.shutdown()
    for node, _ in nodes:
        node.join(20)
        assert node.exitcode == 0


@pytest.mark.timeout(120)
def test_a_process_already_running_threads_spawns_its_dht_node_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forkserver, "_server", None)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    try:
        assert not forkserver.start() and not forkserver.running()
        [(node, _)] = dht_module.start_local_dhts(1, tmp_path)
    finally:
        stop.set()
    try:
        assert node.is_alive() and node._popen.method == "spawn"
        assert Path(f"/proc/{node.pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())
    finally:
        node.shutdown()


@pytest.mark.timeout(60)
def test_a_forked_command_leads_its_own_session_writes_its_log_and_exits_as_its_command_line_would(
    tmp_path: Path,
) -> None:
    log = tmp_path / "pause.log"
    command = ForkedCommand(
        ["-m", "peer.cli", "pause", "--identity", str(tmp_path / "nobody.key")],
        log_path=log, env={**os.environ, "HOME": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    # Already the leader of its own session, so that a group kill reaches it and what it starts.
    assert command.poll() is not None or os.getsid(command.pid) == command.pid
    assert command.wait(30) == 2  # what `swarm-peer pause` exits with when no peer runs
    text = log.read_text()
    assert "no running peer uses identity" in text and "nobody.key" in text


@pytest.mark.timeout(60)
def test_a_plain_fork_of_a_process_with_a_fork_server_does_not_share_it() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker or multiprocessing's fork context would be such a child
        os.write(write, b"1" if forkserver.running() else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"0"
    os.close(read)
    os.waitpid(pid, 0)
    # The parent's own server is untouched by the child's exit.
    receive, send = mp.Pipe(duplex=False)
    child = Reporter(send, code=0)
    child.start()
    assert receive.poll(20)
    child.join(20)
    assert child.exitcode == 0


def _children_named(parent: int, name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, fields = stat.split("(", 1)[1].rsplit(")", 1)
            if comm == name and int(fields.split()[1]) == parent and fields.split()[0] != "Z":
                found.append(int(entry.name))
    return found


@pytest.mark.timeout(60)
def test_a_request_interrupted_before_its_answer_leaves_the_server_in_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = forkserver._server
    real_receive = forkserver._receive
    interrupted: list[bool] = []

    def receive(sock, size):  # Ctrl-C (or a test's timeout) lands once the request is sent
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_receive(sock, size)

    monkeypatch.setattr(forkserver, "_receive", receive)
    with pytest.raises(KeyboardInterrupt):
        Reporter(mp.Pipe(duplex=False)[1], code=None).start()
    monkeypatch.setattr(forkserver, "_receive", real_receive)
    # The same server goes on, and the next child gets its own answer, not the interrupted one's.
    assert forkserver.running() and forkserver._server is server
    receive_report, send = mp.Pipe(duplex=False)
    child = Reporter(send, code=5)
    child.start()
    child.join(20)
    assert child.exitcode == 5 and receive_report.poll(5)
    assert receive_report.recv()["parent"] == server.pid
    # The interrupted request's child, which nobody tracks, was ended (it would have slept 60 s).
    deadline = time.monotonic() + 10
    while _children_named(server.pid, "swarm-reporter") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children_named(server.pid, "swarm-reporter")


class LockHolder(mp.Process):
    """Takes hivemind's process-wide future-update lock, says so, and waits to be killed holding it."""

    _Popen = staticmethod(forkserver.ForkServerPopen)

    def __init__(self, conn) -> None:
        super().__init__(name="swarm-lockhold", daemon=True)
        self.conn = conn

    def run(self) -> None:
        from hivemind.utils.mpfuture import MPFuture

        MPFuture._update_lock.acquire()
        self.conn.send("holding")
        time.sleep(60)


@pytest.mark.timeout(120)
def test_a_forked_child_killed_holding_hiveminds_lock_does_not_stall_the_next_dht_node(
    tmp_path: Path,
) -> None:
    # hivemind makes its locks at import; forks of one process shared them, so a DHT process killed
    # while it sent a future's update (a test's kill, a churned peer) stalled every later one.
    receive, send = mp.Pipe(duplex=False)
    holder = LockHolder(send)
    holder.start()
    assert receive.poll(20) and receive.recv() == "holding"
    holder.kill()
    holder.join(20)
    nodes = dht_module.start_local_dhts(1, tmp_path)  # ready means its process sent the ready future
    for node, _ in nodes:
        node.shutdown()
