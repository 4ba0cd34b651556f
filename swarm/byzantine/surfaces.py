"""Every inbound surface of a run, enumerated from the code, and the hostile cases each one gets.

A surface is something a stranger can send bytes to:

- ``dht``: every key ``swarm.keyspace.run_keys`` lists for the run (each reached through every honest
  node's ``rpc_store``);
- ``dht_rpc``: every ``rpc_*`` handler of the project's ``DHTProtocol`` subclasses;
- ``p2p``: every ``rpc_*`` handler of every ``BoundedServicer`` subclass, under each namespace the run
  registers it under (``NAMESPACES``);
- ``grpc``: every method of every gRPC service in ``protocols`` (the coordinator's);
- ``data_plane``: every TCP listener module (``LISTENERS``).

Each kind has the categories that apply to it (``CATEGORIES``). The generic ones (malformed bytes, an
oversized length or message, a far-future expiration, a replay) are built from the surface alone; a
well-formed lie needs to know what the surface expects, so ``swarm.byzantine.hostile`` keeps one builder
per DHT rule, handler and RPC. ``uncovered`` names every surface missing one, so that a new key, handler
or RPC without a hostile case fails ``tests/test_hostile.py``.

Example::

    missing = uncovered(surfaces("my-run"), lies=LIES)
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import ServicerBase

from swarm.keyspace import run_keys, stage_prefix

MALFORMED, OVERSIZED, FAR_FUTURE, REPLAY, LYING = "malformed", "oversized", "far_future", "replay", "lying"
# libp2p streams are encrypted point to point: the attacker sees no honest request to a handler that it
# could replay, and no handler takes an expiration.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "dht": (MALFORMED, OVERSIZED, FAR_FUTURE, REPLAY, LYING),
    "dht_rpc": (MALFORMED, OVERSIZED, FAR_FUTURE, REPLAY, LYING),
    "p2p": (MALFORMED, OVERSIZED, LYING),
    "grpc": (MALFORMED, OVERSIZED, REPLAY, LYING),
    "data_plane": (MALFORMED, OVERSIZED, REPLAY, LYING),
}
# What carries the cases of each DHT protocol handler: stores reach rpc_store; the audit's reads reach
# rpc_find; the attacker's own node pings every honest node as it joins.
DHT_RPC_CARRIERS = {"rpc_store": "the dht key cases", "rpc_find": "the audit", "rpc_ping": "joining"}
# Each TCP listener module of the project and the surface whose cases reach it. peer.reachability and
# peer.doctor listen for seconds on the volunteer's own command, for a dial-back it asked for.
LISTENERS = {
    "swarm.averaging.transport": "DataPlane",
    "coordinator.node": "grpc",
    "peer.reachability": "a listener that closes each connection unread, for seconds",
    "peer.doctor": "a listener that closes each connection unread, for seconds",
}
PROJECT_PACKAGES = ("swarm", "peer", "coordinator", "lab")


@dataclass(frozen=True)
class Surface:
    """One inbound surface: ``kind`` (a key of ``CATEGORIES``), its ``name`` and the ``case`` its lie is
    filed under (a DHT rule, ``Class.rpc_method`` or an RPC's name)."""

    kind: str
    name: str
    case: str

    @property
    def categories(self) -> tuple[str, ...]:
        return CATEGORIES[self.kind]


def import_packages(packages: Iterable[str]) -> None:
    """Import every module of ``packages``, so that every servicer class they define is registered."""
    for package in packages:
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            importlib.import_module(module.name)


def servicer_classes(packages: Iterable[str] = PROJECT_PACKAGES) -> list[type[ServicerBase]]:
    """Every hivemind servicer class defined in ``packages`` among the modules imported so far."""
    roots = tuple(packages)
    found, todo = [], list(ServicerBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in roots and not cls.__qualname__.count("<locals>"):
            found.append(cls)
    return sorted(set(found), key=lambda c: c.__name__)


def handler_names(cls: type[ServicerBase]) -> list[str]:
    if issubclass(cls, DHTProtocol):
        return sorted(name for name in dir(cls) if name.startswith("rpc_"))
    cls._collect_rpc_handlers()
    return sorted(h.method_name for h in cls._rpc_handlers)


def dht_surfaces(run_id: str, stages: int = 1) -> list[Surface]:
    return [
        Surface("dht", name, f"record:{rule.arg}" if rule.check == "record" else rule.check)
        for name, rule in run_keys(run_id, stages).items()
    ]


def handler_surfaces(classes: Iterable[type[ServicerBase]]) -> list[Surface]:
    out = []
    for cls in classes:
        kind = "dht_rpc" if issubclass(cls, DHTProtocol) else "p2p"
        for method in handler_names(cls):
            case = method if kind == "dht_rpc" else f"{cls.__name__}.{method}"
            out.append(Surface(kind, f"{cls.__name__}.{method}", case))
    return out


def grpc_services() -> dict[str, object]:
    """Every gRPC service descriptor that ``protocols`` defines, by full name."""
    import protocols

    services = {}
    for module in pkgutil.iter_modules(protocols.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"protocols.{module.name}").DESCRIPTOR
            services.update({s.full_name: s for s in descriptor.services_by_name.values()})
    return services


def grpc_surfaces() -> list[Surface]:
    return [
        Surface("grpc", f"/{name}/{method.name}", method.name)
        for name, service in grpc_services().items()
        for method in service.methods
    ]


def surfaces(
    run_id: str, stages: int = 1, classes: Iterable[type[ServicerBase]] | None = None
) -> list[Surface]:
    """Every inbound surface of run ``run_id`` with ``stages`` pipeline stages (1: data-parallel);
    ``classes``: the servicer classes (default: those of the project's modules imported so far)."""
    return [
        *dht_surfaces(run_id, stages),
        *handler_surfaces(servicer_classes() if classes is None else classes),
        *grpc_surfaces(),
        Surface("data_plane", "DataPlane", "DataPlane"),
    ]


def namespaces(cls_name: str, run_id: str, stages: int) -> list[str]:
    """The namespaces a run registers servicer ``cls_name`` under (KeyError: a servicer with none known)."""
    return NAMESPACES[cls_name](run_id, stages)


def _stage_prefixes(run_id: str, stages: int) -> list[str]:
    return [stage_prefix(run_id, s) for s in range(stages)] if stages > 1 else []


def _state(run_id: str, stages: int) -> list[str]:
    from swarm.training.sync import state_namespace

    return [state_namespace(run_id)] + [state_namespace(p) for p in _stage_prefixes(run_id, stages)]


def _pipeline(run_id: str, stages: int) -> list[str]:
    from swarm.pipeline.server import pipeline_namespace

    return [pipeline_namespace(run_id, s) for s in range(stages)] if stages > 1 else []


NAMESPACES: dict[str, Callable[[str, int], list[str]]] = {
    "AveragingServicer": lambda run_id, stages: [run_id, *_stage_prefixes(run_id, stages)],
    "StateServicer": _state,
    "StageServicer": _pipeline,
}


def uncovered(found: Iterable[Surface], lies: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Every surface in ``found`` that the harness has no case for, with what is missing: a lie builder
    (``lies[kind][case]``), a namespace for a handler, a carrier for a DHT protocol handler."""
    missing = []
    for surface in found:
        if surface.kind == "dht_rpc":
            if surface.case not in DHT_RPC_CARRIERS:
                missing.append(f"{surface.kind} {surface.name}: nothing carries hostile cases to it")
            continue
        if LYING in surface.categories and surface.case not in lies.get(surface.kind, {}):
            missing.append(f"{surface.kind} {surface.name}: no well-formed lie ({surface.case!r})")
        if surface.kind == "p2p" and surface.name.split(".")[0] not in NAMESPACES:
            missing.append(f"{surface.kind} {surface.name}: no namespace to reach it under")
    return missing
