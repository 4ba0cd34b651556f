"""Deny by default in the DHT: a stranger (no certificate, no validators) stores nothing an honest node
keeps, cannot stop groups from forming, and cannot fill an honest node's storage; every key the run uses
has a check, and every other key is refused."""

from __future__ import annotations

import ast
import asyncio
import functools
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import stock_dht
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.timed_storage import TimedStorage

from protocols.certificates import issue_certificate
from protocols.envelope import seal
from protocols.errors import SwarmError
from protocols.keys import SigningKey
from protocols.messages import CHECKPOINT_RECORD, MAX_BAN_PAGES
from swarm.averaging.averager import Averager
from swarm.averaging.declarations import matchmaking_key, open_declaration, seal_declaration
from swarm.averaging.tiers import tier_prefix
from swarm.bans import ban_list_key, fetch_ban_list, publish_ban_list
from swarm.config import PipelineConfig
from swarm.dht import start_local_dhts, visible_maddrs
from swarm.dhtstorage import BoundedStorage, StorageLimits, storage_usage
from swarm.keyspace import MAX_STAGES, RunValidator, run_keys, stage_prefix
from swarm.pipeline.moves import stage_prefix as pipeline_stage_prefix
from swarm.records import PEER_KINDS, VALIDATED_KINDS, RecordSigner, record_key, seal_peer_record

RUN = "dht-trust-run"
THIRTY_YEARS_S = 30 * 365 * 86400.0
NUMEL = 1000
REGULAR = MSGPackSerializer.dumps(None)


def _record(key: str, value: object, expiration_time: float, subkey: object = None) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration_time,
    )


async def _flood(dht, node, *, count: int, size: int, expiration_time: float) -> None:
    """What an attacker's node runs: ``count`` random values of ``size`` bytes under random keys."""
    for _ in range(count):
        await node.store(os.urandom(16).hex(), os.urandom(size), expiration_time)


async def _plant_empty_dictionary(dht, node, *, key: str, expiration_time: float) -> None:
    """What an attacker's node runs: hold an empty dictionary under ``key``, to answer lookups with it."""
    TimedStorage.store(
        node.protocol.storage, DHTID.generate(source=key), DictionaryDHTValue(), expiration_time
    )


@pytest.mark.timeout(150)
def test_a_strangers_stores_are_refused_and_honest_peers_still_average(tmp_path):
    coordinator = SigningKey.generate()
    honest = start_local_dhts(3, tmp_path, validators=[RunValidator(RUN, coordinator.public_key)])
    stranger = stock_dht(visible_maddrs(honest[0][0]))
    try:
        far = get_dht_time() + THIRTY_YEARS_S
        # (a) a plain far-future value on the matchmaking key, and an unsigned hivemind declaration;
        stranger.store(matchmaking_key(RUN), True, far)
        stranger.store(matchmaking_key(RUN), True, get_dht_time() + 60, subkey=stranger.peer_id.to_bytes())
        # (b) junk under a random key and under the run's record keys;
        stranger.store(f"junk-{os.urandom(8).hex()}", b"junk", far)
        for kind in VALIDATED_KINDS:
            stranger.store(record_key(RUN, kind), b"junk", far, subkey="someone")
        # (c) many large records: 16 x 1 MiB under random keys, built inside the stranger's DHT process.
        stranger.run_coroutine(functools.partial(_flood, count=16, size=1 << 20, expiration_time=far))

        for dht, _ in honest:
            entries, nbytes = dht.run_coroutine(storage_usage)
            assert (entries, nbytes) == (0, 0), "an honest node kept something a stranger stored"
        assert honest[1][0].get(matchmaking_key(RUN), latest=True) is None

        # (d) an empty dictionary expiring last, served by the stranger's node, would hide the ban list.
        banned = {SigningKey.generate().peer_id}
        # A store can time out on a loaded machine (seen once in a CI rehearsal); the coordinator publishes
        # its list again, as this does, at most 3 times.
        assert any(
            asyncio.run(
                publish_ban_list(honest[0][0], coordinator, RUN, banned, changed_at=time.time(), ttl_s=60)
            )
            for _ in range(3)
        )
        stranger.run_coroutine(
            functools.partial(_plant_empty_dictionary, key=ban_list_key(RUN), expiration_time=far)
        )
        for dht, _ in honest[1:]:
            found = asyncio.run(fetch_ban_list(dht, RUN, coordinator.public_key))
            assert found is not None and found[1] == banned, (
                "the stranger's empty dictionary hid the ban list"
            )

        keys = {d.peer_id.to_base58(): k for d, k in honest}

        async def average() -> list:
            averagers = [
                Averager(d, prefix=RUN, numel=NUMEL, signing_key=keys[d.peer_id.to_base58()],
                         matchmaking_time_s=1.0, data_plane=False, record_signer=RecordSigner(
                             keys[d.peer_id.to_base58()], _certificate(coordinator, keys[d.peer_id.to_base58()])))
                for d, _ in honest[:2]
            ]  # fmt: skip
            for averager in averagers:
                await averager.start()
            inputs = [torch.full((NUMEL,), float(i)) for i in range(2)]
            return await asyncio.gather(*(a.average(v, 1.0) for a, v in zip(averagers, inputs, strict=True)))

        outcomes = asyncio.run(average())
        assert all(o is not None for o in outcomes), "no group formed after the stranger's stores"
        (group, first), (_, second) = outcomes
        assert len(group.peer_ids) == 2 and first.complete and second.complete
        assert torch.equal(first.vector, second.vector), "the two honest peers must hold the same bits"
        assert torch.allclose(first.vector, torch.full((NUMEL,), 0.5), atol=1e-3)
        # The honest nodes keep the ban list page and two declarations (each in storage and cache at most),
        # none of the stranger's 16 MiB.
        usage = [dht.run_coroutine(storage_usage) for dht, _ in honest]
        assert 0 < sum(entries for entries, _ in usage) <= 3 * 3 * 2
        assert sum(nbytes for _, nbytes in usage) < 64 << 10
    finally:
        stranger.shutdown()
        for dht, _ in honest:
            dht.shutdown()


