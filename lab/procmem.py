"""What a rehearsal reads about its children from /proc: memory per process group, listening TCP ports.

Each child of ``LocalSwarm`` leads its own process group (its DHT child and p2p daemon included), so the
memory a peer holds is the sum of its group's resident sets. ``data_planes`` finds the averaging data
planes among the ports a group listens on (the ones that greet with the data plane's magic), as a port
scan of the machine would: no record says where they are.

Example::

    before = group_rss_bytes(child.process.pid)
    addresses = data_planes([child.process.pid for child in peers])
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from swarm.averaging.transport import MAGIC

PROBE_TIMEOUT_S = 2.0


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the command's closing parenthesis: state, ppid, pgrp, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def group_rss_bytes(pgid: int) -> int:
    """The resident memory of every process in group ``pgid``, in bytes (0 once it is gone)."""
    total = 0
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def _listening_inodes() -> dict[str, int]:
    """socket inode -> port of every listening TCP socket on loopback or any address (IPv4)."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[fields[9]] = int(fields[1].split(":")[1], 16)
    return found


def listening_ports(pgid: int) -> list[int]:
    """The TCP ports the processes of group ``pgid`` listen on."""
    inodes, ports = _listening_inodes(), set()
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        ports.add(inodes[link[8:-1]])
    return sorted(ports)


def data_planes(pgids: list[int], host: str = "127.0.0.1") -> list[str]:
    """``host:port`` of each averaging data plane the groups ``pgids`` listen on."""
    found = []
    for pgid in pgids:
        for port in listening_ports(pgid):
            with contextlib.suppress(OSError), socket.create_connection((host, port), PROBE_TIMEOUT_S) as s:
                s.settimeout(PROBE_TIMEOUT_S)
                if s.recv(len(MAGIC)) == MAGIC:
                    found.append(f"{host}:{port}")
    return found
