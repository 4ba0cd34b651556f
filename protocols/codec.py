"""msgpack encoding for the network: plain data only, with limits checked before anything is trusted.

Only nil, bool, int, float, str, bytes, lists and string-keyed maps are allowed; msgpack extension
types are refused. ``pack`` sorts map keys so the same data always encodes to the same bytes.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocols.errors import MessageTooLarge, ProtocolError
from protocols.version import (
    MAX_BINARY_BYTES,
    MAX_CONTAINER_ITEMS,
    MAX_ENVELOPE_BYTES,
    MAX_NESTING_DEPTH,
    MAX_STRING_CHARS,
)


def _canonical(obj: Any, depth: int = 0) -> Any:
    if depth > MAX_NESTING_DEPTH:
        raise ProtocolError(f"data nests deeper than {MAX_NESTING_DEPTH} levels")
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise ProtocolError("map keys must be strings")
        return {k: _canonical(obj[k], depth + 1) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, depth + 1) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    raise ProtocolError(f"cannot encode a value of type {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """Encode plain data canonically (sorted map keys, bin type for bytes)."""
    try:
        return msgpack.packb(_canonical(obj), use_bin_type=True)
    except (UnicodeEncodeError, OverflowError, TypeError, ValueError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _check_structure(obj: Any, what: str, depth: int = 0) -> None:
    if depth > MAX_NESTING_DEPTH:
        raise ProtocolError(f"{what} nests deeper than {MAX_NESTING_DEPTH} levels")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{what} has a map key of type {type(k).__name__}; keys must be strings")
            _check_structure(v, what, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_structure(v, what, depth + 1)
    elif not (obj is None or isinstance(obj, (bool, int, float, str, bytes))):
        # msgpack decodes its timestamp extension without calling ext_hook
        raise ProtocolError(
            f"{what} contains a msgpack extension value ({type(obj).__name__}); it is not allowed"
        )


def unpack(
    data: bytes,
    *,
    max_bytes: int = MAX_ENVELOPE_BYTES,
    what: str = "message",
    max_binary: int = MAX_BINARY_BYTES,
) -> Any:
    """Decode msgpack from an untrusted source; raises ProtocolError naming ``what`` on anything off."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageTooLarge(f"{what} is {len(data)} bytes; the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=MAX_STRING_CHARS,
            max_bin_len=max_binary,
            max_array_len=MAX_CONTAINER_ITEMS,
            max_map_len=MAX_CONTAINER_ITEMS,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise ProtocolError(f"malformed {what}: {e}") from None
    _check_structure(obj, what)
    return obj
