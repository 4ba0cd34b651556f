"""The signed ban list scales past one record: pages signed by the coordinator, read back whole from a
real DHT, the newest complete list wins, nothing unsigned or mixed is ever taken, and a stranger's junk
under a page key neither stays in an honest node nor hides the list."""

from __future__ import annotations

import asyncio
import pickle
import random
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from coordinator.store import ban_sync
from lab.localswarm import running_coordinator, tiny_run
from protocols.keys import SigningKey
from swarm.bans import (
    MAX_BANNED,
    BanPageValidator,
    assemble_ban_list,
    ban_list_key,
    ban_list_pages,
    fetch_ban_list,
    publish_ban_list,
)
from swarm.dht import SpawnedDHT, start_dht
from swarm.identity import load_or_create_identity

pytestmark = pytest.mark.timeout(180)

RUN = "bans-run"


def sybils(count: int) -> list[str]:
    return [SigningKey.generate().peer_id for _ in range(count)]


@pytest.fixture(scope="module")
def banned() -> list[str]:
    return sybils(4_001)


def test_pages_reassemble_in_any_order_and_only_when_complete(banned):
    coordinator = SigningKey.generate()
    pages = ban_list_pages(coordinator, RUN, banned, changed_at=2.0)
    assert len(pages) == 21 and max(len(page) for page in pages) < 12_000  # see swarm.bans on page sizes
    shuffled = random.Random(1).sample(pages, len(pages))
    assert assemble_ban_list(shuffled, RUN, coordinator.public_key) == (2.0, set(banned))
    assert assemble_ban_list(pages[:-1], RUN, coordinator.public_key) is None
    # While a new version is being published, readers see pages of both: the newest complete one wins.
    newer = ban_list_pages(coordinator, RUN, banned[:-1], changed_at=3.0)
    assert assemble_ban_list(newer[:2] + pages, RUN, coordinator.public_key) == (2.0, set(banned))
    assert assemble_ban_list(newer + pages, RUN, coordinator.public_key) == (3.0, set(banned[:-1]))
    # Pages signed by anyone else, or of another run, or not pages at all, are ignored.
    forged = ban_list_pages(SigningKey.generate(), RUN, [], changed_at=9.0)
    other_run = ban_list_pages(coordinator, "other", [], changed_at=9.0)
    assert assemble_ban_list(forged + other_run + [b"junk", 7] + pages, RUN, coordinator.public_key) == (
        2.0,
        set(banned),
    )
    assert assemble_ban_list(
        ban_list_pages(coordinator, RUN, [], changed_at=1.0), RUN, coordinator.public_key
    ) == (
        1.0,
        set(),
    )
    with pytest.raises(ValueError):
        ban_list_pages(coordinator, RUN, [f"p{i}" for i in range(MAX_BANNED + 1)], changed_at=1.0)


def test_a_list_of_4001_bans_travels_through_the_dht(tmp_path: Path, banned):
    key = load_or_create_identity(tmp_path / "coordinator.key")

    async def scenario() -> tuple[float, set[str]] | None:
        dht = await asyncio.to_thread(
            start_dht, key, tmp_path / "coordinator.key", host="127.0.0.1", port=0, initial_peers=[]
        )
        try:
            assert await publish_ban_list(dht, key, RUN, banned, changed_at=5.0, ttl_s=60)
            return await fetch_ban_list(dht, RUN, key.public_key)
        finally:
            await asyncio.to_thread(dht.shutdown)

    assert asyncio.run(scenario()) == (5.0, set(banned))


def page_record(
    run_id: str, page: int, value: object, expiration_time: float, subkey: object = None
) -> DHTRecord:
    return DHTRecord(
        key=DHTID.generate(source=ban_list_key(run_id, page)).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value),
        expiration_time=expiration_time,
    )


def test_the_page_validator_takes_only_the_coordinators_pages(banned):
    coordinator = SigningKey.generate()
    validator = pickle.loads(
        pickle.dumps(BanPageValidator(RUN, coordinator.public_key))
    )  # as the DHT ships it
    now = get_dht_time()
    pages = ban_list_pages(coordinator, RUN, banned, changed_at=now)
    assert validator.validate(page_record(RUN, 1, pages[1], now + 60))
    assert not validator.validate(page_record(RUN, 1, b"junk", now + 60))
    assert not validator.validate(page_record(RUN, 2, pages[1], now + 60)), "page 1 stored as page 2"
    assert not validator.validate(page_record(RUN, 1, pages[1], now + 10**9)), "outlives its signature"
    assert not validator.validate(page_record(RUN, 1, pages[1], now + 60, subkey="x"))
    stranger = ban_list_pages(SigningKey.generate(), RUN, banned, changed_at=now)
    assert not validator.validate(page_record(RUN, 1, stranger[1], now + 60))
    # Page 0 is TrustValidator's; other keys and runs pass through.
    assert validator.validate(page_record(RUN, 0, b"junk", now + 60))
    assert validator.validate(page_record("other-run", 1, b"junk", now + 60))


def test_junk_stored_over_a_page_does_not_hide_the_list(tmp_path: Path, banned):
    """A stranger's DHT node stores junk that expires in 30 years under every page key."""
    key = load_or_create_identity(tmp_path / "coordinator.key")

    async def scenario() -> tuple[float, set[str]] | None:
        honest = await asyncio.to_thread(
            SpawnedDHT, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
            record_validators=[BanPageValidator(RUN, key.public_key)],
        )  # fmt: skip
        stranger = None
        try:
            maddrs = [str(m) for m in await asyncio.to_thread(honest.get_visible_maddrs)]
            stranger = await asyncio.to_thread(
                SpawnedDHT, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
            )
            assert await publish_ban_list(honest, key, RUN, banned, changed_at=5.0, ttl_s=60)
            far = get_dht_time() + 30 * 365 * 86400
            for page in range(1, 21):
                await stranger.store(ban_list_key(RUN, page), b"junk", far, return_future=True)
            return await fetch_ban_list(honest, RUN, key.public_key)
        finally:
            for dht in (stranger, honest):
                if dht is not None:
                    await asyncio.to_thread(dht.shutdown)

    assert asyncio.run(scenario()) == (5.0, set(banned))


def test_a_coordinator_publishes_4001_bans_that_peers_read_whole(tmp_path: Path, banned):
    """4,001 self-banned Sybils once pushed the list over what peers accept, switching bans off."""
    run = tiny_run(RUN)

    async def scenario() -> tuple[float, set[str]] | None:
        async with running_coordinator(run, tmp_path / "coordinator") as node:
            await node._store._run(lambda db: [ban_sync(db, peer, "sybil") for peer in banned])
            coordinator_key = SigningKey.from_libp2p_bytes(node.config.identity_path.read_bytes()).public_key
            for _ in range(100):  # the list is published every couple of seconds
                found = await fetch_ban_list(node._dht, RUN, coordinator_key)
                if found is not None and len(found[1]) == len(banned):
                    return found
                await asyncio.sleep(0.2)
            return found

    found = asyncio.run(scenario())
    assert found is not None and found[1] == set(banned)
