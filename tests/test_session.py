"""``swarm.connect``: a program of its own joins a run, stays online, and leaves, through the library."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import swarm as swarm_api
from lab.localswarm import LocalSwarm, peer_states, running_coordinator, status, tiny_run, wait_until
from protocols.errors import ConfigError, CoordinatorKeyMismatch, DHTStartFailed, NetworkError
from protocols.keys import SigningKey

pytestmark = pytest.mark.timeout(180)


def _options(tmp_path: Path, name: str) -> dict:
    return {
        "name": name,
        "identity": tmp_path / f"{name}.key",
        "known_coordinators": tmp_path / f"{name}-known.json",
        "host": "127.0.0.1",
        "join_timeout_s": 60,
    }


@pytest.mark.slow
def test_a_program_joins_with_connect_stays_online_and_leaves_on_exit(swarm: LocalSwarm, tmp_path: Path):
    coordinator = swarm.start_coordinator()
    address = coordinator.extra["address"]
    with swarm_api_connect(address, tmp_path, "own-loop") as session:
        assert session.run_config.run_id == "test-run"
        assert session.certificate.role == "data" and session.certificate.peer_id == session.key.peer_id
        assert session.dht is not None and session.dialable
        # Its heartbeats keep it online in the coordinator's record, under its own key.
        wait_until(lambda: peer_states(address).get("own-loop") == "online", timeout_s=60, what="online")
        record = next(p for p in status(address).peers if p.name == "own-loop")
        assert record.peer_id == session.key.peer_id
        started = time.monotonic()
    assert time.monotonic() - started < 30, "leaving takes seconds, not a timeout"
    assert peer_states(address)["own-loop"] == "left"
    # A second session with the same identity file is the same peer.
    with swarm_api_connect(address, tmp_path, "own-loop") as again:
        assert again.key.peer_id == record.peer_id


@pytest.mark.slow
def test_a_coordinator_with_another_key_than_the_pinned_one_is_refused_at_enter(
    swarm: LocalSwarm, tmp_path: Path
):
    address = swarm.start_coordinator().extra["address"]
    impostor = SigningKey.generate().peer_id
    connection = swarm_api_connect(address, tmp_path, "careful", coordinator_key=impostor)
    with pytest.raises(CoordinatorKeyMismatch, match=impostor), connection:
        pass
    assert "careful" not in peer_states(address), "nothing joined"


def test_a_wrong_option_is_a_config_error_naming_it(tmp_path: Path):
    with pytest.raises(ConfigError, match="join_timeout_s"):
        swarm_api.connect("127.0.0.1:31330", join_timeout_s=-1)
    with pytest.raises(ConfigError, match="coordinator"):
        swarm_api.connect("no-port-here")
    with pytest.raises(ConfigError, match="colour"):
        swarm_api.connect("127.0.0.1:31330", colour="blue")


def swarm_api_connect(address: str, tmp_path: Path, name: str, **extra):
    return swarm_api.connect(address, **_options(tmp_path, name), **extra)


@pytest.mark.timeout(120)
def test_a_slow_dht_start_says_what_it_waits_for_and_comes_up(tmp_path: Path, monkeypatch, caplog):
    # On a loaded machine the DHT's process takes minutes to import torch and hivemind: the start waits
    # (up to ready_timeout_s), saying so, instead of failing after a fixed minute.
    import swarm.dht as dht_module
    from swarm.identity import create_identity

    monkeypatch.setattr(dht_module, "DHT_PROGRESS_EVERY_S", 0.05)
    key = create_identity(tmp_path / "slow.key")
    with caplog.at_level("INFO", logger="swarm.dht"):
        dht = dht_module.start_dht(key, tmp_path / "slow.key", host="127.0.0.1", port=0, initial_peers=[])
    try:
        assert dht.peer_id.to_base58() == key.peer_id
        assert "still waiting for the DHT node on 127.0.0.1:0 to start" in caplog.text
    finally:
        dht.shutdown()


def _session(tmp_path: Path, **options) -> swarm_api.Session:
    config = swarm_api.SessionConfig(coordinator="127.0.0.1:1", **_options(tmp_path, "busy"), **options)
    config.max_retry_interval_s = 1.0
    return swarm_api.Session(config)


def test_a_dht_that_does_not_come_up_in_time_is_started_again_and_the_failure_says_what_to_do(
    tmp_path, caplog
):
    """A busy machine: the DHT node's process is still importing when the wait ends. The session tries
    again (saying so) instead of exiting after it joined; after the last try the error says what to do."""
    tries: list[int] = []

    def slow_twice():
        tries.append(1)
        if len(tries) <= 2:
            raise DHTStartFailed(
                "could not start the DHT on 127.0.0.1:0: TimeoutError('not ready after 180s')"
            )
        return "the node"

    session = _session(tmp_path, dht_start_attempts=3)
    with caplog.at_level("WARNING", logger="swarm.peer"):
        assert asyncio.run(session._start_dht(asyncio.Event(), slow_twice)) == "the node"
    assert len(tries) == 3
    assert "trying again in 1s (attempt 2 of 3)" in caplog.text and "(attempt 3 of 3)" in caplog.text

    tries.clear()
    with pytest.raises(DHTStartFailed, match="2 times: the machine may be too busy.*--dht-start-attempts"):
        asyncio.run(_session(tmp_path, dht_start_attempts=2)._start_dht(asyncio.Event(), slow_twice))

    def port_in_use():
        tries.append(1)
        raise NetworkError("cannot serve the DHT on 127.0.0.1:4000: Address already in use")

    tries.clear()
    with pytest.raises(NetworkError, match="Address already in use"):
        asyncio.run(session._start_dht(asyncio.Event(), port_in_use))
    assert len(tries) == 1, "a port in use is not retried: waiting would not free it"


def test_a_stop_during_the_dht_retry_wait_ends_the_start_without_an_error(tmp_path):
    def never_ready():
        raise DHTStartFailed("could not start the DHT on 127.0.0.1:0: TimeoutError('not ready after 180s')")

    async def scenario():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        return await _session(tmp_path, dht_start_attempts=5)._start_dht(stop, never_ready)

    assert asyncio.run(scenario()) is None


class _DaemonThatCannotBind:
    """What a DHT start hands over when its p2p daemon exits at once (here: it cannot bind ``--host``):
    the ready wait raises the daemon's error and the process has ended."""

    def wait_until_ready(self, timeout: float | None = None) -> None:
        from hivemind.p2p.p2p_daemon import P2PDaemonError

        raise P2PDaemonError(
            "Daemon failed to start: [listen tcp4 192.0.2.1:0: bind: cannot assign requested address]"
        )

    def is_alive(self) -> bool:
        return False


