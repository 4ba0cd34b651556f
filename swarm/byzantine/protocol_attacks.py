"""Protocol attacks for rehearsal: what an unadmitted process can try against a run's DHT and state servers.

The attacker has read this code, asked the coordinator's public ``Status`` RPC for the run ID and the
DHT's bootstrap addresses, and joined with a stock ``hivemind.DHT`` (no validators), a fresh key and no
certificate. Each attack is registered by name like ``swarm.byzantine.attacks``; ``mount(target)`` runs
it once and returns how many records or requests it sent, so a rehearsal mounts it again and again while
honest peers train:

- ``forged_progress``: a progress record one step ahead with the hash of a poisoned state, both as the
  old unsigned dict and as a record signed by a fresh, uncertified key;
- ``sybil_hash``: the same poisoned (step, hash) under many made-up peer IDs, to outvote honest peers;
- ``malformed_subkey``: a record ahead of the run under a subkey that is not a peer ID (``"!!!!"``);
- ``far_future``: ``b"junk"`` stored as a single value that expires in 30 years under every record key
  of the run (progress, pipeline, members, checkpoint, bans), to replace the real records;
- ``download_flood``: many concurrent state downloads from the holders, to exhaust their uplink;
- ``hostile`` (``swarm.byzantine.hostile``): malformed, oversized, far-future and replayed inputs at every
  DHT key and libp2p handler of the run, read from the code;
- ``coordinator_sybils`` (``swarm.byzantine.coordinator_sybils``): cheap identities that join, claim
  credit, inflate suspicions, stall accusations and ban themselves at the coordinator.

Example::

    attack = make_protocol_attack("sybil_hash", {"sybils": 8})
    sent = await attack.mount(ProtocolTarget(stock_dht, run_id, holders=[honest_peer_id]))
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field

from protocols import averaging_pb2 as apb
from protocols.envelope import open_envelope
from protocols.keys import SigningKey
from swarm.dht import SpawnedDHT
from swarm.records import PEER_KINDS, RUN_KINDS, record_key, seal_peer_record
from swarm.registry import Registry

POISON_HASH = hashlib.sha256(b"a poisoned training state").hexdigest()
FAR_FUTURE_S = 1e9


@dataclass
class ProtocolTarget:
    """What the attacker reaches: its own DHT node, the run, and the honest state holders it saw."""

    dht: hivemind.DHT | None  # None: no DHT node, for an attack on the coordinator alone (``hostile``)
    run_id: str
    holders: list[str] = field(default_factory=list)
    state_namespace: str = ""
    step: int = 0  # the highest honest step seen so far (the attacker's own junk may hide it later)
    coordinator: str = ""  # the coordinator's HOST:PORT, for attacks on its RPCs ("": none)


class ProtocolAttackOptions(BaseModel):
    """The options of a protocol attack that takes none (``far_future``); every attack's own options
    extend them, and unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ProtocolAttack:
    """Sends nothing; each named protocol attack overrides ``mount`` with what it stores or requests."""

    name = "none"

    def __init__(self, options: Any) -> None:
        self.options = options

    async def mount(self, target: ProtocolTarget) -> int:
        """Run the attack once; returns how many records or requests it sent."""
        return 0

    async def close(self) -> None:
        """Stop what the attack left running between mounts (streams, channels)."""


ProtocolAttackFactory = Callable[[Any], ProtocolAttack]
PROTOCOL_ATTACKS: Registry[ProtocolAttackFactory] = Registry(
    kind="protocol attack", group="swarm.protocol_attacks"
)


def register_protocol_attack(name: str, options_cls: type[BaseModel] = ProtocolAttackOptions) -> Callable:
    return PROTOCOL_ATTACKS.register(name, options_cls)


def protocol_attack_names() -> list[str]:
    return PROTOCOL_ATTACKS.names()


def make_protocol_attack(name: str, options: Mapping[str, Any] | None = None) -> ProtocolAttack:
    attack = PROTOCOL_ATTACKS.get(name).factory(PROTOCOL_ATTACKS.validate(name, options))
    attack.name = name
    return attack


