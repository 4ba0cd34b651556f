"""The averaging data path's limits: a groupmate that never reads is cut off at the write deadline on
either side, one peer (or one address, whatever keys it signs with) cannot take every connection, and the
others still get in."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers import relay_from
from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import NetworkError
from protocols.keys import SigningKey
from swarm.averaging.transport import DataPlane, host_key

pytestmark = pytest.mark.timeout(30)

MAX_FRAME = 1 << 20
BIG = b"\x07" * (MAX_FRAME - 64)


async def chunks(count: int):
    for i in range(count):
        yield apb.PartChunk(part_index=0, chunk_index=i, data=BIG)


def peer_of(plane: DataPlane) -> PeerID:
    return PeerID.from_base58(plane.key.peer_id)


def test_a_groupmate_that_never_reads_the_answer_is_cut_off():
    """The reducer streams 64 MiB of answers; the sender never reads them."""

    async def flood(stream, sender):
        async for _ in chunks(64):
            yield _

    async def scenario() -> None:
        server = DataPlane(SigningKey.generate(), "run", flood, max_frame=MAX_FRAME, write_timeout_s=1.0)
        client = DataPlane(SigningKey.generate(), "run", flood, max_frame=MAX_FRAME)
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        try:
            connection = await client.connect(address, peer_of(server), timeout_s=5)
            connection.writer.write_eof()  # sends nothing more and reads nothing at all
            await asyncio.sleep(0.2)
            assert len(server._connections) == 1
            for _ in range(50):
                if not server._connections:
                    break
                await asyncio.sleep(0.1)
            assert not server._connections, "the reducer's task ended at its write deadline"
            assert server._serving == {}
            connection.close()
        finally:
            await server.close()

    asyncio.run(scenario())


def test_a_reducer_that_never_reads_does_not_hold_the_sender():
    async def never_reads(stream, sender):
        await asyncio.sleep(3600)
        yield apb.PartChunk()

    async def scenario() -> None:
        server = DataPlane(SigningKey.generate(), "run", never_reads, max_frame=MAX_FRAME)
        client = DataPlane(
            SigningKey.generate(), "run", never_reads, max_frame=MAX_FRAME, write_timeout_s=1.0
        )
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        try:
            connection = await client.connect(address, peer_of(server), timeout_s=5)
            with pytest.raises(NetworkError, match="read nothing for 1s"):
                await asyncio.wait_for(_consume(connection.exchange(chunks(64))), timeout=15)
        finally:
            await server.close()

    asyncio.run(scenario())


async def _consume(stream) -> list:
    return [m async for m in stream]


def test_one_peer_cannot_take_every_connection():
    async def hold(stream, sender):
        async for _ in stream:
            pass
        await asyncio.sleep(3600)
        yield apb.PartChunk()

    async def scenario() -> None:
        server = DataPlane(
            SigningKey.generate(), "run", hold, max_frame=MAX_FRAME, max_connections_per_peer=2
        )
        greedy = DataPlane(SigningKey.generate(), "run", hold, max_frame=MAX_FRAME)
        other = DataPlane(SigningKey.generate(), "run", hold, max_frame=MAX_FRAME)
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        try:
            held = [await greedy.connect(address, peer_of(server), timeout_s=5) for _ in range(2)]
            with pytest.raises(NetworkError):
                await greedy.connect(address, peer_of(server), timeout_s=5)
            assert server._serving == {greedy.key.peer_id: 2}
            await other.connect(address, peer_of(server), timeout_s=5)
            assert server._serving[other.key.peer_id] == 1
            for connection in held:
                connection.close()
        finally:
            await server.close()

    asyncio.run(scenario())


def test_one_address_cannot_take_every_handshake():
    async def echo(stream, sender):
        async for message in stream:
            yield message

    async def scenario() -> None:
        server = DataPlane(SigningKey.generate(), "run", echo, max_frame=MAX_FRAME, max_handshakes_per_host=3)
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        port = int(address.rsplit(":", 1)[1])
        silent = []
        try:
            for _ in range(3):  # connections that never say hello
                sock = socket.create_connection(("127.0.0.1", port))
                silent.append(sock)
            await asyncio.sleep(0.3)
            assert server._handshaking == {"127.0.0.1": 3}
            # Another address is served meanwhile.
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            greeting = await asyncio.wait_for(reader.readexactly(8 + 32), 5)
            assert greeting.startswith(b"swarm-ar")
            writer.close()
            # A fourth silent one from the first address is closed at once.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(reader.read(64), 5) == b""
            writer.close()
        finally:
            for sock in silent:
                sock.close()
            await server.close()

    asyncio.run(scenario())


def test_fresh_keys_from_one_host_cannot_take_every_connection():
    """Each connection from 127.0.0.1 signs with a new key (so the per-peer limit never bites); the
    per-host limit does, and a peer on another address (127.0.0.3, through a relay) still gets in."""

    async def until_closed(stream, sender):
        async for _ in stream:
            pass
        return
        yield  # (an async generator that answers nothing)

    def fresh() -> DataPlane:
        return DataPlane(SigningKey.generate(), "run", until_closed, max_frame=MAX_FRAME)

    async def scenario() -> None:
        server = DataPlane(
            SigningKey.generate(), "run", until_closed, max_frame=MAX_FRAME, max_connections_per_host=3
        )
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        host, port = address.rsplit(":", 1)
        relay = await relay_from("127.0.0.3", (host, int(port)))
        held = []
        try:
            held = [await fresh().connect(address, peer_of(server), timeout_s=5) for _ in range(3)]
            with pytest.raises(NetworkError):
                await fresh().connect(address, peer_of(server), timeout_s=5)
            assert server._by_host == {"127.0.0.1": 3} and len(server._serving) == 3
            relayed = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
            held.append(await fresh().connect(relayed, peer_of(server), timeout_s=5))
            assert server._by_host == {"127.0.0.1": 3, "127.0.0.3": 1}
            for connection in held[:3]:
                connection.close()
            for _ in range(50):  # the server sees the closes and frees the host's slots
                if server._by_host == {"127.0.0.3": 1}:
                    break
                await asyncio.sleep(0.1)
            assert server._by_host == {"127.0.0.3": 1}
            held.append(await fresh().connect(address, peer_of(server), timeout_s=5))
        finally:
            for connection in held:
                connection.close()
            relay.close()
            await server.close()

    asyncio.run(scenario())


def test_hosts_are_limited_by_address_and_ipv6_by_their_64():
    assert host_key("203.0.113.7") == "203.0.113.7"
    assert host_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert host_key("2001:db8:1:2:3:4:5:6") == host_key("[2001:db8:1:2:ffff::1]") == "2001:db8:1:2::/64"
    assert host_key("2001:db8:1:3::1") != host_key("2001:db8:1:2::1")
    assert host_key("unknown") == "unknown"


def test_frames_still_flow_within_the_limits():
    async def echo(stream, sender):
        async for message in stream:
            yield message

    async def scenario() -> int:
        server = DataPlane(SigningKey.generate(), "run", echo, max_frame=MAX_FRAME, write_timeout_s=1.0)
        client = DataPlane(SigningKey.generate(), "run", echo, max_frame=MAX_FRAME, write_timeout_s=1.0)
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        try:
            connection = await client.connect(address, peer_of(server), timeout_s=5)
            return len(await _consume(connection.exchange(chunks(16))))
        finally:
            await server.close()

    assert asyncio.run(scenario()) == 16
