"""The one error hierarchy of the project.

Every failure a user can meet is a :class:`SwarmError`; the four families below tell the caller what
kind of fix is needed. Errors from grpc, libp2p, cryptography and msgpack are translated into these at
the boundary where they arise, with a message that says what is wrong and what to do.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error raised on purpose by this project."""


class ConfigError(SwarmError):
    """A config file, CLI flag or local file (such as an identity key) is wrong; the user must fix it."""


class IdentityError(ConfigError):
    """The identity key file is missing, unreadable or corrupt."""


class ProtocolError(SwarmError):
    """A message from the network is malformed, oversized, or of the wrong version or run."""


class MessageTooLarge(ProtocolError):
    """A message exceeds a size limit of the protocol."""


class VersionMismatch(ProtocolError):
    """The other side speaks a protocol version this side does not."""


class UnknownRun(ProtocolError):
    """A message names a run that the receiver does not serve."""


class InvalidContribution(ProtocolError):
    """A groupmate's contribution to an aggregation is malformed: wrong size or dtype, non-finite, too large."""


class StaleError(ProtocolError):
    """A message signed by a third party is genuine but dated outside what this check accepts: whoever
    passed it on proves nothing by it (honest delays make it too)."""


class NetworkError(SwarmError):
    """The other side could not be reached, or did not answer in time."""


class AccusationInFlight(NetworkError):
    """The coordinator is still judging this peer's earlier accusation (it may wait its turn for long):
    ask again after that one's verdict."""


class DHTStartFailed(NetworkError):
    """This machine's DHT node did not come up in time (its process may still be importing on a busy
    machine); trying again later may work, unlike a port already in use."""


class SecurityError(SwarmError):
    """A signature, certificate or admission check failed."""


class SignatureError(SecurityError):
    """A signature does not verify against the claimed signer."""


class CertificateError(SecurityError):
    """A certificate is forged, expired, or issued for another run or peer."""


class CoordinatorKeyMismatch(SecurityError):
    """The coordinator presents another key than the one this peer pinned for the run."""

    def __init__(self, message: str, offered: str = "", run_id: str = ""):
        super().__init__(message)
        self.offered = offered  # the peer ID of the key it presents
        self.run_id = run_id  # the run it was pinned for


class ReplayError(SecurityError):
    """A message was already used, or is too old or too far in the future to be accepted."""


class AdmissionDenied(SecurityError):
    """The coordinator refused to admit this peer (not on the allowlist, wrong join token, unknown peer)."""


class Banned(SecurityError):
    """The peer is banned from the run."""


# Looked up by name when an error crosses the wire, so the caller gets the same class back.
ERROR_CLASSES: dict[str, type[SwarmError]] = {
    cls.__name__: cls
    for cls in (
        SwarmError,
        ConfigError,
        IdentityError,
        ProtocolError,
        MessageTooLarge,
        VersionMismatch,
        UnknownRun,
        InvalidContribution,
        NetworkError,
        AccusationInFlight,
        SecurityError,
        SignatureError,
        CertificateError,
        ReplayError,
        AdmissionDenied,
        Banned,
    )
}