async def observed_step(dht: hivemind.DHT, run_id: str) -> int:
    """The highest step in the run's progress records, as anyone reading the DHT sees it."""
    found = await dht.get(record_key(run_id, "progress"), latest=True, return_future=True)
    steps = [0]
    for item in (
        getattr(found, "value", {}).values() if isinstance(getattr(found, "value", None), dict) else []
    ):
        try:
            steps.append(
                int(open_envelope(item.value, purpose=PEER_KINDS["progress"], run_id=run_id).body["step"])
            )
        except Exception:
            continue
    return max(steps)


async def _store_progress(
    dht: hivemind.DHT, run_id: str, subkey: str, step: int, *, signer: SigningKey | None
) -> bool:
    body = {"step": step, "samples": 10**6, "samples_per_s": 1e6, "state_hash": POISON_HASH}
    value: object = body if signer is None else seal_peer_record(signer, "progress", run_id, body, b"")
    return bool(
        await dht.store(
            record_key(run_id, "progress"), value, get_dht_time() + 60, subkey=subkey, return_future=True
        )
    )


class AheadOptions(ProtocolAttackOptions):
    """Options of ``forged_progress`` (and of the other progress forgers): ``steps_ahead``, how many steps
    past the highest honest step the forged records claim."""

    steps_ahead: int = Field(1, ge=0, le=2**62, description="how far ahead of the run the forged step is")


@register_protocol_attack("forged_progress", AheadOptions)
class ForgedProgress(ProtocolAttack):
    """Stores a progress record ``steps_ahead`` past the run with the poisoned state's hash, twice:
    unsigned under the attacker node's peer ID, and signed by a fresh, uncertified key under its own."""

    async def mount(self, target: ProtocolTarget) -> int:
        step = max(target.step, await observed_step(target.dht, target.run_id)) + self.options.steps_ahead
        key = SigningKey.generate()
        await _store_progress(target.dht, target.run_id, target.dht.peer_id.to_base58(), step, signer=None)
        await _store_progress(target.dht, target.run_id, key.peer_id, step, signer=key)
        return 2


class SybilOptions(AheadOptions):
    """Options of ``sybil_hash``: ``sybils``, how many made-up peer IDs vouch for the poisoned hash, and
    ``steps_ahead``."""

    sybils: int = Field(8, ge=1, le=256, description="made-up peer IDs that vouch for the poisoned hash")


@register_protocol_attack("sybil_hash", SybilOptions)
class SybilHash(ProtocolAttack):
    """Stores the same poisoned progress record under ``sybils`` fresh, uncertified keys, each signing
    its own, to outvote the honest peers."""

    async def mount(self, target: ProtocolTarget) -> int:
        step = max(target.step, await observed_step(target.dht, target.run_id)) + self.options.steps_ahead
        keys = [SigningKey.generate() for _ in range(self.options.sybils)]
        await asyncio.gather(
            *(_store_progress(target.dht, target.run_id, k.peer_id, step, signer=k) for k in keys)
        )
        return len(keys)


class SubkeyOptions(AheadOptions):
    """Options of ``malformed_subkey``: ``subkey``, the subkey that is not a peer ID, and ``steps_ahead``."""

    subkey: str = Field("!!!!", max_length=64, description="a subkey that is not a base58 peer ID")


@register_protocol_attack("malformed_subkey", SubkeyOptions)
class MalformedSubkey(ProtocolAttack):
    """Stores a poisoned progress record ahead of the run under ``subkey``, which names no peer: once
    unsigned, once signed by a fresh key."""

    async def mount(self, target: ProtocolTarget) -> int:
        step = max(target.step, await observed_step(target.dht, target.run_id)) + self.options.steps_ahead
        await _store_progress(target.dht, target.run_id, self.options.subkey, step, signer=None)
        await _store_progress(
            target.dht, target.run_id, self.options.subkey, step, signer=SigningKey.generate()
        )
        return 2


@register_protocol_attack("far_future")
class FarFuture(ProtocolAttack):
    """Stores ``b"junk"`` as a single value expiring about 30 years from now under every record key of the
    run, to replace the real records."""

    async def mount(self, target: ProtocolTarget) -> int:
        expiration = get_dht_time() + FAR_FUTURE_S
        keys = [record_key(target.run_id, kind) for kind in (*PEER_KINDS, *RUN_KINDS)]
        await asyncio.gather(*(target.dht.store(k, b"junk", expiration, return_future=True) for k in keys))
        return len(keys)


