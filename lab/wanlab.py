"""The internet on one machine: hosts in network namespaces behind kernel-capped links and NAT routers.

A lab is a router namespace and one namespace per host. Each host hangs off the router by its own veth
link, whose two directions are capped by the kernel (``tc`` token buckets: the host's side shapes its
upload, the router's side its download), like a volunteer's home connection. A host behind NAT sits one
hop further, behind a NAT box namespace that masquerades its traffic: it can dial out and cannot be
dialed, since nothing outside routes to its private address and the box forwards only replies.

Addresses are private ones that exist only inside the lab's namespaces (10.77.K.0/24 for host K's
link, 192.168.K.0/24 behind host K's NAT box); the machine's own namespace is never changed. Names
carry this process's ID, every namespace is removed on exit, and a :class:`~lab.localswarm.Reaper`
given to the lab removes them even when this process is killed outright. Creating a lab needs root:
without it the lab raises a ``ConfigError`` that says so.

Example::

    with WanLab(hosts=3, nat=1, link=LinkSpec(up_mbit=20, down_mbit=100)) as lab:
        subprocess.run([*lab.exec_prefix(1), "python3", "-c", "print('hello from host 1')"])
        print(lab.host(3).address, lab.host(3).behind_nat)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocols.errors import ConfigError, SwarmError

if TYPE_CHECKING:
    from lab.localswarm import Reaper

NETNS_DIR = Path("/run/netns")
# Big enough for a veth's offloaded 64 KiB segments; tbf drops any packet larger than its bucket.
MIN_BURST_BYTES = 64 * 1024
COMMAND_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LinkSpec:
    """A host's access link: upload and download caps in Mbit/s (None: uncapped)."""

    up_mbit: float | None = None
    down_mbit: float | None = None

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``up=20mbit,down=100mbit`` (units mbit or kbit; either part may be left out)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(up|down)=(\d+(?:\.\d+)?)(mbit|kbit)", part)
            if match is None:
                raise ConfigError(
                    f"--wan: {part!r} is not up=RATE or down=RATE with RATE like 20mbit or 500kbit"
                )
            name, number, unit = match.groups()
            rate = float(number) / (1000 if unit == "kbit" else 1)
            if not 0.05 <= rate <= 100_000:
                raise ConfigError(f"--wan: {name} rate {rate} Mbit/s is outside 0.05..100000")
            values[f"{name}_mbit"] = rate
        if not values:
            raise ConfigError("--wan needs up=RATE and/or down=RATE, for example up=20mbit,down=100mbit")
        return cls(**values)


@dataclass(frozen=True)
class LabHost:
    """Host ``index`` of a lab: its namespace and the address it listens on."""

    index: int
    netns: str
    address: str  # the host's own address (private to its NAT box when behind_nat)
    behind_nat: bool
    uplink_netns: str  # the namespace whose "wan" interface carries this host's capped link


def check_lab_possible() -> None:
    """Raise a ConfigError naming what is missing when this process cannot build a lab."""
    if os.geteuid() != 0:
        raise ConfigError("the WAN lab needs root (it creates network namespaces and tc qdiscs): run as root")
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"the WAN lab needs {', '.join(missing)}: install iproute2 and iptables (apt-get install iproute2 iptables)"
        )