@pytest.mark.timeout(30)
def test_every_key_the_run_uses_has_a_check_and_every_other_key_is_refused():
    validator = RunValidator(RUN, None)
    keys = run_keys(RUN)
    now, far = get_dht_time(), get_dht_time() + THIRTY_YEARS_S
    # Every key the code builds is listed: record kinds, ban pages, each stage's checkpoint and
    # matchmaking key (under the pipeline's own prefix function), and the run's and its second tier's
    # matchmaking keys.
    built = [record_key(RUN, kind) for kind in VALIDATED_KINDS]
    built += [ban_list_key(RUN, page) for page in range(1, MAX_BAN_PAGES)]
    for stage in range(MAX_STAGES):
        assert pipeline_stage_prefix(RUN, stage) == stage_prefix(RUN, stage)
        built += [record_key(pipeline_stage_prefix(RUN, stage), "checkpoint")]
        built += [matchmaking_key(pipeline_stage_prefix(RUN, stage))]
    built += [matchmaking_key(RUN), matchmaking_key(tier_prefix(RUN))]
    assert set(built) == set(keys), "a key the run uses is not listed in swarm.keyspace.run_keys"
    assert PipelineConfig.model_fields["stages"].metadata[-1].le == MAX_STAGES

    # Each listed key has a check: junk, plain or per subkey, far-future or not, is refused.
    for key in keys:
        for subkey in (None, "peer", b"peer"):
            for expiration in (now + 30, far):
                assert not validator.validate(_record(key, b"junk", expiration, subkey)), key
                assert not validator.validate(_record(key, True, expiration, subkey)), key
    # Every other key is refused, even with a value that would be valid under a listed key.
    signer = SigningKey.generate()
    peer_bytes = PeerID.from_base58(signer.peer_id).to_bytes()
    declaration = seal_declaration(signer, matchmaking_key(RUN), looking=True, expires_at=now + 5)
    for other in (
        "anything",
        f"{RUN}.progress2",
        f"{RUN}_stage64.0b",
        matchmaking_key("another-run"),
        f"{RUN}.0b1",
    ):
        assert not validator.validate(_record(other, declaration, now + 5, peer_bytes)), other

    # Valid records under their own keys pass.
    assert validator.validate(_record(matchmaking_key(RUN), declaration, now + 5, peer_bytes))
    progress = seal_peer_record(signer, "progress", RUN, {"step": 1, "samples": 1, "samples_per_s": 1.0,
                                                         "state_hash": "0" * 64}, b"", expires_at=now + 60)  # fmt: skip
    assert validator.validate(_record(record_key(RUN, "progress"), progress, now + 60, signer.peer_id))
    stage = stage_prefix(RUN, 3)
    body = {"step": 1, "state_hash": "0" * 64, "expires_at": now + 60}
    assert validator.validate(
        _record(record_key(stage, "checkpoint"), seal(signer, CHECKPOINT_RECORD, stage, body), now + 60)
    )
    assert not validator.validate(
        _record(record_key(stage, "checkpoint"), seal(signer, CHECKPOINT_RECORD, RUN, body), now + 60)
    ), "a checkpoint record signed for the run passed as a stage's"


