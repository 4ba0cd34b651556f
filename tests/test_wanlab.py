"""The WAN lab: links capped by the kernel, hosts behind NAT that dial out and cannot be dialed, and
namespaces that never outlive the process that made them. These tests need root (CI runs as root)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lab.localswarm import LocalSwarm, Reaper, tiny_run
from lab.wanlab import NETNS_DIR, LinkSpec, WanLab, check_lab_possible, peak_mbit
from protocols.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 5001))
server.settimeout(30)
print("listening", flush=True)
conn, peer = server.accept()
total, first = 0, None
while chunk := conn.recv(1 << 16):
    first = first or time.monotonic()
    total += len(chunk)
print(total, time.monotonic() - first, peer[0], flush=True)
"""

SENDER = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 5001), timeout=5)
block, deadline = b"x" * (1 << 16), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    conn.sendall(block)
conn.close()
"""


def _in(lab: WanLab, host: int, script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [*lab.exec_prefix(host), sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs,
    )  # fmt: skip


def _transfer(lab: WanLab, sender: int, receiver: int, seconds: float) -> tuple[float, str]:
    """(Mbit/s the receiver saw, the source address it saw) for a bulk TCP flow."""
    server = _in(lab, receiver, RECEIVER, lab.host(receiver).address)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        client = _in(lab, sender, SENDER, lab.host(receiver).address, str(seconds))
        client.wait(timeout=seconds + 30)
        total, elapsed, source = server.communicate(timeout=30)[0].split()
    finally:
        for process in (server,):
            if process.poll() is None:
                process.kill()
    return int(total) * 8 / float(elapsed) / 1e6, source


@pytest.fixture(autouse=True)
def _root_only() -> None:
    try:
        check_lab_possible()
    except ConfigError as e:
        pytest.fail(f"the WAN lab tests need what CI has: {e}")


@pytest.mark.parametrize(("up", "down", "expected"), [(4.0, 16.0, 4.0), (16.0, 4.0, 4.0)])
def test_the_kernel_holds_a_flow_to_the_tighter_of_upload_and_download(
    up: float, down: float, expected: float
):
    with WanLab(hosts=2, link=LinkSpec(up_mbit=up, down_mbit=down)) as lab:
        sent_before = lab.link_bytes(1)[0]
        rate, _ = _transfer(lab, sender=1, receiver=2, seconds=3.0)
        sent = lab.link_bytes(1)[0] - sent_before
    assert 0.7 * expected <= rate <= 1.1 * expected, f"{rate:.2f} Mbit/s through a {expected} Mbit/s cap"
    assert sent >= 3.0 * 0.7 * expected * 1e6 / 8  # the lab's own counters saw the flow leave host 1


def test_a_host_behind_nat_dials_out_and_cannot_be_dialed():
    with WanLab(hosts=2, nat=1) as lab:
        natted = lab.host(2)
        assert natted.behind_nat and not lab.host(1).behind_nat
        _, source = _transfer(lab, sender=2, receiver=1, seconds=0.5)
        assert source == "10.77.2.2", "host 1 sees the NAT box's public address, not the private one"

        server = _in(lab, 2, RECEIVER, natted.address)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            for target in (natted.address, "10.77.2.2"):
                probe = subprocess.run(
                    [*lab.exec_prefix(1), sys.executable, "-c",
                     f"import socket; socket.create_connection(({target!r}, 5001), timeout=3)"],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert probe.returncode != 0, f"host 1 reached the NATed host at {target}"
        finally:
            server.kill()
            server.wait(timeout=10)


def test_a_lab_killed_outright_leaves_no_namespace(tmp_path: Path):
    script = textwrap.dedent(
        """
        import time
        from lab.localswarm import Reaper
        from lab.wanlab import LinkSpec, WanLab
        lab = WanLab(hosts=2, nat=1, link=LinkSpec(up_mbit=10), reaper=Reaper())
        lab.up()
        print(lab.prefix, flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert owner.stdout is not None
        prefix = owner.stdout.readline().strip()
        assert prefix.startswith("swl-"), prefix
        assert (
            len([n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)]) == 4
        )  # router, 2 hosts, 1 NAT box
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        while [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)


def test_the_lab_says_it_needs_root(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="needs root"):
        WanLab(hosts=1).up()


def test_link_specs_name_what_is_wrong():
    assert LinkSpec.parse("up=20mbit,down=100mbit") == LinkSpec(up_mbit=20.0, down_mbit=100.0)
    assert LinkSpec.parse("up=500kbit") == LinkSpec(up_mbit=0.5)
    with pytest.raises(ConfigError, match="'up=fast'"):
        LinkSpec.parse("up=fast")


def test_a_lab_removes_its_namespaces_on_exit():
    reaper = Reaper()
    with WanLab(hosts=1, reaper=reaper) as lab:
        names = [n for n in os.listdir(NETNS_DIR) if n.startswith(lab.prefix)]
        assert len(names) == 2
    assert not [n for n in os.listdir(NETNS_DIR) if n.startswith(lab.prefix)]
    reaper.release()


