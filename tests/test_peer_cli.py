"""The volunteer's command line: clear failures before anything joins, and certificate renewal."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab.localswarm import running_coordinator
from protocols.keys import SigningKey
from swarm.config import MembershipConfig, RunConfig
from swarm.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.timeout(120)


def run_peer(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", *args],
        capture_output=True, text=True, timeout=60, env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_gpu_flag_without_cuda_fails_clearly(tmp_path: Path):
    result = run_peer(
        "--coordinator", "127.0.0.1:9", "--gpu", "--identity", str(tmp_path / "id.key"), home=tmp_path
    )
    assert result.returncode == 2
    assert "--gpu was given but no CUDA device is usable" in result.stderr
    assert "--cpu" in result.stderr, "the message tells the volunteer what to do instead"


def test_bad_flags_name_the_flag(tmp_path: Path):
    result = run_peer("--coordinator", "nohost", "--cpu", home=tmp_path)
    assert result.returncode != 0 and "not HOST:PORT" in result.stderr
    result = run_peer("--coordinator", "127.0.0.1:9", "--port", "70000", home=tmp_path)
    assert result.returncode == 2 and "--port" in result.stderr


def test_heartbeats_renew_the_certificate_before_it_expires(tmp_path: Path):
    membership = MembershipConfig(heartbeat_interval_s=0.5, offline_after_s=3.0, certificate_ttl_s=10.0)
    run = RunConfig(run_id="renewal", membership=membership)

    async def scenario() -> None:
        async with (
            running_coordinator(run, tmp_path / "data") as node,
            CoordinatorClient(node.address, timeout_s=10) as client,
        ):
            key = SigningKey.generate()
            admitted = await client.join(key, "renewal", name="p", device="cpu")
            first = admitted.certificate
            answer = await client.heartbeat(key, "renewal", admitted.coordinator_key)
            assert answer.certificate is None, "a fresh certificate is not renewed"
            await asyncio.sleep(first.expires_at - time.time() - 4.0)  # past half of the 10 s lifetime
            answer = await client.heartbeat(key, "renewal", admitted.coordinator_key)
            renewed = answer.certificate
            assert renewed is not None and renewed.serial > first.serial
            assert renewed.expires_at > first.expires_at and renewed.peer_id == key.peer_id

    asyncio.run(scenario())