def test_a_run_lists_only_its_own_stages_keys_so_an_identity_holds_few_entries_per_node():
    """A certified identity can hold one entry per key the run lists for it: a data-parallel run lists no
    stage keys (65 matchmaking keys would let ~241 Sybils fill a node's 16,384 entries), a 3-stage run
    only its 3 stages'."""
    signer = SigningKey.generate()
    peer_bytes = PeerID.from_base58(signer.peer_id).to_bytes()
    now = get_dht_time()

    def declaration_passes(validator: RunValidator, prefix: str) -> bool:
        value = seal_declaration(signer, matchmaking_key(prefix), looking=True, expires_at=now + 5)
        return validator.validate(_record(matchmaking_key(prefix), value, now + 5, peer_bytes))

    data_parallel, pipeline = RunValidator(RUN, None, stages=1), RunValidator(RUN, None, stages=3)
    assert declaration_passes(data_parallel, RUN) and declaration_passes(pipeline, RUN)
    assert not any(declaration_passes(data_parallel, stage_prefix(RUN, s)) for s in range(MAX_STAGES))
    assert [s for s in range(MAX_STAGES) if declaration_passes(pipeline, stage_prefix(RUN, s))] == [0, 1, 2]
    # What one identity may write on a node: its per-peer records and one declaration per matchmaking key
    # (the run's and its second tier's).
    per_identity = [k for k, rule in run_keys(RUN, 1).items() if rule.check == "declaration"]
    assert len(per_identity) + len(PEER_KINDS) == 5
    with pytest.raises(ValueError, match="1 to 64 stages"):
        run_keys(RUN, 65)


# The functions whose keys ``run_keys`` lists (see the test above), and the one name hivemind's
# matchmaking passes its key under (``SignedGroupKeyManager.declare_averager``'s ``group_key``).
KEY_FUNCTIONS = {
    "record_key",
    "ban_list_key",
    "checkpoint_key",
    "members_key",
    "progress_key",
    "pipeline_key",
}
KEY_NAMES = {"group_key"}


@pytest.mark.timeout(30)
def test_every_dht_store_in_the_code_uses_a_listed_key():
    """A new ``dht.store`` under a key built some other way fails here until its key is listed in
    ``swarm.keyspace.run_keys`` (and given a check) and its function added above."""
    root = Path(__file__).resolve().parents[1]
    stores = []
    for package in ("swarm", "peer", "coordinator", "lab"):
        for path in sorted((root / package).rglob("*.py")):
            if "byzantine" in path.parts:  # rehearsed attacks store junk on purpose
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                receiver = node.func.value
                name = getattr(receiver, "id", None) or getattr(receiver, "attr", None) or ""
                if node.func.attr != "store" or "dht" not in name:
                    continue
                key = node.args[0] if node.args else next(k.value for k in node.keywords if k.arg == "key")
                built_by = getattr(getattr(key, "func", None), "id", None) or getattr(key, "id", None)
                stores.append((f"{path.relative_to(root)}:{node.lineno}", built_by))
    assert len(stores) >= 5, stores
    for where, built_by in stores:
        assert built_by in KEY_FUNCTIONS | KEY_NAMES, (
            f"{where} stores under a key swarm.keyspace does not list"
        )
    assert {record_key(RUN, kind) for kind in ("progress", "pipeline", "members", "checkpoint")} <= set(
        run_keys(RUN)
    )