def _lab_status(lab: WanLab, address: str) -> dict:
    """The coordinator's status, asked from inside the lab (the machine's own namespace has no route in)."""
    try:
        done = subprocess.run(
            [*lab.exec_prefix(1), sys.executable, "-m", "coordinator.cli", "status", "--coordinator", address, "--json"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:  # a loaded machine; the caller asks again until its own deadline
        return {"peers": []}
    return json.loads(done.stdout) if done.returncode == 0 else {"peers": []}


class _Sampler:
    """Each peer's upload counter every half second, read from the kernel in the peer's uplink namespace."""

    def __init__(self, lab: WanLab, hosts: list[int]):
        self.lab, self.hosts, self.samples = lab, hosts, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append((time.monotonic(), {k: self.lab.link_bytes(k)[0] for k in self.hosts}))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_peers_on_capped_links_one_behind_nat_train_to_identical_parameters(tmp_path: Path):
    run = tiny_run("wan-run", max_steps=3, min_group_size=3)
    local = LocalSwarm(tmp_path)
    lab = WanLab(hosts=4, nat=1, link=LinkSpec(up_mbit=20, down_mbit=100), reaper=local.reaper)
    sampler = None
    try:
        lab.up()
        coordinator = local.start_coordinator(run, host=lab.host(1).address, prefix=lab.exec_prefix(1))
        address = coordinator.extra["address"]
        peers = [
            local.start_peer(address, f"peer{k}", host=lab.host(k).address, prefix=lab.exec_prefix(k))
            for k in (2, 3, 4)
        ]
        sampler = _Sampler(lab, [2, 3, 4])
        deadline = time.monotonic() + 300
        while True:
            status = _lab_status(lab, address)
            online = [p for p in status["peers"] if p["state"] == "online"]
            if len(online) == 3 and all(p["step"] >= 3 for p in online):
                break
            for peer in peers:
                assert peer.process.poll() is None, peer.output()[-3000:]
            assert time.monotonic() < deadline, (
                f"no step 3 within 300 s: {[(p['name'], p['step']) for p in online]}"
            )
            time.sleep(3)
        assert len({p["param_hash"] for p in online}) == 1, "peers on capped links, one behind NAT, agree"
        for k in (2, 3, 4):
            assert peak_mbit(sampler.samples, k) <= 20 * 1.1, (
                f"host {k} sent {peak_mbit(sampler.samples, k):.1f} Mbit/s over a 20 Mbit/s cap"
            )
        # The peer behind NAT learned at join that it cannot be dialed (so it never leads a group), and
        # took part in every round reducing no part: it sent its contributions to the two reducers and
        # got the results back over the connections it opened; nobody had to reach it.
        assert "other peers cannot dial this machine" in peers[2].output()
        dialable = {p["name"]: p["metrics"].get("dialable") for p in online}
        assert dialable == {"peer2": 1.0, "peer3": 1.0, "peer4": 0.0}, dialable
        assert "step 3: averaged with 3 peers" in peers[2].output()
        assert "this peer cannot be dialed, so it reduces no part; 2 of 3 members do" in peers[2].output()
        # Nobody had to reach the NAT peer: no failure anywhere names it (a round that fails for another
        # reason, such as a member that fell behind on a loaded machine and never joined it, is repaired
        # and does not bear on NAT).
        nat_id = re.search(r"peer ID (\S+)", peers[2].output()).group(1)
        for peer in peers:
            failures = [line for line in peer.output().splitlines() if "failed in round" in line]
            assert not [line for line in failures if nat_id in line], failures
        assert lab.link_bytes(4)[0] > 0
    finally:
        if sampler is not None:
            sampler.stop.set()
        local.kill_all()
        lab.down()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_10_mbit_link_with_a_large_part_is_not_dropped_as_a_straggler():
    # Two hosts on kernel-capped 10 Mbit/s uplinks average 2M values (each sends 4 MB: about 3.4 s on the
    # wire) with a 2 s round floor. A fixed 2 s deadline cut every round off; the round's deadline now
    # adds the time its bytes take at the members' uplink, and each peer measures that uplink. This is
    # also the smoke run of benchmarks/bench_wan.py --scenario allreduce.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_wan import run_rounds

    # Three rounds, of which at least two must complete: before the fix none did, and one round lost to a
    # loaded machine (one CI run completed 1 of 2) says nothing about the deadline.
    row = run_rounds(2, 2_000_000, 3, 10.0, 100.0, 0, 300, sender_timeout_s=1.0, averaging_timeout_s=2.0)
    assert row["rounds_complete"] >= 2, (row["rounds_complete"], row["warnings"])
    assert row["minimum_s"] > 2.0 and row["round_s"] >= row["minimum_s"], row
    assert all(2 <= mbit <= 10.5 for mbit in row["measured_mbit"]), row
