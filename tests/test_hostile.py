"""The hostile-peer harness (``swarm.byzantine.hostile``) reaches every inbound surface the code has.

Its surfaces are read from the code: each servicer class the project registers must have namespaces in
``surfaces`` (a new servicer without them fails here), and its DHT inputs cover every rule of
``run_keys``. The harness itself runs against real trainers in
``tests/test_trust.py::test_an_unadmitted_attacker_neither_steers_nor_crashes_nor_blinds_honest_trainers``
(and from ``swarm-sim --protocol-attack hostile``).
"""

from __future__ import annotations

import importlib
import pkgutil

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import ServicerBase

from swarm.byzantine.hostile import _handlers, _one_per_rule, surface_classes, surfaces
from swarm.byzantine.protocol_attacks import make_protocol_attack, protocol_attack_names
from swarm.inbound import BoundedServicer
from swarm.keyspace import run_keys


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
    assert data == {"a_run", "a_run_state"}, data
    staged = surfaces("a.run", stages=2)
    assert {type_.__name__ for type_, _ in staged} == {"AveragingServicer", "StateServicer", "StageServicer"}
    assert len(staged) == 3 + 3 + 2, "the run's prefix and each stage's, and each stage's pipeline handlers"
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
