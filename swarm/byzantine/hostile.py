"""``hostile``: one protocol attack that reaches every inbound surface of a run an unadmitted process can.

The surfaces are read from the code, not listed by hand: every DHT key the run uses
(``swarm.keyspace.run_keys``) and every libp2p handler of every servicer the project registers
(``surfaces``: each ``BoundedServicer`` subclass with the namespaces it is served under). A servicer
class with no entry in ``NAMESPACES`` fails ``tests/test_hostile.py``, so a new surface cannot go
unrehearsed. Each mount sends, to each surface:

- DHT keys (each rule once: the ban list's first page stands for its others): junk as a single value
  that expires in 30 years, 12 KiB under a subkey of the attacker's,
  junk under a made-up peer ID subkey, and every record the key holds now stored again with a far-future
  expiration (a replay);
- stream handlers, at each honest holder: an unknown frame marker, a length prefix of 2^40 bytes, a
  well-framed message of random bytes, a well-formed empty request, and a stream that sends nothing;
- unary handlers: random bytes and an empty request;
- the coordinator's gRPC RPCs, when the target names a coordinator (``coordinator_rpcs``: read from
  ``protocols/coordinator.proto``; one without crafted inputs in ``CRAFTED`` fails
  ``tests/test_hostile.py``): to each, random bytes, an empty request and a request four times gRPC's
  message cap; to each bound to a run, a well-formed request for another run; to each signed one,
  envelopes dated 30 years ahead and behind (and, but to ``Join``, one signed by a key that never
  joined); its own accepted join, heartbeat and leave replayed (it joins under one key of its own, kept
  across mounts, and leaves at the end of each); to ``Accuse`` also evidence past what its signed part
  claims, a claim past the evidence cap, its heartbeat's envelope, a stream closed with no part and a
  stream that sends nothing (held for ``stall_s``). The answers of the last mount are kept in
  ``answers``: each should be a refusal naming what is wrong, never INTERNAL, OK or a timeout.

Example::

    attack = make_protocol_attack("hostile")
    sent = await attack.mount(ProtocolTarget(stock_dht, run_id, holders=[honest_peer_id]))
    await attack.mount(ProtocolTarget(None, run_id, coordinator="127.0.0.1:31330"))  # the coordinator alone
    assert all(answer.code != "INTERNAL" for answer in attack.answers)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.utils import get_dht_time
from pydantic import Field

from protocols import coordinator_pb2 as cpb
from protocols.envelope import seal
from protocols.keys import SigningKey
from protocols.messages import ACCUSE, HEARTBEAT, JOIN, LEAVE
from protocols.version import MAX_GRPC_MESSAGE_BYTES, PROTOCOL_VERSION
from swarm.averaging.evidence import MAX_EVIDENCE_BYTES
from swarm.byzantine.protocol_attacks import (
    FAR_FUTURE_S,
    ProtocolAttack,
    ProtocolAttackOptions,
    ProtocolTarget,
    register_protocol_attack,
)

# More than any record of the run needs (a few hundred bytes to a few KiB). A stock DHT's child process
# fails on its own pipe once a request or a lookup's answer nears 64 KiB (larger stores are
# tests/test_dht_trust.py's, from the project's own nodes).
OVERSIZED_VALUE_BYTES = 12 << 10
MAX_REPLAYED_BYTES = 4 << 10
CALL_TIMEOUT_S = 5.0
# What gRPC's asyncio client says when its write fails after the server ended a client stream early
# (grpc/grpc#36066), in place of the server's own status; such a probe is sent again, at most this often.
CORE_ERROR = "Internal error from Core"
CORE_ERROR_TRIES = 3
COORDINATOR = cpb.DESCRIPTOR.services_by_name["Coordinator"]
# Past gRPC's receive cap, which refuses it before any handler of the coordinator runs.
OVERSIZED_REQUEST_BYTES = 4 * MAX_GRPC_MESSAGE_BYTES


def _namespaces() -> dict[type[ServicerBase], Callable[[str, int], list[str]]]:
    from swarm.averaging.averager import AveragingServicer
    from swarm.averaging.tiers import tier_prefix
    from swarm.averaging.tierserve import TierServicer
    from swarm.pipeline.server import StageServicer, pipeline_namespace
    from swarm.records import stage_prefix
    from swarm.training.sync import StateServicer, state_namespace

    def prefixes(run_id: str, stages: int) -> list[str]:
        return [run_id] + ([stage_prefix(run_id, k) for k in range(stages)] if stages > 1 else [])

    return {
        AveragingServicer: lambda run_id, stages: [
            p.replace(".", "_") for p in [*prefixes(run_id, stages), tier_prefix(run_id)]
        ],
        TierServicer: lambda run_id, stages: [tier_prefix(run_id).replace(".", "_")],
        StateServicer: lambda run_id, stages: [state_namespace(p) for p in prefixes(run_id, stages)],
        StageServicer: lambda run_id, stages: (
            [pipeline_namespace(run_id, k) for k in range(stages)] if stages > 1 else []
        ),
    }


def surfaces(run_id: str, stages: int = 1) -> list[tuple[type[ServicerBase], str]]:
    """Every (servicer class, namespace) a peer of run ``run_id`` may serve libp2p handlers under."""
    return [(cls, ns) for cls, names in _namespaces().items() for ns in names(run_id, stages)]


def surface_classes() -> set[type[ServicerBase]]:
    """The servicer classes ``surfaces`` knows how to reach."""
    return set(_namespaces())


def coordinator_rpcs() -> list[str]:
    """Every RPC of the coordinator's gRPC service, as ``protocols/coordinator.proto`` declares them."""
    return [method.name for method in COORDINATOR.methods]


