"""The hostile-peer harness (``swarm.byzantine.hostile``) reaches every inbound surface the code has.

Its surfaces are read from the code: each servicer class the project registers must have namespaces in
``surfaces`` (a new servicer without them fails here), and its DHT inputs cover every rule of
``run_keys``. The harness itself runs against real trainers in
``tests/test_trust.py::test_an_unadmitted_attacker_neither_steers_nor_crashes_nor_blinds_honest_trainers``
(and from ``swarm-sim --protocol-attack hostile``), and here against a real coordinator's gRPC service:
every RPC the coordinator serves must be one it sends to, and each of its calls must be refused by name,
in time, with nothing kept.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from collections import namedtuple
from pathlib import Path

import pytest
from helpers import serving_coordinator
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import ServicerBase

from coordinator.dialback import DialBackService
from coordinator.limits import ServiceLimits
from coordinator.service import SERVICE_NAME, CoordinatorService
from coordinator.store import Store
from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.byzantine.hostile import (
    CALL_TIMEOUT_S,
    COORDINATOR,
    CRAFTED,
    OVERSIZED_REQUEST_BYTES,
    Answer,
    _handlers,
    _one_per_rule,
    coordinator_rpcs,
    surface_classes,
    surfaces,
)
from swarm.byzantine.protocol_attacks import ProtocolTarget, make_protocol_attack, protocol_attack_names
from swarm.coordinator_client import CoordinatorClient
from swarm.inbound import BoundedServicer
from swarm.keyspace import run_keys

pytestmark = pytest.mark.timeout(60)

# Refusals by name (swarm/rpc.py's codes for our errors, and gRPC's own for a message over its cap); never
# INTERNAL (a handler that crashed), DEADLINE_EXCEEDED (one that hung) or OK (one that took it).
REFUSALS = {
    "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED",
    "RESOURCE_EXHAUSTED",
}  # fmt: skip
CallDetails = namedtuple("CallDetails", "method invocation_metadata")


def project_servicers() -> set[type[ServicerBase]]:
    for package in ("swarm", "peer", "coordinator", "lab"):
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            importlib.import_module(module.name)
    found, todo = set(), list(ServicerBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in ("swarm", "peer", "coordinator", "lab"):
            found.add(cls)
    # hivemind's DHT protocol (its keys are the harness's DHT inputs) and the abstract base serve nothing.
    return {cls for cls in found if not issubclass(cls, DHTProtocol) and cls is not BoundedServicer}


def test_every_servicer_the_project_registers_is_a_surface_of_the_harness():
    assert project_servicers() == surface_classes(), "a servicer without harness namespaces, or a stale one"
    data = {ns for _, ns in surfaces("a.run")}
    assert data == {"a_run", "a_run_state", "a_run_tier2"}, data
    staged = surfaces("a.run", stages=2)
    assert {type_.__name__ for type_, _ in staged} == {
        "AveragingServicer", "StateServicer", "StageServicer", "TierServicer"
    }  # fmt: skip
    assert len(staged) == 4 + 3 + 2 + 1, (
        "the run's, its second tier's and each stage's; each stage's pipeline"
    )
    for cls in surface_classes():
        assert _handlers(cls), f"{cls.__name__} has no rpc_ handler to send to"


def test_the_harness_sends_to_every_rule_of_the_runs_keys_and_is_a_named_protocol_attack():
    for stages in (1, 3):
        keys = run_keys("a.run", stages)
        covered = _one_per_rule(keys)
        assert {keys[k].check for k in covered} == {r.check for r in keys.values()}
        assert {(r.check, r.scope) for r in keys.values()} == {
            (keys[k].check, keys[k].scope) for k in covered
        }
    assert "hostile" in protocol_attack_names()
    assert make_protocol_attack("hostile", {"stages": 2}).options.stages == 2


def test_every_rpc_the_coordinator_serves_is_one_the_harness_sends_to(tmp_path: Path):
    assert COORDINATOR.full_name == SERVICE_NAME
    assert list(CRAFTED) and set(CRAFTED) == set(coordinator_rpcs()), (
        "an RPC of the proto without crafted inputs"
    )
    store = Store.open_sync(tmp_path / "coordinator.db", "a.run")
    try:
        service = CoordinatorService(tiny_run("a.run"), SigningKey.generate(), store, [])
        registered = set(service.method_handlers())
    finally:
        store.close()
    assert registered - set(CRAFTED) == set(), (
        "the coordinator serves an RPC the hostile harness never sends to"
    )
    # The node serves both handlers (coordinator/node.py); every RPC of the proto is answered by one.
    handlers = (service.generic_handler(), DialBackService().generic_handler())
    for name in coordinator_rpcs():
        details = CallDetails(f"/{SERVICE_NAME}/{name}", ())
        assert any(h.service(details) is not None for h in handlers), f"nobody serves {name}"
        streaming = COORDINATOR.methods_by_name[name].client_streaming
        served = [h.service(details) for h in handlers if h.service(details) is not None][0]
        assert served.request_streaming == streaming, (
            f"{name}: the proto and the service disagree on streaming"
        )


def check_refusals(answers: list[Answer]) -> None:
    """Each hostile call refused by name and in time; the ones with one right refusal refused with it."""
    assert {a.rpc for a in answers} == set(coordinator_rpcs()), "an RPC was sent nothing"
    oversized = f"{OVERSIZED_REQUEST_BYTES} bytes, past the message cap"
    for rpc in coordinator_rpcs():
        assert {"random bytes", "an empty request", oversized} <= {a.probe for a in answers if a.rpc == rpc}
    wrong = [(a.rpc, a.probe, a.code, a.details) for a in answers if a.code not in REFUSALS]
    assert not wrong, f"answered other than by a refusal: {wrong}"
    assert all(a.details for a in answers), "a refusal that does not say what is wrong"
    # The silent stream waits for the coordinator's own deadline (checked below: the coordinator ended it).
    slow = [
        (a.rpc, a.probe, round(a.elapsed_s, 1))
        for a in answers
        if a.elapsed_s >= CALL_TIMEOUT_S and a.probe != "a stream that sends nothing"
    ]
    assert not slow, f"calls that took their whole timeout: {slow}"
    said = {(a.rpc, a.probe): (a.code, a.details) for a in answers}
    for rpc in coordinator_rpcs():
        # gRPC's receive cap refuses it from the length prefix, before any handler (or buffer of ours).
        code, details = said[rpc, oversized]
        assert code == "RESOURCE_EXHAUSTED" and "larger than max" in details, (rpc, details)
        if rpc != "DialBack":  # which serves any run: a volunteer checks its ports before it joins one
            assert said[rpc, "another run's ID"][0] == "NOT_FOUND", rpc
    for replayed in (
        ("Join", "its own accepted join, replayed"),
        ("Heartbeat", "its own accepted heartbeat, replayed"),
    ):
        assert said[replayed][0] == "UNAUTHENTICATED", said[replayed]
    for rpc in ("Join", "Heartbeat", "Leave", "Accuse"):
        for probe in ("a far-future timestamp", "a far-past timestamp"):
            assert said[rpc, probe][0] == "UNAUTHENTICATED", said[rpc, probe]
    for probe in (
        "64 parts of evidence past the 1 KiB it signed for",
        "63 parts after its complete evidence",
    ):
        code, details = said["Accuse", probe]
        assert code == "INVALID_ARGUMENT" and "more than the 1024 evidence bytes it signed for" in details, (
            details
        )
    silent = [(a.rpc, a.code, a.details) for a in answers if a.probe == "a stream that sends nothing"]
    assert len(silent) == 1 and silent[0][:2] == ("Accuse", "INVALID_ARGUMENT"), silent
    assert "did not arrive within" in silent[0][2], (
        "the coordinator, not the harness, ended the silent stream"
    )


def test_hostile_calls_at_a_real_coordinator_are_each_refused_by_name_in_time_and_nothing_is_kept(
    tmp_path: Path,
):
    run_id = "hostile.run"
    # The coordinator cuts a silent accusation off itself, before the harness gives up on it (``stall_s``
    # 12 s); 8 s leaves a loaded machine time to read the 64-part streams in full (a read cut off by the
    # deadline empties the accuser's bucket, and its next accusation was answered "too many": seen with
    # 3 s while a CI run shared the machine).
    limits = ServiceLimits(evidence_read_timeout_s=8.0)

    async def scenario() -> None:
        async with serving_coordinator(tmp_path, run_id, limits, dial_back=True) as (address, store, service):
            attack = make_protocol_attack("hostile", {"stall_s": 12.0})
            target = ProtocolTarget(None, run_id, coordinator=address)
            try:
                for _ in range(2):  # its second mount rejoins under the same key
                    sent = await asyncio.wait_for(attack.mount(target), 60)
                    assert sent >= len(attack.answers) > 50
                    check_refusals(attack.answers)
                    # The bound: one peer row, its own identity (joined honestly, then left); no ban; no
                    # open challenge or accusation; no evidence bytes held; one clock offset and session.
                    peers = await store.list_peers()
                    assert [(p.peer_id, p.state) for p in peers] == [(attack.key.peer_id, "left")]
                    assert await store.list_bans() == []
                    assert not service._challenges and not service._open_by_caller
                    assert not service._accusing and service._evidence_budget.held == 0
                    assert len(service._clock_offsets) <= 1 and len(service._sessions) <= 1
            finally:
                await attack.close()

            # Still serving, and an honest peer can do all it needs.
            honest = SigningKey.generate()
            async with CoordinatorClient(address, timeout_s=5) as client:
                assert (await client.challenge(run_id)).challenge
                admission = await client.join(honest, run_id, name="honest", device="cpu")
                beat = await client.heartbeat(honest, run_id, admission.coordinator_key, step=0)
                assert beat.state == "online" and beat.signed_run_state
                status = await client.status(run_id)
            # The harness's row, left, was pruned at the honest join.
            assert [(p.peer_id, p.state) for p in status.peers] == [(honest.peer_id, "online")]

    asyncio.run(scenario())
