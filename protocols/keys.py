"""Ed25519 keys and the libp2p peer IDs derived from them.

A libp2p peer ID for an Ed25519 key is the identity multihash of the protobuf-encoded public key, in
base58. Deriving it here (rather than asking the p2p daemon) lets anyone check that a signature was made
by the owner of a network peer ID, with nothing but the peer ID string. The same key file is handed to
the p2p daemon, so a peer's signing key and its network identity are one key.
"""

from __future__ import annotations

from dataclasses import dataclass

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.errors import IdentityError, ProtocolError, SignatureError

# libp2p crypto.proto: message {KeyType Type = 1; bytes Data = 2}, with KeyType Ed25519 = 1.
_ED25519_PUBLIC_PREFIX = bytes([0x08, 0x01, 0x12, 32])
_ED25519_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 64])
_IDENTITY_MULTIHASH = 0x00

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key; ``peer_id`` is its libp2p peer ID."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PUBLIC_KEY_BYTES:
            raise ProtocolError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")

    @property
    def peer_id(self) -> str:
        encoded = _ED25519_PUBLIC_PREFIX + self.raw
        return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded).decode()

    @classmethod
    def from_peer_id(cls, peer_id: str) -> PublicKey:
        """Recover the public key embedded in an Ed25519 peer ID (other key types are refused)."""
        try:
            digest = base58.b58decode(peer_id.encode("ascii"))
        except (ValueError, UnicodeEncodeError, AttributeError):
            raise ProtocolError(f"peer ID {peer_id!r} is not base58") from None
        expected = bytes([_IDENTITY_MULTIHASH, len(_ED25519_PUBLIC_PREFIX) + PUBLIC_KEY_BYTES])
        if not digest.startswith(expected + _ED25519_PUBLIC_PREFIX) or len(digest) != 2 + 4 + 32:
            raise ProtocolError(f"peer ID {peer_id!r} does not embed an Ed25519 public key")
        return cls(digest[6:])

    def verify(self, signature: bytes, data: bytes) -> None:
        """Raise SignatureError unless ``signature`` is this key's signature of ``data``."""
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise SignatureError(f"signature by {self.peer_id} is not {SIGNATURE_BYTES} bytes")
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, data)
        except InvalidSignature:
            raise SignatureError(f"signature does not verify for {self.peer_id}") from None

    def __str__(self) -> str:
        return self.peer_id


class SigningKey:
    """An Ed25519 private key, stored in libp2p's private key format so the p2p daemon can use it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key = PublicKey(raw)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_libp2p_bytes(cls, data: bytes) -> SigningKey:
        if len(data) != len(_ED25519_PRIVATE_PREFIX) + 64 or not data.startswith(_ED25519_PRIVATE_PREFIX):
            raise IdentityError(
                "not an Ed25519 key in libp2p format (expected 68 bytes starting 08 01 12 40)"
            )
        seed, public = data[4:36], data[36:]
        key = cls(Ed25519PrivateKey.from_private_bytes(seed))
        if key.public_key.raw != public:
            raise IdentityError("key file is corrupt: its public half does not match its private half")
        return key

    def to_libp2p_bytes(self) -> bytes:
        seed = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return _ED25519_PRIVATE_PREFIX + seed + self.public_key.raw

    @property
    def peer_id(self) -> str:
        return self.public_key.peer_id

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"SigningKey({self.peer_id})"