class FloodOptions(ProtocolAttackOptions):
    """Options of ``download_flood``: ``requests``, the concurrent state downloads it opens per holder."""

    requests: int = Field(16, ge=1, le=1024, description="concurrent state downloads per holder")


@register_protocol_attack("download_flood", FloodOptions)
class DownloadFlood(ProtocolAttack):
    """Counts the state bytes the holders sent, and their refusals; an attacker that is refused gets no bytes."""

    received_bytes = refusals = failures = 0

    async def mount(self, target: ProtocolTarget) -> int:
        from hivemind.p2p import PeerID
        from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError

        from swarm.training.sync import StateServicer

        p2p = await target.dht.replicate_p2p()

        async def one(holder: str) -> None:
            stub = StateServicer.get_stub(p2p, PeerID.from_base58(holder), namespace=target.state_namespace)
            try:
                async for chunk in await stub.rpc_download_state(apb.StateRequest(run_id=target.run_id)):
                    self.received_bytes += len(chunk.data)
                    self.refusals += bool(chunk.error)
            except (
                P2PHandlerError
            ):  # refused by the holder's inbound bound or admission, before its handler ran
                self.refusals += 1
            except Exception:  # an unreachable holder or a dropped stream: the flood goes on
                self.failures += 1

        requests = [one(h) for h in target.holders for _ in range(self.options.requests)]
        await asyncio.gather(*requests)
        return len(requests)


async def rehearse(
    run_id: str,
    initial_peers: list[str],
    names: list[str],
    *,
    interval_s: float,
    duration_s: float,
    coordinator: str = "",
) -> dict[str, int]:
    """Mount ``names`` every ``interval_s`` for ``duration_s`` from a stock hivemind.DHT; returns what was sent."""
    from swarm.training.sync import state_namespace

    # hivemind's DHT with a fresh key and no validators, in a spawned child: a fork of this threaded
    # process can hang on a lock held at the moment of the fork (see swarm.dht).
    dht = SpawnedDHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    attacks = [make_protocol_attack(n, {"requests": 2} if n == "download_flood" else None) for n in names]
    sent = dict.fromkeys(names, 0)
    target = ProtocolTarget(dht, run_id, state_namespace=state_namespace(run_id), coordinator=coordinator)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration_s
    try:
        while loop.time() < deadline:
            found = await dht.get(record_key(run_id, "progress"), latest=True, return_future=True)
            value = getattr(found, "value", None)
            if isinstance(value, dict):
                target.holders = sorted(set(target.holders) | {k for k in value if str(k).startswith("12D3")})
                target.step = max(target.step, await observed_step(dht, run_id))
            for attack in attacks:
                if attack.name == "far_future" and not target.holders:
                    continue  # its junk would hide the honest records from this node too: look first
                try:
                    sent[attack.name] += await asyncio.wait_for(attack.mount(target), timeout=30)
                except Exception as e:  # an attack that fails this time is mounted again next time
                    print(f"{attack.name}: {e!r}", flush=True)
            print(
                f"sent so far: {sent}; honest step {target.step}, holders {len(target.holders)}", flush=True
            )
            await asyncio.sleep(interval_s)
    finally:
        for attack in attacks:
            await attack.close()
        dht.shutdown()
    return sent


def main(argv: list[str] | None = None) -> int:
    """``python -m swarm.byzantine.protocol_attacks --run-id R --initial-peers MADDR... --attack NAME...``"""
    import argparse

    parser = argparse.ArgumentParser(description="mount protocol attacks on a run's DHT (rehearsal only)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--attack", nargs="+", choices=protocol_attack_names(), required=True)
    parser.add_argument("--coordinator", default="", help="HOST:PORT of the coordinator's RPCs")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    sent = asyncio.run(
        rehearse(
            args.run_id,
            args.initial_peers,
            args.attack,
            interval_s=args.interval_s,
            duration_s=args.duration_s,
            coordinator=args.coordinator,
        )
    )
    print(f"sent: {sent}", flush=True)
    return 0


if __name__ == "__main__":
    # Run as the package's module, whose registry the package's ``hostile`` registered into (not this
    # __main__ copy's).
    from swarm.byzantine.protocol_attacks import main as package_main

    raise SystemExit(package_main())