@pytest.mark.timeout(30)
def test_a_declaration_must_be_signed_by_its_subkey_and_expire_soon():
    validator = RunValidator(RUN, None)
    key = matchmaking_key(RUN)
    me, other = SigningKey.generate(), SigningKey.generate()
    mine = PeerID.from_base58(me.peer_id).to_bytes()
    now = get_dht_time()
    good = seal_declaration(me, key, looking=True, expires_at=now + 5)
    assert validator.validate(_record(key, good, now + 5, mine))
    assert not validator.validate(_record(key, good, now + 5, None)), (
        "a plain value would replace the dictionary"
    )
    assert not validator.validate(_record(key, good, now + 5, PeerID.from_base58(other.peer_id).to_bytes()))
    assert not validator.validate(_record(key, good, now + 60, mine)), "stored to outlive what its signer set"
    long = seal_declaration(me, key, looking=True, expires_at=now + 3600)
    assert not validator.validate(_record(key, long, now + 3600, mine)), "signed to live past the bound"
    elsewhere = seal_declaration(me, matchmaking_key("another-run"), looking=True, expires_at=now + 5)
    assert not validator.validate(_record(key, elsewhere, now + 5, mine)), "a declaration of another key"


def _certificate(
    coordinator: SigningKey, peer: SigningKey, *, ttl_s: float = 3600.0, run_id: str = RUN
) -> bytes:
    return issue_certificate(
        coordinator, public_key=peer.public_key, run_id=run_id, role="data", name="p", serial=1, ttl_s=ttl_s,
        now=get_dht_time(),
    ).encoded  # fmt: skip


@pytest.mark.timeout(30)
def test_a_declaration_needs_a_valid_certificate_of_its_peer_when_the_run_has_a_coordinator():
    """A stranger minting fresh keys signs valid declarations; with no certificate they are refused by every
    honest node and ignored by readers, so they cannot fill the key's subkeys and block new leaders."""
    coordinator, peer, stranger = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    validator = RunValidator(RUN, coordinator.public_key)
    key = matchmaking_key(RUN)
    now = get_dht_time()

    def declared(signer: SigningKey, certificate: bytes = b"", expires_at: float = now + 5) -> tuple:
        value = seal_declaration(signer, key, looking=True, expires_at=expires_at, certificate=certificate)
        return value, expires_at, PeerID.from_base58(signer.peer_id).to_bytes()

    def accepted(value: bytes, expires_at: float, subkey: bytes) -> bool:
        return validator.validate(_record(key, value, expires_at, subkey))

    assert accepted(*declared(peer, _certificate(coordinator, peer))), "a certified peer declares"
    refused = {
        "no certificate": declared(stranger),
        "another peer's certificate": declared(stranger, _certificate(coordinator, peer)),
        "a certificate of another coordinator": declared(
            stranger, _certificate(SigningKey.generate(), stranger)
        ),
        "a certificate of another run": declared(stranger, _certificate(coordinator, stranger, run_id="x")),
        "an expired certificate": declared(stranger, _certificate(coordinator, stranger, ttl_s=1e-3)),
        "a declaration outliving its certificate": declared(
            stranger, _certificate(coordinator, stranger, ttl_s=2.0), expires_at=now + 5
        ),
    }
    for what, (value, expires_at, subkey) in refused.items():
        assert not accepted(value, expires_at, subkey), f"{what} was stored"
        with pytest.raises(SwarmError):  # readers check again: an attacker's node answers with anything
            open_declaration(
                key, subkey, value, expires_at, run_id=RUN, coordinator_key=coordinator.public_key
            )
    # Without a coordinator (a local run with no admission) a valid signature is enough.
    value, expires_at, subkey = declared(stranger)
    assert RunValidator(RUN, None).validate(_record(key, value, expires_at, subkey))


