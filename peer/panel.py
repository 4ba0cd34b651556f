"""What a volunteer sees while ``swarm-peer join`` runs: a live panel on a terminal, log lines elsewhere.

On a terminal (stdout is a TTY) a rich panel redraws twice a second with the peer's state, step,
local samples/s, its contribution, the group of its last round and when and how that round ended;
log messages scroll above it. When stdout is a file or a pipe, the same facts go out as one plain
log line every ``interval_s``.

Example::

    panel = Panel(volunteer.status, interval_s=30)
    await panel.run(stop)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

logger = logging.getLogger("swarm.peer")

REFRESH_S = 0.5


@dataclass
class LastRound:
    """When this peer's last averaging round ended, whether it was applied, and how many peers it had."""

    at: float = 0.0  # unix time the round ended, 0 before the first
    ok: bool = False
    peers: int = 0


class RoundWatcher:
    """Turns the trainer's round counters into "the last round ended then, with this outcome"."""

    def __init__(self) -> None:
        self.last = LastRound()
        self._seen: tuple[float, float] | None = None

    def update(self, status: dict[str, Any]) -> LastRound:
        counts = (status.get("rounds_ok", 0.0), status.get("rounds_failed", 0.0))
        if self._seen is not None and counts != self._seen:
            ok = counts[0] > self._seen[0]
            self.last = LastRound(time.time(), ok, int(status.get("last_round_peers", 0)) if ok else 0)
        self._seen = counts
        return self.last


def _ago(t: float) -> str:
    if not t:
        return "none yet"
    seconds = max(0.0, time.time() - t)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _number(value: Any, digits: int = 0) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def describe(status: dict[str, Any], last: LastRound) -> list[tuple[str, str]]:
    """The panel's rows as (label, value) pairs; the plain log line is made of the same facts."""
    if last.at:
        outcome = f"ok, {last.peers} peers" if last.ok else "failed, will retry"
        last_round = f"{_ago(last.at)} ({outcome})"
    else:
        last_round = "none yet"
    return [
        ("state", status.get("state", "?")),
        ("step", _number(status.get("step"))),
        ("samples/s (local)", _number(status.get("samples_per_s"), 1)),
        ("my contribution", f"{_number(status.get('contributed_samples'))} samples"),
        ("peers in last round", _number(status.get("last_round_peers")) if last.at else "-"),
        ("last averaging", last_round),
        (
            "loss (train / val)",
            f"{_number(status.get('train_loss'), 3)} / {_number(status.get('val_loss'), 3)}",
        ),
        ("link", link_summary(status)),
    ]


def link_summary(status: dict[str, Any]) -> str:
    """The measured uplink and what reachability means for this peer (docs/wan.md)."""
    mbit = status.get("uplink_mbit")
    rate = f"{mbit:.1f} Mbit/s up (measured)" if mbit is not None else "uplink not measured yet"
    if status.get("dialable", 1.0):
        return f"{rate}; other peers can dial it"
    return f"{rate}; behind NAT: averages over connections it opens, reduces no part, never leads a group"


def plain_line(status: dict[str, Any], last: LastRound) -> str:
    return " | ".join(f"{label}: {value}" for label, value in describe(status, last))


class Panel:
    """Shows ``status()`` (a dict from ``Volunteer.status``) until stopped."""

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        *,
        interval_s: float = 30.0,
        stream: TextIO | None = None,
        live: bool | None = None,
    ):
        self.status = status
        self.interval_s = interval_s
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.rounds = RoundWatcher()

    async def run(self, stop: asyncio.Event) -> None:
        if self.live:
            await self._live(stop)
        else:
            await self._lines(stop)

    async def _lines(self, stop: asyncio.Event) -> None:
        next_line = time.monotonic() + min(self.interval_s, 5.0)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=REFRESH_S)
            status = self.status()
            last = self.rounds.update(status)
            if time.monotonic() >= next_line and status.get("state") not in ("starting", "joining"):
                logger.info(plain_line(status, last))
                next_line = time.monotonic() + self.interval_s

    def _render(self, status: dict[str, Any], last: LastRound) -> Any:
        from rich import box
        from rich.panel import Panel as RichPanel
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim", justify="right")
        table.add_column()
        state = status.get("state", "?")
        colour = {"online": "green", "paused": "yellow", "banned": "red", "left": "dim"}.get(state, "cyan")
        for label, value in describe(status, last):
            table.add_row(label, f"[bold {colour}]{value}[/]" if label == "state" else value)
        title = f"swarm peer [bold]{status.get('name', '')}[/]  {status.get('peer_id', '')[:16]}…"
        subtitle = f"{status.get('device', '')} · run {status.get('run_id') or '?'} · Ctrl-C leaves cleanly"
        width = max(56, len(title), len(subtitle) + 8)  # the title's 8 columns of markup pay for its frame
        return RichPanel(table, title=title, subtitle=subtitle, box=box.ROUNDED, expand=True, width=width)

    async def _live(self, stop: asyncio.Event) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.logging import RichHandler

        console = Console(file=self.stream, force_terminal=True)  # live is chosen: draw every frame
        root = logging.getLogger()
        saved = root.handlers[:]
        # Log records print above the panel instead of tearing through it.
        root.handlers = [
            RichHandler(console=console, show_path=False, markup=False, log_time_format="%H:%M:%S")
        ]
        try:
            status = self.status()
            with Live(
                self._render(status, self.rounds.update(status)), console=console, auto_refresh=False
            ) as live:
                while not stop.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=REFRESH_S)
                    status = self.status()
                    live.update(self._render(status, self.rounds.update(status)), refresh=True)
        finally:
            root.handlers = saved