class HostileOptions(ProtocolAttackOptions):
    """Options of ``hostile``: ``stages``, the run's pipeline stages (whose keys and handlers it reaches
    too), and ``stall_s``, how long its silent ``Accuse`` stream waits for the coordinator to cut it off."""

    stages: int = Field(1, ge=1, le=64, description="the run's pipeline stages")
    stall_s: float = Field(10.0, gt=0, le=120, description="seconds the silent Accuse stream is held open")


@dataclass(frozen=True)
class Answer:
    """What the coordinator answered one hostile call: the gRPC status code's name (``OK``: it was
    accepted; ``DEADLINE_EXCEEDED``: no answer within the call's bound) and its message."""

    rpc: str
    probe: str
    code: str
    details: str
    elapsed_s: float


@register_protocol_attack("hostile", HostileOptions)
class Hostile(ProtocolAttack):
    """Malformed, oversized, far-future and replayed inputs at every DHT key and libp2p handler of the run."""

    def __init__(self, options: HostileOptions) -> None:
        super().__init__(options)
        self.refused = 0  # calls that ended in an error or a refusal (every one should)
        self.p2p: P2P | None = None
        self.key = SigningKey.generate()  # the one identity it joins the coordinator under, mount after mount
        self.answers: list[Answer] = []  # the coordinator's answers to the last mount's hostile calls
        self._channel: grpc.aio.Channel | None = None

    async def mount(self, target: ProtocolTarget) -> int:
        sent = 0
        if target.coordinator:
            if self._channel is None:  # sends past the cap, so that the coordinator is the one to refuse
                self._channel = grpc.aio.insecure_channel(
                    target.coordinator,
                    options=[
                        ("grpc.max_send_message_length", -1),
                        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
                    ],
                )
            calls = _CoordinatorCalls(self._channel, target.run_id, self.key, self.options.stall_s)
            sent += await calls.run()
            self.answers = calls.answers
            self.refused += sum(answer.code != "OK" for answer in calls.answers)
        if target.dht is None:
            return sent
        sent += await self._dht(target)
        if self.p2p is None:
            self.p2p = await target.dht.replicate_p2p()
        calls = [
            self._handler(self.p2p, PeerID.from_base58(holder), cls, namespace, handler)
            for holder in target.holders
            for cls, namespace in surfaces(target.run_id, self.options.stages)
            for handler in _handlers(cls)
        ]
        for sent_here in await asyncio.gather(*calls):
            sent += sent_here
        return sent

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _dht(self, target: ProtocolTarget) -> int:
        from swarm.keyspace import run_keys

        dht, far = target.dht, get_dht_time() + FAR_FUTURE_S
        mine = dht.peer_id.to_base58()
        stored = 0

        async def store(key: str, value: object, expiration: float, subkey: str | None = None) -> None:
            # One at a time: a stock DHT's child process fails on a burst of large requests down its pipe.
            nonlocal stored
            stored += 1
            future = dht.store(key, value, expiration, subkey=subkey, return_future=True)
            await self._call(asyncio.wait_for(future, CALL_TIMEOUT_S * 2))

        for key in _one_per_rule(run_keys(target.run_id, self.options.stages)):
            await store(key, b"junk", far)
            await store(key, os.urandom(OVERSIZED_VALUE_BYTES), get_dht_time() + 60, subkey=mine)
            await store(key, b"junk", far, subkey="12D3KooW" + "x" * 44)
            found = await dht.get(key, latest=True, return_future=True)
            value = getattr(found, "value", None)
            if isinstance(value, dict):  # the honest records under it, stored again to live for 30 years
                for subkey, item in list(value.items())[:16]:
                    if isinstance(item.value, bytes) and len(item.value) <= MAX_REPLAYED_BYTES:
                        await store(key, item.value, far, subkey=subkey)
        return stored

    async def _handler(self, p2p: P2P, holder: PeerID, cls, namespace: str, handler) -> int:
        name = cls._get_handle_name(namespace, handler.method_name)
        empty = handler.request_type().SerializeToString()
        if not (handler.stream_input or handler.stream_output):
            payloads = [os.urandom(64), empty]
            for payload in payloads:
                await self._call(p2p._client.call_unary_handler(holder, name, payload))
            return len(payloads)
        marker, header = P2P.MESSAGE_MARKER, P2P.HEADER_LEN
        frames = [
            b"\x07" + os.urandom(64),  # an unknown frame marker
            marker + (1 << 40).to_bytes(header, P2P.BYTEORDER) + os.urandom(1024),  # claims a terabyte
            marker + (256).to_bytes(header, P2P.BYTEORDER) + os.urandom(256),  # random bytes, well framed
            marker + len(empty).to_bytes(header, P2P.BYTEORDER) + empty,  # a well-formed empty request
            b"",  # a stream that sends nothing and leaves
        ]
        for frame in frames:
            await self._call(self._stream(p2p, holder, name, frame))
        return len(frames)

    async def _stream(self, p2p: P2P, holder: PeerID, name: str, frame: bytes) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(holder, name)
        try:
            writer.write(frame)
            await writer.drain()
            await asyncio.wait_for(reader.read(4096), CALL_TIMEOUT_S / 5)
        except asyncio.TimeoutError:
            pass
        finally:
            writer.close()

    async def _call(self, call) -> None:
        try:
            await asyncio.wait_for(call, CALL_TIMEOUT_S)
        except Exception:  # refused, reset or unreachable: what an honest peer should answer
            self.refused += 1