@pytest.mark.timeout(30)
def test_bounded_storage_refuses_past_its_limits_and_keeps_what_it_holds(monkeypatch):
    monkeypatch.setattr(
        BoundedStorage,
        "limits",
        StorageLimits(max_entries=8, max_bytes=4000, max_subkeys_per_key=4, max_bytes_per_subkey=1500),
    )
    storage = BoundedStorage()
    key, other = DHTID.generate(source="k"), DHTID.generate(source="other")
    now = get_dht_time()
    honest = b"h" * 100
    assert storage.store(key, honest, now + 10, subkey="honest")
    # One signer is held to its bytes across keys.
    assert storage.store(other, b"s" * 1000, now + 10, subkey="sybil")
    assert not storage.store(DHTID.generate(source="third"), b"s" * 1000, now + 10, subkey="sybil")
    # One key is held to its subkeys, refusing (not evicting) the newcomers.
    for i in range(3):
        assert storage.store(key, b"x" * 100, now + 1000, subkey=f"sybil-{i}")
    assert not storage.store(key, b"x" * 100, now + 1000, subkey="sybil-late")
    assert storage.get(key).value.get("honest").value == honest, "a full key evicted an honest entry"
    # ...but an entry already held is refreshed.
    assert storage.store(key, honest, now + 20, subkey="honest")
    # The whole node is held to its bytes and entries.
    assert storage.store(DHTID.generate(source="a"), b"a" * 1400, now + 10)
    assert not storage.store(DHTID.generate(source="b"), b"b" * 1400, now + 10)
    assert storage.held_bytes <= 4000 and storage.held_entries <= 8
    # What expires makes room again.
    assert storage.store(DHTID.generate(source="short"), b"c" * 10, now + 0.2)
    time.sleep(0.3)
    entries = storage.held_entries
    assert storage.held_bytes == 100 + 1000 + 300 + 1400 and entries == 6


@pytest.mark.timeout(30)
def test_a_node_reads_the_ban_list_drops_a_banned_peers_entries_refuses_new_ones_and_follows_an_unban():
    """Ban pages signed by the coordinator that pass through a node make its storage give way: a banned
    identity's records are dropped at once (not when they expire) and refused after; a newer list without
    the peer lifts it; pages signed by anyone else teach the node nothing."""
    from swarm.bans import ban_list_pages
    from swarm.dhtstorage import NODE_BANS

    coordinator, banned, honest = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    NODE_BANS.__init__()  # a fresh node: this process may have read other tests' lists
    validator = RunValidator(RUN, coordinator.public_key)
    storage = BoundedStorage()
    now = get_dht_time()
    key = record_key(RUN, "progress")

    issued = iter(range(1, 1000))

    def progress(peer: SigningKey) -> DHTRecord:  # each one newer than the last, as a republished record is
        expires_at = now + 60 + next(issued)
        body = {"step": 1, "samples": 1, "samples_per_s": 1.0, "state_hash": "0" * 64}
        sealed = seal_peer_record(
            peer, "progress", RUN, body, _certificate(coordinator, peer), expires_at=expires_at
        )
        return _record(key, sealed, expires_at, peer.peer_id)

    def stored(record: DHTRecord) -> bool:
        return validator.validate(record) and storage.store_subkey(
            DHTID.from_bytes(record.key), record.subkey, record.value, record.expiration_time
        )

    def held() -> set[bytes]:
        found = storage.get(DHTID.from_bytes(progress(honest).key))
        return set(found.value.data) if found is not None else set()

    def ban_pages(signer: SigningKey, peers: list[str], changed_at: float) -> list[DHTRecord]:
        pages = ban_list_pages(signer, RUN, peers, changed_at=changed_at, expires_at=now + 600)
        keys = [record_key(RUN, "bans")] + [ban_list_key(RUN, k) for k in range(1, len(pages))]
        return [_record(k, page, now + 600) for k, page in zip(keys, pages, strict=True)]

    try:
        assert stored(progress(honest)) and stored(progress(banned))
        assert held() == {MSGPackSerializer.dumps(honest.peer_id), MSGPackSerializer.dumps(banned.peer_id)}

        forged = ban_pages(SigningKey.generate(), [honest.peer_id], changed_at=now)
        assert not any(validator.validate(page) for page in forged), "a page not signed by the coordinator"
        assert len(held()) == 2 and stored(progress(honest)), "a forged list banned nobody"

        for page in ban_pages(coordinator, [banned.peer_id], changed_at=now):
            assert validator.validate(page)
        assert held() == {MSGPackSerializer.dumps(honest.peer_id)}, "the banned peer's entry was dropped"
        assert storage.dropped_banned == 1
        assert not stored(progress(banned)), "and its new records are refused"
        assert stored(progress(honest)), "an honest peer's records still pass"

        for page in ban_pages(coordinator, [], changed_at=now + 1):  # swarm-coordinator unban
            assert validator.validate(page)
        assert stored(progress(banned)), "a newer list without the peer lifts the ban"
        for page in ban_pages(coordinator, [banned.peer_id], changed_at=now):
            validator.validate(page)
        assert stored(progress(banned)), "a page of an older list does not bring the ban back"
    finally:
        NODE_BANS.__init__()
