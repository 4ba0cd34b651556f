"""A peer's round journal: one JSON line for each averaging round it tried and each state it downloaded.

``swarm-peer join --round-journal PATH`` sends the ``swarm.rounds`` logger to ``PATH``; ``swarm-sim``
reads every peer's journal for its per-step figures (groups formed, the largest group, state downloads,
bytes, time to form a group, whether every peer applied the same update), and an operator reads one to
see what a peer's rounds did. Without a handler on the logger a record costs one check.

Each line is an object with ``event`` (``joined``, ``round`` or ``download``), ``t`` (wall-clock
seconds) and ``step``; ``joined`` starts each life of the process (a restart appends to the same file);
a ``round`` adds ``outcome`` (``applied``, or why not: ``no_group``, ``too_small``,
``other_step``, ``incomplete``, ``no_tier``: the group's second tier gave nothing to apply; or
``adopted``: the step's combined result, taken from a peer ahead), the group's ID (16 hex digits) and size, the seconds matchmaking took
(``form_s``) and the whole round took (``round_s``), this peer's averaging bytes so far (``sent``,
``received``) and, once applied, the state hash it moved to; a ``download`` adds the step and hash it
loaded and the MiB of tensors.

Example::

    handler = open_journal(Path("rounds.jsonl"))
    ...
    rows = read_journal(Path("rounds.jsonl"))
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from protocols.errors import ConfigError

JOURNAL = logging.getLogger("swarm.rounds")
JOURNAL.propagate = False  # a journal line is data for its file, never a line on the terminal
JOURNAL.setLevel(logging.INFO)

#: The most lines ``read_journal`` takes from one file, and the longest line it parses.
MAX_JOURNAL_LINES = 1_000_000
MAX_LINE_BYTES = 4096
EVENTS = ("joined", "round", "download")


def record(event: str, step: int, **fields: object) -> None:
    """Write one journal line, if a journal is open."""
    if not JOURNAL.handlers:
        return
    JOURNAL.info(json.dumps({"event": event, "t": round(time.time(), 3), "step": step, **fields}))


def open_journal(path: Path) -> logging.Handler:
    """Append the journal to ``path`` from now on; returns the handler (``close_journal`` removes it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"round_journal: cannot append to {str(path)!r}: {e.strerror or e}") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    JOURNAL.addHandler(handler)
    record("joined", 0)
    return handler


def close_journal(handler: logging.Handler) -> None:
    JOURNAL.removeHandler(handler)
    handler.close()


def read_journal(path: Path) -> list[dict]:
    """The journal's lines as dicts, in order; a line that is not a journal object (a write cut short by a
    kill) is skipped."""
    rows: list[dict] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f):
            if number >= MAX_JOURNAL_LINES:
                break
            if len(raw) > MAX_LINE_BYTES:
                continue
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("event") in EVENTS and isinstance(row.get("step"), int):
                rows.append(row)
    return rows
