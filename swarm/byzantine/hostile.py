"""The ``hostile`` protocol attack: every hostile case on every inbound surface of a run, as a stranger.

It enumerates the surfaces from the code (``swarm.byzantine.surfaces``) and, on each mount, sends each
category that applies (``CATEGORIES``) to each one it can reach:

- every DHT key of the run, stored straight into every honest node it knows (the coordinator's and each
  progress record's signer): bytes that are no msgpack under a subkey that is no peer ID, a 1 MiB value, a
  value expiring in 30 years, an honest record it read replayed under its own subkey and with a later
  expiration, and the key's own kind of record (``DHT_LIES``) signed by a fresh, uncertified key;
- every ``rpc_*`` handler of every servicer at every honest node, under each namespace: a body that is no
  protobuf, a length prefix of 192 MiB (stream handlers) or a request past the daemon's 4 MiB (unary),
  and a well-formed request with lying fields (``P2P_LIES``);
- every method of the coordinator's gRPC service: bytes that are no protobuf, a 2 MiB message, an honest
  progress record replayed as the request's envelope, and a well-formed lie (``GRPC_LIES``);
- each data plane it finds (``data_addresses``): a greeting that is no handshake, 1 MiB of junk, a hello
  signed for an earlier connection's nonce, and a correct hello from an uncertified key.

Every send is bounded in time (``SEND_TIMEOUT_S``) and an error is a refusal, counted, not a failure. After
each mount it audits the honest nodes (``audit``): how many entries each returns for the run's keys and
how many of them are its own. ``python -m swarm.byzantine.protocol_attacks --attack hostile`` runs it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2 as hivemind_apb
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols import averaging_pb2 as apb
from protocols import coordinator_pb2 as cpb
from protocols import messages
from protocols import pipeline_pb2 as ppb
from protocols.envelope import seal
from protocols.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, SigningKey
from protocols.version import PROTOCOL_VERSION
from swarm.averaging.declarations import matchmaking_key, seal_declaration
from swarm.averaging.transport import MAGIC, NONCE_BYTES, _transcript, parse_address
from swarm.byzantine.protocol_attacks import (
    FAR_FUTURE_S,
    POISON_HASH,
    ProtocolAttack,
    ProtocolAttackOptions,
    ProtocolTarget,
    register_protocol_attack,
)
from swarm.byzantine.surfaces import (
    FAR_FUTURE,
    LYING,
    MALFORMED,
    OVERSIZED,
    PROJECT_PACKAGES,
    REPLAY,
    Surface,
    import_packages,
    namespaces,
    surfaces,
)
from swarm.inbound import UNARY_MAX_BYTES
from swarm.keyspace import run_keys
from swarm.records import PEER_KINDS, RUN_KINDS, seal_peer_record

SEND_TIMEOUT_S = 5.0
OVERSIZED_VALUE_BYTES = 300 << 10  # a DHT value (past a signer's 256 KiB on a node), data-plane junk
CLAIMED_BYTES = 192 << 20  # the length prefix on a stream: what is claimed, never sent
GRPC_OVERSIZED_BYTES = 2 << 20  # past the coordinator's 1 MiB message cap
FAR_AHEAD = 2**40  # a step no honest peer reaches


def _far_ahead_body(target: ProtocolTarget) -> dict[str, Any]:
    return {
        "step": target.step + FAR_AHEAD,
        "samples": 10**9,
        "samples_per_s": 1e9,
        "state_hash": POISON_HASH,
    }


def _peer_record(kind: str) -> Callable[[ProtocolTarget, SigningKey, str], bytes]:
    return lambda target, key, scope: seal_peer_record(key, kind, scope, _far_ahead_body(target), b"")


def _run_record(kind: str) -> Callable[[ProtocolTarget, SigningKey, str], bytes]:
    body = {"step": FAR_AHEAD, "state_hash": POISON_HASH, "banned": [], "page": 0, "pages": 1}
    return lambda target, key, scope: seal(key, RUN_KINDS[kind], scope, {**body, "expires_at": 2e9})


# The key's own kind of record, signed by a fresh key with no certificate, claiming a step far ahead (a
# run record: claiming to be the coordinator). Keyed by swarm.byzantine.surfaces.Surface.case.
DHT_LIES: dict[str, Callable[[ProtocolTarget, SigningKey, str], bytes]] = {
    **{f"record:{kind}": _peer_record(kind) for kind in PEER_KINDS},
    **{f"record:{kind}": _run_record(kind) for kind in RUN_KINDS},
    "ban_page": _run_record("bans"),
    "declaration": lambda target, key, scope: seal_declaration(
        key, scope, looking=True, expires_at=get_dht_time() + 300
    ),
}

P2P_LIES: dict[str, Callable[[ProtocolTarget], Any]] = {
    "AveragingServicer.rpc_join_group": lambda t: hivemind_apb.JoinRequest(
        schema_hash=os.urandom(32),
        expiration=get_dht_time() + FAR_FUTURE_S,
        gather=os.urandom(64),
        group_key=matchmaking_key(t.run_id),
    ),  # fmt: skip
    "AveragingServicer.rpc_aggregate_part": lambda t: apb.PartChunk(
        group_id=os.urandom(32), data=bytes(64), weight=1e30, signature=os.urandom(SIGNATURE_BYTES)
    ),
    "AveragingServicer.rpc_round_inputs": lambda t: apb.InputsRequest(
        group_id=os.urandom(32), sender_index=2**31
    ),
    "StateServicer.rpc_download_state": lambda t: apb.StateRequest(run_id=t.run_id, min_step=FAR_AHEAD),
    "StageServicer.rpc_forward": lambda t: ppb.ForwardRequest(
        run_id=t.run_id, step=FAR_AHEAD, microbatch_id=1, attempt=2**31, inputs=ppb.Tensor(shape=[2**31])
    ),
    "StageServicer.rpc_backward": lambda t: ppb.BackwardRequest(
        run_id=t.run_id, step=FAR_AHEAD, microbatch_id=1, attempt=2**31
    ),
}


def _header(target: ProtocolTarget) -> cpb.Header:
    return cpb.Header(protocol_version=PROTOCOL_VERSION, run_id=target.run_id)


def _signed(purpose: str, body: dict[str, Any]) -> Callable[[ProtocolTarget], bytes]:
    return lambda t: seal(SigningKey.generate(), purpose, t.run_id, body)


GRPC_LIES: dict[str, Callable[[ProtocolTarget], Any]] = {
    "Challenge": lambda t: cpb.ChallengeRequest(
        header=cpb.Header(protocol_version=PROTOCOL_VERSION + 1000, run_id="x" * 4096)
    ),
    # A challenge the coordinator never issued.
    "Join": lambda t: cpb.JoinRequest(
        header=_header(t),
        envelope=_signed(
            messages.JOIN,
            {
                "challenge": os.urandom(32),
                "name": "hostile",
                "device": "cpu",
                "role": "data",
                "token_proof": b"",
            },
        )(t),
    ),  # fmt: skip
    "Heartbeat": lambda t: cpb.HeartbeatRequest(
        header=_header(t),
        envelope=_signed(
            messages.HEARTBEAT,
            {"seq": 1, "state": "online", "step": FAR_AHEAD, "param_hash": POISON_HASH, "metrics": {}},
        )(t),
    ),  # fmt: skip
    "Leave": lambda t: cpb.LeaveRequest(
        header=_header(t), envelope=_signed(messages.LEAVE, {"seq": 1, "reason": "hostile"})(t)
    ),
    "Status": lambda t: cpb.StatusRequest(header=_header(t), after_peer_id="z" * 128, max_peers=2**32 - 1),
    "DialBack": lambda t: cpb.DialBackRequest(header=_header(t), ports=list(range(1, 1025))),
    "Accuse": lambda t: [
        cpb.AccusationPart(
            header=_header(t),
            envelope=_signed(
                messages.ACCUSE,
                {
                    "accused": (t.holders or [""])[0],
                    "reason": "hostile",
                    "evidence_sha256": os.urandom(32),
                    "evidence_bytes": 2**40,
                },
            )(t),
            evidence=os.urandom(1024),
        )
    ],  # fmt: skip
}

LIES: dict[str, dict[str, object]] = {
    "dht": DHT_LIES,
    "p2p": P2P_LIES,
    "grpc": GRPC_LIES,
    "data_plane": {"DataPlane": True},
}


async def _bounded(sent: Counter, outcome: Counter, label: str, send: Any) -> None:
    """Send once, at most ``SEND_TIMEOUT_S``; an error or a timeout counts as refused."""
    sent[label] += 1
    try:
        await asyncio.wait_for(send, SEND_TIMEOUT_S)
        outcome["answered"] += 1
    except Exception:  # whatever the honest side does to a hostile request is what we want to see
        outcome["refused"] += 1


# --- the DHT: run in the attacker's DHT child, whose protocol can store raw bytes -----------------------


async def _store_raw(_dht: Any, node: Any, peers: list[str], batches: list[tuple]) -> int:
    """Store each batch (keys, value bytes, expirations, subkey bytes or None, one per key) straight into
    each of ``peers``, one request per batch and peer; returns how many entries the honest nodes took."""
    accepted = 0
    for peer in peers:
        for keys, values, expirations, subkeys in batches:
            try:
                done = await asyncio.wait_for(
                    node.protocol.call_store(
                        PeerID.from_base58(peer), [DHTID.generate(source=k) for k in keys], values,
                        expirations, subkeys=subkeys, in_cache=[False] * len(keys),
                    ), SEND_TIMEOUT_S,
                )  # fmt: skip
            except Exception:  # a node that drops the request (the daemon's 4 MiB) refuses it all
                continue
            accepted += sum(bool(x) for x in done or [])
    return accepted


async def _find(
    _dht: Any, node: Any, peer: str, keys: list[str]
) -> dict[str, list[tuple[bytes | None, bytes]]]:
    """What ``peer`` holds under ``keys``: (subkey or None, value bytes) per entry."""
    found = await asyncio.wait_for(
        node.protocol.call_find(PeerID.from_base58(peer), [DHTID.generate(source=k) for k in keys]),
        SEND_TIMEOUT_S,
    )
    held: dict[str, list] = {}
    for key in keys:
        value = (found or {}).get(DHTID.generate(source=key), (None, {}))[0]
        if value is None:
            continue
        if hasattr(value.value, "items"):
            held[key] = [(sub, item.value) for sub, item in value.value.items()]
        else:
            held[key] = [(None, value.value)]
    return held


class HostileOptions(ProtocolAttackOptions):
    """The ``hostile`` attack takes no options: it mounts every case on every surface it reaches."""


@register_protocol_attack("hostile", HostileOptions)
class Hostile(ProtocolAttack):
    """Every hostile case on every surface; ``sent`` counts them by ``kind name category``, ``outcome``
    how the honest side answered, ``audits`` what each audit found."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.sent: Counter[str] = Counter()
        self.outcome: Counter[str] = Counter()
        self.mine: set[bytes] = set()  # subkeys and values this attacker stored (msgpack-serialized)
        self.captured: dict[str, tuple[bytes | None, bytes]] = {}  # an honest entry per key, to replay
        self.hellos: list[bytes] = []  # data-plane hellos of earlier connections, to replay
        self.audits: list[dict[str, int]] = []
        self._mounts = 0
        self._surfaces: list[Surface] | None = None

    def surfaces(self, target: ProtocolTarget) -> list[Surface]:
        if self._surfaces is None:
            import_packages(p for p in PROJECT_PACKAGES if p == "swarm")  # the attacker reads the library
            self._surfaces = surfaces(target.run_id, target.stages)
        return self._surfaces

    async def mount(self, target: ProtocolTarget) -> int:
        before = sum(self.sent.values())
        found = self.surfaces(target)
        nodes = [*target.dht_peers, *target.holders]
        await self._dht(target, [s for s in found if s.kind == "dht"], nodes)
        if target.holders:
            await self._p2p(target, [s for s in found if s.kind == "p2p"])
        if target.coordinator:
            await self._grpc(target, [s for s in found if s.kind == "grpc"])
        await self._data_plane(target)
        if nodes:
            self.audits.append(await self.audit(target, nodes))
        return sum(self.sent.values()) - before

    # --- DHT keys -----------------------------------------------------------------------------------

    def _entries(self, target: ProtocolTarget, surface: Surface, key: SigningKey) -> dict[str, tuple]:
        """(value, expiration, subkey) of each category for one key."""
        now, dumps = get_dht_time(), MSGPackSerializer.dumps
        own = dumps(key.peer_id)
        scope = run_keys(target.run_id, target.stages)[surface.name].scope
        lie = dumps(DHT_LIES[surface.case](target, key, scope))
        _, replayed = self.captured.get(surface.name, self.captured.get("any", (None, lie)))
        self.mine.update({dumps("!!!!"), own, dumps(b"junk")})
        return {
            MALFORMED: (b"\xc1\xff junk", now + 60, dumps("!!!!")),
            OVERSIZED: (dumps(os.urandom(OVERSIZED_VALUE_BYTES)), now + 60, own),
            FAR_FUTURE: (dumps(b"junk"), now + FAR_FUTURE_S, None),
            REPLAY: (replayed, now + FAR_FUTURE_S, own),
            LYING: (lie, now + 60, own),
        }

    async def _dht(self, target: ProtocolTarget, found: list[Surface], nodes: list[str]) -> None:
        """Every category to every key, one request per category and node; the oversized value goes to
        one key per mount, in turn (all of them would pass the daemon's 4 MiB and be dropped unread)."""
        if not nodes:
            return
        key = SigningKey.generate()
        entries = {s.name: self._entries(target, s, key) for s in found}
        batches = []
        for category in (MALFORMED, FAR_FUTURE, REPLAY, LYING):
            names = list(entries)
            batches.append((names, *map(list, zip(*(entries[n][category] for n in names), strict=True))))
        turn = found[self._mounts % len(found)]
        self._mounts += 1
        value, expiration, subkey = entries[turn.name][OVERSIZED]
        batches.append(([turn.name], [value], [expiration], [subkey]))
        for surface in found:
            for category in (MALFORMED, FAR_FUTURE, REPLAY, LYING):
                self.sent[f"dht {surface.case} {category}"] += len(nodes)
        self.sent[f"dht {turn.case} {OVERSIZED}"] += len(nodes)
        accepted = await target.dht.run_coroutine(_partial(_store_raw, nodes, batches), return_future=True)
        self.outcome["dht entries accepted"] += accepted

    async def audit(self, target: ProtocolTarget, nodes: list[str]) -> dict[str, int]:
        """Entries the honest ``nodes`` return for the run's keys (the most one holds) and how many of
        them are this attacker's (by subkey or value); captures an honest entry per key to replay."""
        keys = list(run_keys(target.run_id, target.stages))
        most = hostile = 0
        for node in nodes:
            try:
                held = await target.dht.run_coroutine(_partial(_find, node, keys), return_future=True)
            except Exception:
                continue
            most = max(most, sum(len(v) for v in held.values()))
            for name, items in held.items():
                for subkey, value in items:
                    if subkey in self.mine or value in self.mine or len(value) > OVERSIZED_VALUE_BYTES // 2:
                        hostile += 1
                    elif subkey is not None:
                        self.captured[name] = self.captured["any"] = (subkey, value)
        return {"most_entries": most, "hostile_entries": hostile, "nodes": len(nodes)}

    # --- libp2p handlers ----------------------------------------------------------------------------

    async def _p2p(self, target: ProtocolTarget, found: list[Surface]) -> None:
        from swarm.byzantine.surfaces import servicer_classes

        p2p = await target.dht.replicate_p2p()
        classes = {c.__name__: c for c in servicer_classes()}
        for surface in found:
            cls_name, method = surface.name.split(".")
            cls = classes[cls_name]
            handler = next(h for h in cls._rpc_handlers if h.method_name == method)
            streaming = handler.stream_input or handler.stream_output
            for namespace in namespaces(cls_name, target.run_id, target.stages):
                name = cls._get_handle_name(namespace, method)
                for holder in target.holders:
                    peer = PeerID.from_base58(holder)
                    lie = P2P_LIES[surface.case](target).SerializeToString()
                    for category, body in (
                        (MALFORMED, b"\x0a\xff\xff\xff\xff junk"),
                        (OVERSIZED, None),
                        (LYING, lie),
                    ):
                        label = f"p2p {surface.case} {category}"
                        if streaming:
                            send = _stream(p2p, peer, name, body)
                        else:
                            send = p2p._client.call_unary_handler(
                                peer, name, body if body is not None else bytes(UNARY_MAX_BYTES + 1024)
                            )
                        await _bounded(self.sent, self.outcome, label, send)

    # --- the coordinator's gRPC service ---------------------------------------------------------------

    async def _grpc(self, target: ProtocolTarget, found: list[Surface]) -> None:
        from swarm.rpc import CHANNEL_OPTIONS

        replayed = self.captured.get("any", (None, b""))[1]
        async with grpc.aio.insecure_channel(target.coordinator, options=CHANNEL_OPTIONS) as channel:
            for surface in found:
                lie = GRPC_LIES[surface.case](target)
                streaming = isinstance(lie, list)
                request_type = type(lie[0] if streaming else lie)
                replay = request_type()
                replay.CopyFrom(lie[0] if streaming else lie)
                if "envelope" in request_type.DESCRIPTOR.fields_by_name:
                    replay.envelope = _unpacked(replayed)
                cases = {
                    MALFORMED: b"\x0a\xff\xff\xff\xff junk",
                    OVERSIZED: bytes(GRPC_OVERSIZED_BYTES),
                    REPLAY: replay.SerializeToString(),
                    LYING: [m.SerializeToString() for m in lie] if streaming else lie.SerializeToString(),
                }
                path = surface.name
                for category, body in cases.items():
                    if streaming:
                        call = channel.stream_unary(path)
                        send = call(iter(body if isinstance(body, list) else [body]), timeout=SEND_TIMEOUT_S)
                    else:
                        send = channel.unary_unary(path)(body, timeout=SEND_TIMEOUT_S)
                    await _bounded(self.sent, self.outcome, f"grpc {surface.case} {category}", send)

    # --- the data plane -------------------------------------------------------------------------------

    async def _data_plane(self, target: ProtocolTarget) -> None:
        key = SigningKey.generate()
        for address in target.data_addresses:
            host, port = parse_address(address)
            for holder in target.holders or [key.peer_id]:
                hello = _hello_for(key, target.run_id, holder)
                replay = self.hellos[-1] if self.hellos else None
                for category, send in (
                    (MALFORMED, lambda g: b"HTTP/1.1 GET /\r\n\r\n" + bytes(256)),
                    (OVERSIZED, lambda g: os.urandom(OVERSIZED_VALUE_BYTES)),
                    (REPLAY, lambda g, r=replay, h=hello: r if r is not None else h(b"\0" * NONCE_BYTES)),
                    (LYING, lambda g, h=hello: h(g)),
                ):
                    label = f"data_plane DataPlane {category}"
                    await _bounded(self.sent, self.outcome, label, self._dial(host, port, send))
                self.hellos = [hello(os.urandom(NONCE_BYTES))]

    async def _dial(self, host: str, port: int, payload: Callable[[bytes], bytes]) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            greeting = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
            writer.write(payload(greeting[len(MAGIC) :]))
            await writer.drain()
            answer = await reader.read(PUBLIC_KEY_BYTES + SIGNATURE_BYTES)
            if not answer:
                raise ConnectionError("the data plane closed the connection")
        finally:
            writer.close()

    def report(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "outcome": dict(self.outcome), "audits": self.audits[-50:],
                "time": time.time()}  # fmt: skip


