"""Whether other peers can open connections to this machine, learned at join from the coordinator.

A peer behind NAT (a home router, a firewall) can dial out and cannot be dialed. It still trains, as
hivemind's client mode: it sends its contributions and receives the aggregates over connections it
opens, reduces no part of a round (its signed group entry says it cannot be dialed), never leads a group
(followers would have to dial it), and runs its DHT node as a client (docs/wan.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Literal

from protocols.errors import NetworkError, SwarmError
from swarm.coordinator_client import CoordinatorClient

logger = logging.getLogger(__name__)

Dialable = Literal["auto", "yes", "no"]
DIAL_BACK_ATTEMPTS = 3
DIAL_BACK_RETRY_S = 2.0  # the coordinator's interval between dial-backs to one address


async def learn_dialable(client: CoordinatorClient, host: str, setting: Dialable) -> bool:
    """``setting`` unless it is ``auto``; then whether the coordinator could connect back to a listener
    on ``host``. When the coordinator cannot be asked, the answer is yes (the behaviour before it could)."""
    if setting != "auto":
        return setting == "yes"
    try:
        server = await asyncio.start_server(lambda _reader, writer: writer.close(), host=host, port=0)
    except OSError as e:
        logger.warning(f"could not listen on {host} to test reachability ({e}); assuming peers can dial in")
        return True
    try:
        for attempt in range(DIAL_BACK_ATTEMPTS):
            try:
                answer = await client.dial_back([server.sockets[0].getsockname()[1]])
                break
            except NetworkError as e:  # busy with other peers at this address, or briefly unreachable
                if attempt + 1 == DIAL_BACK_ATTEMPTS:
                    logger.warning(
                        f"the coordinator did not dial back ({e}); assuming other peers can dial this machine"
                    )
                    return True
                await asyncio.sleep(DIAL_BACK_RETRY_S)
            except SwarmError as e:
                logger.info(
                    f"the coordinator cannot dial back ({e}); assuming other peers can dial this machine"
                )
                return True
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
    result = answer.results[0] if answer.results else None
    if result is not None and result.reachable:
        logger.info(f"other peers can dial this machine at {answer.address}")
        return True
    why = result.detail if result is not None else "no result"
    logger.info(
        f"other peers cannot dial this machine at {answer.address} ({why}): it joins averaging groups "
        "but reduces no part and does not lead them, and its DHT node runs as a client "
        "(--dialable yes overrides)"
    )
    return False
