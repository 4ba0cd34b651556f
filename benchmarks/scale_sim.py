"""The scale table: a simulated run (``lab.scalesim``) at 8 to 1,000 peers, with and without the second tier.

Each row is one discrete-event run that drives the real round decisions (layout, deadlines, matchmaking
windows, representative, second-tier rules, catch-up) over modeled links; nothing is started. Prints a
markdown table, and writes the figures as JSON and a plot (bytes sent per peer per step and seconds per
step against peers, log x axis) as SVG. Every field of ``ScaleConfig`` is a flag; this command's defaults
add joins over the first minute, 2% churn per peer and step, and 10% attackers.

Usage::

    python benchmarks/scale_sim.py --json scale.json --svg scale.svg
    python benchmarks/scale_sim.py --peers-list 8,64,512 --group-sizes 16 --churn 0 --attackers 0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.scalesim import ScaleConfig, ScaleSim  # noqa: E402

SCENARIO = {"join_over_s": 60.0, "churn": 0.02, "attackers": 0.1}
SERIES_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def _flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ScaleConfig`` field, typed and described as the field is (``peers``, ``two_tier`` and
    ``max_group_size`` are swept instead)."""
    for name, info in ScaleConfig.model_fields.items():
        if name in ("peers", "two_tier", "max_group_size"):
            continue
        flag, default = "--" + name.replace("_", "-"), SCENARIO.get(name, info.default)
        if info.annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=info.description
            )
        elif get_args(info.annotation):
            parser.add_argument(
                flag, choices=get_args(info.annotation), default=default, help=info.description
            )
        else:
            parser.add_argument(flag, type=info.annotation, default=default, help=info.description)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers-list", type=_ints, default=_ints("8,16,32,64,128,256,512,1000"))
    parser.add_argument("--group-sizes", type=_ints, default=[64, 16], help="max_group_size of each sweep")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--svg", type=Path, help="write the plot here")
    parser.add_argument("--quick", action="store_true", help="8 and 16 peers, 3 steps (a smoke run)")
    _flags(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.peers_list, args.steps = [8, 16], 3
    fields = {name: getattr(args, name) for name in ScaleConfig.model_fields if hasattr(args, name)}
    started = time.process_time()
    runs = []
    for size in args.group_sizes:
        for two_tier in (True, False):
            for peers in args.peers_list:
                config = ScaleConfig(peers=peers, max_group_size=size, two_tier=two_tier, **fields)
                result = ScaleSim(config).run()
                result.pop("config")
                runs.append({"peers": peers, "max_group_size": size, "two_tier": two_tier, **result})
                print(_row(runs[-1]), file=sys.stderr, flush=True)
    print("| tier | max group | peers | median s/step | mean MB sent/peer/step | max MB | steady-state "
          "downloads | all downloads | same update | finished |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for run in runs:
        print(_row(run))
    print(f"\n{len(runs)} runs, {time.process_time() - started:.1f} s of CPU")
    if args.json:
        settings = {k: v for k, v in fields.items()}
        args.json.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
    if args.svg:
        args.svg.write_text(plot(runs))
    return 0


def _row(run: dict) -> str:
    tier = "two-tier" if run["two_tier"] else "one-tier"
    return (
        f"| {tier} | {run['max_group_size']} | {run['peers']} | {run['median_step_s']:.0f} | "
        f"{run['mean_bytes'] / 1e6:.1f} | {run['max_bytes'] / 1e6:.0f} | {run['steady_downloads']} | "
        f"{run['downloads']} | {run['same_update_fraction']:.0%} | {'yes' if run['finished'] else 'no'} |"
    )


def plot(runs: list[dict]) -> str:
    """Two line charts side by side, log x (peers) and log y: mean MB sent per peer per step, and median
    seconds per step, one line per (tier, max group size)."""
    series: dict[str, list[dict]] = {}
    for run in runs:
        name = f"{'two' if run['two_tier'] else 'one'}-tier, groups of {run['max_group_size']}"
        series.setdefault(name, []).append(run)
    panels = [("mean MB sent per peer per step", lambda r: r["mean_bytes"] / 1e6),
              ("median seconds per step", lambda r: r["median_step_s"])]  # fmt: skip
    width, height, pad = 460, 300, 55
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 90}" '
           'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']  # fmt: skip
    peers = sorted({r["peers"] for r in runs})
    x_lo, x_hi = math.log10(min(peers)), math.log10(max(peers))
    for p, (title, value) in enumerate(panels):
        left = p * width
        points = [value(r) for r in runs if value(r) > 0 and math.isfinite(value(r))]
        if not points:
            continue
        y_lo, y_hi = math.floor(math.log10(min(points))), math.ceil(math.log10(max(points)))
        y_hi = max(y_hi, y_lo + 1)

        def xy(
            n: float, v: float, left: int = left, y_lo: int = y_lo, y_hi: int = y_hi
        ) -> tuple[float, float]:
            fx = (math.log10(n) - x_lo) / max(1e-9, x_hi - x_lo)
            fy = (math.log10(v) - y_lo) / (y_hi - y_lo)
            return left + pad + fx * (width - 2 * pad), 20 + (1 - fy) * (height - 40)

        out.append(f'<text x="{left + width / 2}" y="14" text-anchor="middle">{title}</text>')
        x0, y0 = xy(min(peers), 10**y_lo)
        x1, y1 = xy(max(peers), 10**y_hi)
        out.append(f'<path d="M{x0},{y1} V{y0} H{x1}" stroke="black" fill="none"/>')
        for n in peers:
            x, _ = xy(n, 10**y_lo)
            out.append(f'<text x="{x:.1f}" y="{y0 + 14:.1f}" text-anchor="middle">{n}</text>')
        for e in range(y_lo, y_hi + 1):
            _, y = xy(min(peers), 10**e)
            out.append(f'<text x="{x0 - 4:.1f}" y="{y + 4:.1f}" text-anchor="end">{10**e:g}</text>')
            out.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left + width / 2}" y="{y0 + 30:.1f}" text-anchor="middle">peers (log)</text>')
        for s, rows in enumerate(series.values()):
            pts = [xy(r["peers"], value(r)) for r in rows if value(r) > 0 and math.isfinite(value(r))]
            color = SERIES_COLORS[s % len(SERIES_COLORS)]
            dash = "" if rows[0]["two_tier"] else ' stroke-dasharray="5,3"'
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
    for s, name in enumerate(series):
        color, y = SERIES_COLORS[s % len(SERIES_COLORS)], height + 45 + 14 * (s % 3)
        x = pad + (s // 3) * 300
        out.append(
            f'<line x1="{x}" x2="{x + 20}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{x + 25}" y="{y}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