async def _stream(p2p: P2P, peer: PeerID, name: str, body: bytes | None) -> None:
    """One framed message to a stream handler (None: a length prefix of ``CLAIMED_BYTES`` and 64 KiB of
    it), then the end of the stream; waits for the answer or the close."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, name)
    try:
        size = CLAIMED_BYTES if body is None else len(body)
        writer.write(
            P2P.MESSAGE_MARKER + size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + (body or bytes(1 << 16))
        )
        if body is not None:
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        await writer.drain()
        await reader.read(1 << 16)
    finally:
        writer.close()


def _hello_for(key: SigningKey, run_id: str, server: str) -> Callable[[bytes], bytes]:
    """A well-formed hello from ``key`` (certified by nobody) for the server nonce it is given."""
    nonce = os.urandom(NONCE_BYTES)
    return lambda server_nonce: (
        MAGIC + key.public_key.raw + nonce + key.sign(_transcript(b"client", run_id, server_nonce, server))
    )


def _unpacked(value: bytes) -> bytes:
    """An honest record's envelope bytes out of its DHT value (msgpack bytes), or the value itself."""
    try:
        inner = MSGPackSerializer.loads(value)
    except Exception:
        return value
    return inner if isinstance(inner, bytes) else value


def _partial(fn: Callable, *args: Any) -> Callable:
    import functools

    return functools.partial(_call_in_child, fn, args)


async def _call_in_child(fn: Callable, args: tuple, dht: Any, node: Any) -> Any:
    return await fn(dht, node, *args)
