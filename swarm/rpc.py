"""The gRPC boundary: how our errors cross it in both directions, and channel limits.

The server aborts with a status code chosen by error family plus the error's class name in trailing
metadata; the client turns that back into the same ``SwarmError`` subclass with the server's message,
so callers on both sides handle one hierarchy and never see a raw ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc

from protocols.errors import (
    ERROR_CLASSES,
    AdmissionDenied,
    Banned,
    MessageTooLarge,
    NetworkError,
    ProtocolError,
    ReplayError,
    SecurityError,
    SwarmError,
    UnknownRun,
    VersionMismatch,
)
from protocols.version import MAX_GRPC_MESSAGE_BYTES

ERROR_METADATA_KEY = "swarm-error"

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
]

_CODES: list[tuple[type[SwarmError], grpc.StatusCode]] = [
    (MessageTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (VersionMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownRun, grpc.StatusCode.NOT_FOUND),
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (Banned, grpc.StatusCode.PERMISSION_DENIED),
    (AdmissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ReplayError, grpc.StatusCode.UNAUTHENTICATED),
    (SecurityError, grpc.StatusCode.UNAUTHENTICATED),
    (NetworkError, grpc.StatusCode.UNAVAILABLE),
]


def status_code_for(error: SwarmError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(error: grpc.RpcError, address: str) -> SwarmError:
    """Translate a failed call into our hierarchy, keeping the server's message."""
    code = error.code()
    details = error.details() or ""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY and value in ERROR_CLASSES:
            return ERROR_CLASSES[value](details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return NetworkError(f"coordinator at {address} is unreachable ({code.name.lower()}): {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return MessageTooLarge(f"coordinator at {address}: {details}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return VersionMismatch(
            f"{address} does not speak this version of the swarm coordinator protocol ({details}); "
            "check the address and upgrade swarm on both sides"
        )
    return ProtocolError(f"coordinator at {address} failed the call ({code.name}): {details}")
