"""The command lines answer before the heavy imports: ``--help`` and a malformed address never wait for
torch or hivemind (seconds each), so a volunteer's typo is answered at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

# One process runs every command line in turn: any of them importing torch shows in the ones after it.
PROBE = """
import contextlib, io, json, sys
import {module}
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = {module}.main(argv)
        except SystemExit as e:
            code = e.code
    heavy = sorted(m for m in ("torch", "hivemind") if m in sys.modules)
    results.append({{"argv": argv, "code": code, "heavy": heavy, "stderr": err.getvalue()}})
print(json.dumps(results))
"""


def _probe(module: str, *argvs: list[str]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module), json.dumps(argvs)],
        capture_output=True, text=True, timeout=90, env={**os.environ, "HOME": "/nonexistent"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module, argvs",
    [
        ("peer.cli", [["--help"], ["join", "--help"], ["doctor", "--help"]]),
        ("coordinator.cli", [["--help"], ["start", "--help"], ["status", "--help"]]),
        ("lab.sim", [["--help"]]),
    ],
)
def test_help_imports_neither_torch_nor_hivemind(module: str, argvs: list[list[str]]):
    for result in _probe(module, *argvs):
        assert (result["code"], result["heavy"]) == (0, []), result


def test_a_malformed_address_is_refused_before_torch_loads():
    bad = ["run.example.org", "127.0.0.1:99999"]
    results = _probe("peer.cli", *(["join", "--coordinator", address, "--cpu"] for address in bad))
    results += _probe("coordinator.cli", ["status", "--coordinator", "no-port-here"])
    for address, result in zip([*bad, "no-port-here"], results, strict=True):
        assert (result["code"], result["heavy"]) == (2, []), result
        assert f"--coordinator: coordinator address {address!r} is not HOST:PORT" in result["stderr"]


def test_the_status_table_shows_each_peers_step_and_parameter_hash():
    from coordinator.cli import format_status

    peer = {"peer_id": "12D3KooWA", "name": "box", "state": "online", "device": "cpu", "last_seen": 9.0,
            "ban_reason": "", "step": 42, "param_hash": "ab12cd34ef56" + "0" * 52, "diverged": False}  # fmt: skip
    table = format_status(
        {"run_id": "r", "coordinator_peer_id": "c", "dht_initial_peers": [], "server_time": 10.0,
         "peers": [peer, {**peer, "peer_id": "12D3KooWB", "param_hash": "", "step": 0}]}
    )  # fmt: skip
    rows = [line for line in table.splitlines() if line.startswith("  ")]
    assert "step 42" in rows[0] and "params ab12cd34ef56 " in rows[0]
    assert "params -" in rows[1], "a peer that reported no hash yet"


FORK_PROBE = """
import asyncio, os, sys
import {module}  # the entry point, as its console script loads it
import grpc

async def main():
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for _ in range(3):  # as hivemind and torch do while gRPC's threads run
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    await server.stop(0)

asyncio.run(main())
print("forked")
"""


@pytest.mark.parametrize("module", ["peer.cli", "coordinator.cli", "lab.sim"])
def test_forking_after_grpc_starts_prints_no_grpc_notice(module: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    done = subprocess.run(
        [sys.executable, "-c", FORK_PROBE.format(module=module)],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and "forked" in done.stdout, done.stderr
    assert "fork_posix" not in done.stderr and "skipping fork() handlers" not in done.stderr, done.stderr