def _run(*args: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SwarmError(f"WAN lab: {' '.join(args)} did not finish in {COMMAND_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        raise SwarmError(f"WAN lab: {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _burst_bytes(mbit: float) -> int:
    return max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 / 50))


class WanLab:
    """``hosts`` hosts (1..hosts) on capped links; the last ``nat`` of them behind NAT boxes."""

    def __init__(
        self, hosts: int, *, nat: int = 0, link: LinkSpec = LinkSpec(), reaper: Reaper | None = None
    ):
        if not 1 <= hosts <= 200:
            raise ConfigError(f"a WAN lab holds 1..200 hosts, not {hosts}")
        if not 0 <= nat <= hosts:
            raise ConfigError(f"--nat {nat} must be between 0 and the number of hosts ({hosts})")
        self.link = link
        self.prefix = f"swl-{os.getpid()}-"
        self.router = f"{self.prefix}r"
        self.hosts = [self._plan(k, behind_nat=k > hosts - nat) for k in range(1, hosts + 1)]
        self.reaper = reaper
        self._created: list[str] = []
        self._lock = threading.Lock()

    def _plan(self, k: int, *, behind_nat: bool) -> LabHost:
        netns = f"{self.prefix}h{k}"
        if behind_nat:
            return LabHost(k, netns, f"192.168.{k}.2", True, f"{self.prefix}n{k}")
        return LabHost(k, netns, f"10.77.{k}.2", False, netns)

    def host(self, index: int) -> LabHost:
        return self.hosts[index - 1]

    def exec_prefix(self, index: int) -> list[str]:
        """The command prefix that runs a program inside host ``index``'s namespace."""
        return ["ip", "netns", "exec", self.host(index).netns]

    # --- building and removing ---------------------------------------------------------------------

    def __enter__(self) -> WanLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        check_lab_possible()
        remove_stale_labs()
        try:
            self._netns(self.router)
            self._sysctl(self.router, "net.ipv4.ip_forward=1")
            for host in self.hosts:
                self._build(host)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove every namespace of the lab (their links go with them); safe to call twice."""
        with self._lock:
            created, self._created = self._created, []
        for netns in reversed(created):
            with contextlib.suppress(SwarmError):
                _run("ip", "netns", "delete", netns)
        if self.reaper is not None and created:
            self.reaper.forget_netns(created)

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        with self._lock:
            self._created.append(name)
        if self.reaper is not None:
            self.reaper.watch_netns(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _sysctl(self, netns: str, setting: str) -> None:
        _run("ip", "netns", "exec", netns, "sysctl", "-q", "-w", setting)

    def _veth(self, ns_a: str, name_a: str, addr_a: str, ns_b: str, name_b: str, addr_b: str) -> None:
        _run(
            "ip", "link", "add", name_a, "netns", ns_a, "type", "veth", "peer", "name", name_b, "netns", ns_b
        )
        for netns, name, address in ((ns_a, name_a, addr_a), (ns_b, name_b, addr_b)):
            _run("ip", "-n", netns, "addr", "add", address, "dev", name)
            _run("ip", "-n", netns, "link", "set", name, "up")

    def _shape(self, netns: str, device: str, mbit: float | None) -> None:
        if mbit is None:
            return
        _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", device, "root", "tbf",
             "rate", f"{mbit}mbit", "burst", str(_burst_bytes(mbit)), "latency", "200ms")  # fmt: skip

    def _build(self, host: LabHost) -> None:
        k = host.index
        wan_ns = host.uplink_netns
        self._netns(host.netns)
        if host.behind_nat:
            self._netns(wan_ns)
        self._veth(self.router, f"h{k}", f"10.77.{k}.1/24", wan_ns, "wan", f"10.77.{k}.2/24")
        self._shape(wan_ns, "wan", self.link.up_mbit)
        self._shape(self.router, f"h{k}", self.link.down_mbit)
        if not host.behind_nat:
            _run("ip", "-n", host.netns, "route", "add", "default", "via", f"10.77.{k}.1")
            return
        # The NAT box: a public side towards the router, a private side towards the host; it forwards
        # the host's connections out (masqueraded) and only replies back in.
        self._veth(wan_ns, "lan", f"192.168.{k}.1/24", host.netns, "eth0", f"192.168.{k}.2/24")
        _run("ip", "-n", wan_ns, "route", "add", "default", "via", f"10.77.{k}.1")
        _run("ip", "-n", host.netns, "route", "add", "default", "via", f"192.168.{k}.1")
        self._sysctl(wan_ns, "net.ipv4.ip_forward=1")
        nat = ["ip", "netns", "exec", wan_ns, "iptables"]
        _run(*nat, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _run(*nat, "-P", "FORWARD", "DROP")
        _run(*nat, "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")
        _run(*nat, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
             "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip

    # --- counters ----------------------------------------------------------------------------------

    def link_bytes(self, index: int) -> tuple[int, int]:
        """(bytes host ``index`` sent up its link, bytes it received down it), from the kernel's counters."""
        host = self.host(index)
        out = _run("ip", "-n", host.uplink_netns, "-j", "-s", "link", "show", "dev", "wan")
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def remove_stale_labs() -> list[str]:
    """Remove lab namespaces left by processes that no longer exist (a lab killed before its reaper ran)."""
    removed = []
    if not NETNS_DIR.is_dir():
        return removed
    for entry in NETNS_DIR.iterdir():
        match = re.fullmatch(r"swl-(\d+)-[rhn]\d*", entry.name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            with contextlib.suppress(SwarmError):
                _run("ip", "netns", "delete", entry.name)
                removed.append(entry.name)
    return removed


def peak_mbit(
    samples: Sequence[tuple[float, Sequence[int] | dict]], key: object, window_s: float = 2.0
) -> float:
    """The highest rate, in Mbit/s, over any ``window_s`` of counter ``samples`` ((time, byte counters)),
    of the counter at ``key`` (an index or a host number)."""
    peak = 0.0
    for i, (t0, first) in enumerate(samples):
        later = next(((t, c) for t, c in samples[i + 1 :] if t - t0 >= window_s), None)
        if later is not None:
            peak = max(peak, (later[1][key] - first[key]) * 8 / (later[0] - t0) / 1e6)
    return peak
