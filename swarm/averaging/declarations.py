"""Signed matchmaking declarations: who leads or looks for a group under a run's matchmaking key.

hivemind's matchmaking declares a peer under ``<prefix>.0b<bits>`` with its peer ID as the subkey and a
bare ``True``/``False`` as the value, so anyone who reaches the DHT could declare for others, or store a
plain far-future value there that replaces the whole dictionary on every node that takes it (a plain
value with a later expiration overwrites a dictionary in hivemind's storage) and stops every group from
forming. Here the value is an envelope of purpose ``group-declaration`` signed by the declaring peer,
bound to the matchmaking key and carrying ``looking``, ``expires_at`` and the declaring peer's coordinator
certificate; the subkey must be the signer's peer ID, and the entry may live at most
``MAX_DECLARATION_TTL_S`` past its signature and never past the certificate. In a run with a coordinator
a declaration without a valid certificate for its subkey's peer is refused, so a stranger minting fresh
keys cannot fill the key's subkeys (``dhtstorage`` keeps at most 4,096) and stop new peers from leading.
``swarm.keyspace.RunValidator`` checks every entry on every node, and readers check again
(``open_declaration``), since an attacker's node answers with whatever it likes.

The key has no group bits: the project's groups form under one fixed key per averaging prefix
(``SignedGroupKeyManager`` never moves it), so every key a run uses can be listed in advance.

Example::

    value = seal_declaration(key, "my-run.0b", looking=True, expires_at=get_dht_time() + 2, certificate=cert)
    peer_id, looking = open_declaration(
        "my-run.0b", PeerID.from_base58(key.peer_id).to_bytes(), value, expiration,
        run_id="my-run", coordinator_key=coordinator_public_key,
    )
"""

from __future__ import annotations

import logging

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import DHTExpiration, get_dht_time

from protocols.envelope import MAX_CLOCK_SKEW_S, open_envelope, seal
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import GROUP_DECLARATION, DeclarationBody, parse_body
from swarm.records import RecordSigner, check_record_certificate

# A declaration lives until its group's window closes: at most ``matchmaking_time_s`` (300 s) ahead.
MAX_DECLARATION_TTL_S = 360.0
# A signed envelope of about 240 bytes around a certificate (about 340 bytes; at most 4,096, as in every
# per-peer record).
MAX_DECLARATION_BYTES = 512 + 4096
# Room for the nudge hivemind adds to the expiration when a peer withdraws its declaration.
EXPIRY_SLACK_S = 1e-3
# The subkey is a libp2p peer ID: a 34-byte multihash for Ed25519 keys; anything much longer is not one.
MAX_SUBKEY_BYTES = 64

logger = logging.getLogger(__name__)


def matchmaking_key(prefix: str) -> GroupKey:
    """The one DHT key under which the averagers of ``prefix`` (a run ID or stage prefix) meet."""
    return f"{prefix.replace('.', '_')}.0b"


def seal_declaration(
    key: SigningKey, group_key: str, *, looking: bool, expires_at: float, certificate: bytes = b""
) -> bytes:
    """This peer's signed declaration under ``group_key``, to expire at ``expires_at``, with its
    coordinator ``certificate``."""
    body = {"looking": looking, "expires_at": float(expires_at), "certificate": certificate}
    return seal(key, GROUP_DECLARATION, group_key, body)


def open_declaration(
    group_key: str,
    subkey: object,
    value: object,
    expiration_time: float,
    *,
    run_id: str,
    coordinator_key: PublicKey | None,
    now: float | None = None,
) -> tuple[str, bool]:
    """(the declaring peer's ID, whether it looks for a group) of one entry under ``group_key``, for a peer
    of ``run_id`` certified by ``coordinator_key`` (None: no certificate needed); raises a SwarmError
    saying what is wrong with it."""
    if not isinstance(subkey, bytes) or len(subkey) > MAX_SUBKEY_BYTES:
        raise ProtocolError("the subkey is not a peer ID")
    if not isinstance(value, bytes) or len(value) > MAX_DECLARATION_BYTES:
        raise ProtocolError(f"the value is not a signed declaration of at most {MAX_DECLARATION_BYTES} bytes")
    envelope = open_envelope(value, purpose=GROUP_DECLARATION, run_id=group_key, what="group declaration")
    if PeerID(subkey).to_base58() != envelope.sender:
        raise ProtocolError(f"is signed by {envelope.sender}, not by the peer of its subkey")
    body = parse_body(DeclarationBody, envelope.body, sender=envelope.sender, what="group declaration")
    now = get_dht_time() if now is None else now
    if envelope.issued_at > now + MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"is dated {envelope.issued_at - now:.0f}s in the future")
    if body.expires_at > envelope.issued_at + MAX_DECLARATION_TTL_S + MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"was signed to live past a declaration's {MAX_DECLARATION_TTL_S:.0f}s")
    if expiration_time > body.expires_at + EXPIRY_SLACK_S:
        raise ProtocolError(
            f"is stored to expire {expiration_time - body.expires_at:.0f}s after its signer set"
        )
    if coordinator_key is not None:
        check_record_certificate(
            body.certificate, coordinator_key, run_id, peer_id=envelope.sender, expires_at=body.expires_at,
            now=now,
        )  # fmt: skip
    return envelope.sender, body.looking


class SignedGroupKeyManager(GroupKeyManager):
    """hivemind's ``GroupKeyManager`` with signed, certified declarations under one fixed key per prefix.

    ``signer`` holds the peer's key and current certificate (renewed in place); declarations of others
    count only with a valid certificate of ``run_id`` from ``coordinator_key`` (None: any signer).
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_group_size: int | None,
        signer: RecordSigner,
        *,
        run_id: str,
        coordinator_key: PublicKey | None,
    ):
        super().__init__(dht, prefix, "", target_group_size)
        self.signer, self.run_id, self.coordinator_key = signer, run_id, coordinator_key

    async def declare_averager(
        self, group_key: GroupKey, peer_id: PeerID, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        if not looking_for_group:  # hivemind's withdrawal: the same entry, a hair later, value False
            expiration_time = float(expiration_time) + EXPIRY_SLACK_S / 2
        certificate_expiry = self.signer.certificate_expiry(self.run_id)
        if certificate_expiry is not None:  # a declaration outliving its certificate would be refused
            expiration_time = min(float(expiration_time), certificate_expiry)
        value = seal_declaration(
            self.signer.key, group_key, looking=looking_for_group, expires_at=expiration_time,
            certificate=self.signer.certificate,
        )  # fmt: skip
        return bool(
            await self.dht.store(
                key=group_key, subkey=peer_id.to_bytes(), value=value, expiration_time=expiration_time,
                return_future=True,
            )
        )  # fmt: skip

    async def get_averagers(
        self, group_key: GroupKey, only_active: bool
    ) -> list[tuple[PeerID, DHTExpiration]]:
        found = await self.dht.get(group_key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        averagers = []
        now = get_dht_time()
        for subkey, item in found.value.items():
            try:
                peer_id, looking = open_declaration(
                    group_key, subkey, item.value, item.expiration_time, run_id=self.run_id,
                    coordinator_key=self.coordinator_key, now=now,
                )  # fmt: skip
            except (SwarmError, AttributeError, TypeError, ValueError) as e:
                logger.debug(f"ignoring a declaration under {group_key}: {e}")
                continue
            if looking or not only_active:
                averagers.append((PeerID.from_base58(peer_id), item.expiration_time))
        return averagers

    async def update_key_on_group_assembled(self, group_info: GroupInfo) -> None:
        """The key stays: it is one of the run's listed keys (``swarm.keyspace``)."""
