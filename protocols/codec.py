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


def _streaming(view: bytes) -> msgpack.Unpacker:
    """An unpacker over untrusted ``view`` with ``unpack``'s per-value bounds, for reading it a value (or a
    container header) at a time; ``tell()`` is the offset of the next one."""
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=max(len(view), 1), ext_hook=_refuse_ext, max_str_len=MAX_STRING_CHARS,
        max_bin_len=len(view), max_array_len=MAX_CONTAINER_ITEMS, max_map_len=MAX_CONTAINER_ITEMS,
    )  # fmt: skip
    unpacker.feed(view)
    return unpacker


def _count_items(view: bytes, limit: int, what: str) -> None:
    """Refuse msgpack ``view`` holding more than ``limit`` items in all, counting container headers and
    skipping scalars, so that its decode never builds millions of small objects on whatever thread runs it
    (per-container bounds alone let 32 MiB of nested empty lists cost seconds and half a GiB)."""
    unpacker = _streaming(view)
    pending, count = 1, 0
    while pending:
        pending -= 1
        count += 1
        if count > limit:
            raise ProtocolError(f"{what} holds more than {limit} values in all")
        offset = unpacker.tell()
        if offset >= len(view):
            return  # truncated: the decode names it
        kind = view[offset]
        if 0x90 <= kind <= 0x9F or kind in (0xDC, 0xDD):
            pending += unpacker.read_array_header()
        elif 0x80 <= kind <= 0x8F or kind in (0xDE, 0xDF):
            pending += 2 * unpacker.read_map_header()
        else:
            unpacker.skip()


def top_level_str(data: bytes, key: str, *, max_bytes: int = MAX_ENVELOPE_BYTES) -> str | None:
    """The string at ``key`` of a msgpack map from an untrusted source, read without decoding the map's
    other values (each is skipped, never built); None when ``data`` is not such a map or the value is not
    a string. For choosing how to decode the rest (``unpack``) off the event loop."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or not 0 < len(data) <= max_bytes:
        return None
    view = bytes(data)
    unpacker = _streaming(view)

    def next_is_str() -> bool:  # fixstr, str 8, str 16, str 32: nothing else is decoded
        offset = unpacker.tell()
        return offset < len(view) and (0xA0 <= view[offset] <= 0xBF or view[offset] in (0xD9, 0xDA, 0xDB))

    try:
        for _ in range(unpacker.read_map_header()):
            if not next_is_str():
                unpacker.skip()  # a key that is not a string, then its value
            elif unpacker.unpack() == key:
                return unpacker.unpack() if next_is_str() else None
            unpacker.skip()
    except (ValueError, TypeError, ProtocolError, msgpack.UnpackException, RecursionError):
        return None
    return None


def unpack(
    data: bytes,
    *,
    max_bytes: int = MAX_ENVELOPE_BYTES,
    what: str = "message",
    max_binary: int = MAX_BINARY_BYTES,
    max_items: int | None = None,
) -> Any:
    """Decode msgpack from an untrusted source; raises ProtocolError naming ``what`` on anything off.
    ``max_items`` bounds the values in all (containers and scalars), checked before anything is built."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageTooLarge(f"{what} is {len(data)} bytes; the limit is {max_bytes}")
    try:
        if max_items is not None:
            _count_items(bytes(data), max_items, what)
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