class _CoordinatorCalls:
    """One mount's calls at the coordinator, made one at a time (the silent stream alongside); each call
    is bounded by ``CALL_TIMEOUT_S`` and its answer kept in ``answers``."""

    def __init__(self, channel: grpc.aio.Channel, run_id: str, key: SigningKey, stall_s: float) -> None:
        self.channel, self.run_id, self.key, self.stall_s = channel, run_id, key, stall_s
        self.other_run = f"not.{run_id}"
        self.answers: list[Answer] = []
        self.honest_calls = 0
        self.heartbeat_envelope = b""  # its accepted heartbeat's signed envelope, replayed as an accusation

    async def run(self) -> int:
        silent = [
            asyncio.create_task(self.stream(m.name, "a stream that sends nothing", [], hold=True))
            for m in COORDINATOR.methods
            if m.client_streaming
        ]
        for method in COORDINATOR.methods:
            junk = {
                "random bytes": os.urandom(64),
                "an empty request": b"",
                f"{OVERSIZED_REQUEST_BYTES} bytes, past the message cap": os.urandom(OVERSIZED_REQUEST_BYTES),
            }
            for probe, payload in junk.items():
                if method.client_streaming:
                    await self.stream(method.name, probe, [payload])
                else:
                    await self.unary(method.name, probe, payload)
            if method.client_streaming:
                await self.stream(method.name, "a stream closed with no part", [])
        for name, crafted in CRAFTED.items():
            if name in COORDINATOR.methods_by_name:
                await crafted(self)
        await asyncio.gather(*silent)
        return len(self.answers) + self.honest_calls

    # --- calls ---------------------------------------------------------------------------------------

    def _path(self, rpc: str) -> str:
        return f"/{COORDINATOR.full_name}/{rpc}"

    def header(self, run_id: str | None = None, *, version: int = PROTOCOL_VERSION) -> cpb.Header:
        return cpb.Header(protocol_version=version, run_id=self.run_id if run_id is None else run_id)

    def dates(self) -> dict[str, float]:
        now = time.time()
        return {"a far-future timestamp": now + FAR_FUTURE_S, "a far-past timestamp": now - FAR_FUTURE_S}

    async def unary(self, rpc: str, probe: str, request: Message | bytes) -> None:
        await self._answer(
            rpc, probe, self.channel.unary_unary(self._path(rpc))(_raw(request), timeout=CALL_TIMEOUT_S)
        )

    async def honest(self, rpc: str, request: Message) -> bytes | None:
        """An honest-looking call of its own (to have something to replay); its answer, None if refused."""
        self.honest_calls += 1
        try:
            return await self.channel.unary_unary(self._path(rpc))(_raw(request), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None

    async def stream(self, rpc: str, probe: str, parts: list[Message | bytes], *, hold: bool = False) -> None:
        held = asyncio.Event()  # never set: a held stream stays open until the call ends

        async def requests() -> AsyncIterator[bytes]:
            for part in parts:
                yield _raw(part)
            if hold:
                await asyncio.wait_for(held.wait(), self.stall_s + CALL_TIMEOUT_S)

        timeout_s = self.stall_s if hold else CALL_TIMEOUT_S
        for attempt in range(CORE_ERROR_TRIES):
            if attempt:
                # The server refused before this client half-closed, and gRPC's asyncio client reported
                # its own failed write instead of the server's status (grpc/grpc#36066): ask again.
                self.answers.pop()
            await self._answer(
                rpc, probe, self.channel.stream_unary(self._path(rpc))(requests(), timeout=timeout_s)
            )
            last = self.answers[-1]
            if not (last.code == "INTERNAL" and CORE_ERROR in last.details):
                return

    async def _answer(self, rpc: str, probe: str, call: Awaitable[bytes]) -> None:
        started = time.monotonic()
        try:
            await call
            code, details = "OK", ""
        except grpc.aio.AioRpcError as e:
            code, details = e.code().name, e.details() or ""
        self.answers.append(Answer(rpc, probe, code, details[:300], time.monotonic() - started))

    # --- what each RPC is sent besides junk (``CRAFTED``) ---------------------------------------------

    async def challenge(self) -> None:
        await self.unary(
            "Challenge", "another run's ID", cpb.ChallengeRequest(header=self.header(self.other_run))
        )
        await self.unary(
            "Challenge", "an unknown protocol version",
            cpb.ChallengeRequest(header=self.header(version=PROTOCOL_VERSION + 1000)),
        )  # fmt: skip

    async def join(self) -> None:
        answer = await self.honest("Challenge", cpb.ChallengeRequest(header=self.header()))
        challenge = cpb.ChallengeResponse.FromString(answer).challenge if answer else os.urandom(32)

        def body(challenge: bytes) -> dict:
            return {
                "challenge": challenge,
                "name": "hostile",
                "device": "cpu",
                "role": "auto",
                "token_proof": b"",
            }

        request = cpb.JoinRequest(
            header=self.header(), envelope=seal(self.key, JOIN, self.run_id, body(challenge))
        )
        await self.honest("Join", request)
        await self.unary("Join", "its own accepted join, replayed", request)
        await self.unary(
            "Join", "another run's ID",
            cpb.JoinRequest(
                header=self.header(self.other_run),
                envelope=seal(self.key, JOIN, self.other_run, body(os.urandom(32))),
            ),
        )  # fmt: skip
        for probe, at in self.dates().items():
            envelope = seal(self.key, JOIN, self.run_id, body(os.urandom(32)), now=at)
            await self.unary("Join", probe, cpb.JoinRequest(header=self.header(), envelope=envelope))
        junk = {**body(b"short"), "name": "n" * 1000, "role": "king"}
        envelope = seal(self.key, JOIN, self.run_id, junk)
        await self.unary(
            "Join", "a body out of its bounds", cpb.JoinRequest(header=self.header(), envelope=envelope)
        )

    async def heartbeat(self) -> None:
        def request(
            seq: int, *, key: SigningKey | None = None, run_id: str | None = None, at: float | None = None
        ):
            run_id = self.run_id if run_id is None else run_id
            body = {"seq": seq, "state": "online", "metrics": {}, "step": 0, "param_hash": "", "suspects": []}
            envelope = seal(key or self.key, HEARTBEAT, run_id, body, now=at)
            return cpb.HeartbeatRequest(header=self.header(run_id), envelope=envelope)

        accepted = request(time.time_ns())
        self.heartbeat_envelope = accepted.envelope
        await self.honest("Heartbeat", accepted)
        await self.unary("Heartbeat", "its own accepted heartbeat, replayed", accepted)
        await self.unary("Heartbeat", "an older sequence number", request(1))
        await self.unary("Heartbeat", "another run's ID", request(time.time_ns(), run_id=self.other_run))
        for probe, at in self.dates().items():
            await self.unary("Heartbeat", probe, request(time.time_ns(), at=at))
        await self.unary(
            "Heartbeat", "a key that never joined", request(time.time_ns(), key=SigningKey.generate())
        )

    async def leave(self) -> None:
        def request(*, key: SigningKey | None = None, run_id: str | None = None, at: float | None = None):
            run_id = self.run_id if run_id is None else run_id
            envelope = seal(
                key or self.key, LEAVE, run_id, {"seq": time.time_ns(), "reason": "hostile"}, now=at
            )
            return cpb.LeaveRequest(header=self.header(run_id), envelope=envelope)

        for probe, at in self.dates().items():
            await self.unary("Leave", probe, request(at=at))
        await self.unary("Leave", "another run's ID", request(run_id=self.other_run))
        await self.unary("Leave", "a key that never joined", request(key=SigningKey.generate()))
        accepted = request()
        await self.honest("Leave", accepted)
        await self.unary("Leave", "its own accepted leave, replayed", accepted)

    async def status(self) -> None:
        await self.unary("Status", "another run's ID", cpb.StatusRequest(header=self.header(self.other_run)))
        await self.unary(
            "Status",
            "a cursor past 128 characters",
            cpb.StatusRequest(header=self.header(), after_peer_id="z" * 4096),
        )

    async def dial_back(self) -> None:
        # DialBack serves any run (a volunteer checks its ports before it joins one): no run ID to get wrong.
        await self.unary(
            "DialBack", "an unknown protocol version",
            cpb.DialBackRequest(header=self.header("", version=PROTOCOL_VERSION + 1000), ports=[1]),
        )  # fmt: skip
        await self.unary(
            "DialBack", "ports out of range", cpb.DialBackRequest(header=self.header(""), ports=[0, 70000])
        )
        await self.unary(
            "DialBack",
            "more ports than it dials",
            cpb.DialBackRequest(header=self.header(""), ports=[1, 2, 3, 4, 5]),
        )

    async def accuse(self) -> None:
        evidence = os.urandom(1024)
        signed = hashlib.sha256(evidence).digest()
        body = {
            "accused": self.key.peer_id,
            "reason": "hostile",
            "evidence_sha256": signed,
            "evidence_bytes": 1024,
        }

        def first(
            body: dict, *, key: SigningKey | None = None, run_id: str | None = None, at: float | None = None
        ) -> cpb.AccusationPart:
            run_id = self.run_id if run_id is None else run_id
            envelope = seal(key or self.key, ACCUSE, run_id, body, now=at)
            return cpb.AccusationPart(header=self.header(run_id), envelope=envelope)

        piece = cpb.AccusationPart(evidence=evidence)
        # Signed by the identity it joined under, against itself (a peer of the run), so that the
        # coordinator reads on to its evidence: past what it signed for, a piece at a time or after it.
        many = [cpb.AccusationPart(evidence=evidence[:1000])] * 64
        await self.stream("Accuse", "64 parts of evidence past the 1 KiB it signed for", [first(body), *many])
        await self.stream("Accuse", "63 parts after its complete evidence", [first(body), *[piece] * 64])
        claim = {**body, "evidence_bytes": MAX_EVIDENCE_BYTES + 1}
        await self.stream("Accuse", "a claim past the evidence cap", [first(claim), piece])
        await self.stream("Accuse", "another run's ID", [first(body, run_id=self.other_run), piece])
        for probe, at in self.dates().items():
            await self.stream("Accuse", probe, [first(body, at=at), piece])
        replayed = cpb.AccusationPart(header=self.header(), envelope=self.heartbeat_envelope)
        await self.stream("Accuse", "its own accepted heartbeat's envelope, replayed", [replayed, piece])
        await self.stream("Accuse", "evidence before any signed part", [piece, piece])
        never_joined = first(body, key=SigningKey.generate())
        await self.stream("Accuse", "a key that never joined", [never_joined, piece])


# The inputs crafted for each RPC, in the order they are sent: joined before its heartbeats and
# accusations are replayed, and left last. An RPC of the proto missing here fails tests/test_hostile.py.
CRAFTED: dict[str, Callable[[_CoordinatorCalls], Awaitable[None]]] = {
    "Challenge": _CoordinatorCalls.challenge,
    "Join": _CoordinatorCalls.join,
    "Heartbeat": _CoordinatorCalls.heartbeat,
    "Status": _CoordinatorCalls.status,
    "DialBack": _CoordinatorCalls.dial_back,
    "Accuse": _CoordinatorCalls.accuse,
    "Leave": _CoordinatorCalls.leave,
}


def _raw(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _one_per_rule(keys: dict) -> list[str]:
    """Every key but the ban list's later pages (their rule is the first page's): 7 keys in a
    data-parallel run rather than 133."""
    return [key for key, rule in keys.items() if rule.check != "ban_page" or rule.arg == 1]


def _handlers(cls: type[ServicerBase]) -> list:
    cls._collect_rpc_handlers()
    return list(cls._rpc_handlers)


__all__ = [
    "CRAFTED",
    "Answer",
    "Hostile",
    "HostileOptions",
    "coordinator_rpcs",
    "surface_classes",
    "surfaces",
]
