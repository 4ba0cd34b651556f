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
- unary handlers: random bytes and an empty request.

Example::

    attack = make_protocol_attack("hostile")
    sent = await attack.mount(ProtocolTarget(stock_dht, run_id, holders=[honest_peer_id]))
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.utils import get_dht_time
from pydantic import Field

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


def _namespaces() -> dict[type[ServicerBase], Callable[[str, int], list[str]]]:
    from swarm.averaging.averager import AveragingServicer
    from swarm.keyspace import stage_prefix
    from swarm.pipeline.server import StageServicer, pipeline_namespace
    from swarm.training.sync import StateServicer, state_namespace

    def prefixes(run_id: str, stages: int) -> list[str]:
        return [run_id] + ([stage_prefix(run_id, k) for k in range(stages)] if stages > 1 else [])

    return {
        AveragingServicer: lambda run_id, stages: [p.replace(".", "_") for p in prefixes(run_id, stages)],
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


class HostileOptions(ProtocolAttackOptions):
    """Options of ``hostile``: ``stages``, the run's pipeline stages (whose keys and handlers it reaches too)."""

    stages: int = Field(1, ge=1, le=64, description="the run's pipeline stages")


@register_protocol_attack("hostile", HostileOptions)
class Hostile(ProtocolAttack):
    """Malformed, oversized, far-future and replayed inputs at every DHT key and libp2p handler of the run."""

    def __init__(self, options: HostileOptions) -> None:
        super().__init__(options)
        self.refused = 0  # calls that ended in an error or a refusal (every one should)
        self.p2p: P2P | None = None

    async def mount(self, target: ProtocolTarget) -> int:
        sent = await self._dht(target)
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


def _one_per_rule(keys: dict) -> list[str]:
    """Every key but the ban list's later pages (their rule is the first page's): 7 keys in a
    data-parallel run rather than 133."""
    return [key for key, rule in keys.items() if rule.check != "ban_page" or rule.arg == 1]


def _handlers(cls: type[ServicerBase]) -> list:
    cls._collect_rpc_handlers()
    return list(cls._rpc_handlers)


__all__ = ["Hostile", "HostileOptions", "surface_classes", "surfaces"]