def test_a_daemon_that_cannot_bind_is_not_retried_as_a_slow_start(tmp_path):
    """Only a wait that ran out is tried again: a daemon that failed outright fails the same way each
    time, and the busy-machine advice would not apply (found by reading the retry as an attacker would)."""
    from swarm import dht as swarm_dht

    key, tries = SigningKey.generate(), []

    def start():
        tries.append(1)
        return swarm_dht._await_dht(_DaemonThatCannotBind(), key, "192.0.2.1:0", timeout_s=180)

    with pytest.raises(NetworkError, match="cannot assign requested address") as failed:
        asyncio.run(_session(tmp_path, dht_start_attempts=3)._start_dht(asyncio.Event(), start))
    assert not isinstance(failed.value, DHTStartFailed) and len(tries) == 1


def test_the_dht_process_drops_the_noise_of_a_dropped_request_but_keeps_real_errors():
    import logging
    import sys

    from swarm.dht import DroppedCoroutineNoise

    def record(name: str, message: str, error: BaseException | None = None) -> logging.LogRecord:
        exc_info = None
        if error is not None:
            try:
                raise error
            except BaseException:
                exc_info = sys.exc_info()
        return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, exc_info)

    noise = DroppedCoroutineNoise()
    # What a peer's log showed on a loaded machine: a traceback ending in GeneratorExit, then asyncio's line.
    assert not noise.filter(
        record("hivemind.dht.dht", "Caught an exception when running a coroutine:", GeneratorExit())
    )
    pending = (
        "Task was destroyed but it is pending!\ntask: <Task pending coro=<DHT._run_coroutine() running>>"
    )
    assert not noise.filter(record("asyncio", pending))
    # A coroutine that failed, and another task destroyed while pending, still reach the log.
    assert noise.filter(
        record("hivemind.dht.dht", "Caught an exception when running a coroutine:", ValueError("x"))
    )
    assert noise.filter(
        record("asyncio", "Task was destroyed but it is pending!\ntask: <Task coro=<serve()>>")
    )


@pytest.mark.timeout(120)
def test_an_admitted_peer_stays_online_while_its_dht_and_trainer_start_and_keeps_what_the_answers_carry(
    tmp_path: Path, monkeypatch
):
    """A peer sent its first heartbeat only from its heartbeat loop, after its DHT node was up and its
    trainer built (each a minute or more on a busy machine), so the coordinator showed a volunteer it had
    just admitted as offline meanwhile. Now it heartbeats from its admission until the loop takes over,
    and keeps what their answers carry: the coordinator's standing is sent once per version, and catch-up
    weighs votes by it."""
    import swarm.dht as dht_module
    from swarm.coordinator_client import CoordinatorClient

    run = tiny_run("slow-start")  # offline after 3 s without a heartbeat
    starting_s = 2 * run.membership.offline_after_s  # the DHT node's start; the trainer's as long again

    def slow_start(*args, **kwargs):  # runs in the session's worker thread, as start_dht does
        time.sleep(starting_s)
        return "the node"

    async def scenario() -> tuple[bool, list[str], float]:
        async with running_coordinator(run, tmp_path / "coordinator") as node:
            monkeypatch.setattr(dht_module, "start_dht", slow_start)  # the coordinator's own node is up
            options = _options(tmp_path, "slow")
            session = swarm_api.Session(swarm_api.SessionConfig(coordinator=node.address, **options))
            seen: list[str] = []

            async def watch(reader: CoordinatorClient) -> None:
                while True:
                    states = {p.name: p.state for p in (await reader.full_status(run.run_id)).peers}
                    if "slow" in states:
                        seen.append(states["slow"])
                    await asyncio.sleep(0.25)

            async with CoordinatorClient(node.address) as client, CoordinatorClient(node.address) as reader:
                watching = asyncio.create_task(watch(reader))
                try:
                    started = await session.start(client, asyncio.Event())
                    await asyncio.sleep(starting_s)  # the caller builds its trainer
                finally:
                    watching.cancel()
                standing_at = session.standing.at
                await session.leave()
            return started, seen, standing_at

    started, seen, standing_at = asyncio.run(scenario())
    assert started
    assert len(seen) >= 3 * starting_s, f"the coordinator was read throughout the start: {seen}"
    assert set(seen) == {"online"}, f"the peer's state while its DHT and trainer started: {seen}"
    assert standing_at > 0, "the standing an early heartbeat's answer carried was kept"
