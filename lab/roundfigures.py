"""Per-step figures of a rehearsal, from its peers' round journals (``swarm.journal``).

For each step ``s`` (the round that moves the run from ``s`` to ``s + 1``): how many groups applied a
round there, how large the largest was and how many samples they signed for together (the step's
batch), how many peers applied one (those that adopted the step's
combined result from a peer ahead, ``adopted``, included) and whether they all moved to the same state, how many full-state downloads loaded a state of step ``s + 1`` instead (and how many of those
were by a joiner or a restarted peer that had applied no round since it started), how many peers' lives
ended there (a process killed while at that step, its round possibly done by its groupmates and never
written down by it), the averaging bytes each applying peer sent for it (its failed tries at that step
included), and how long matchmaking took.

A peer's journal is cut into lives at each ``joined`` line (a restart appends to the same file). A
download in a life before that life's first applied round is a joiner's; any other is a peer that fell
out of line with the run, which is what a swarm that applies one update per step never needs.

Example::

    figures = step_figures({"peer0": read_journal(Path("peer0-rounds.jsonl")), ...}, steps=10)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence


def step_figures(journals: Mapping[str, Sequence[dict]], steps: int) -> list[dict]:
    """One dict per step ``0 .. steps - 1`` (see the module docstring for what each holds)."""
    groups: dict[int, dict[str, tuple[int, float]]] = defaultdict(dict)  # step -> group ID -> (size, samples)
    applied: dict[int, dict[str, str]] = defaultdict(dict)  # step -> peer -> state hash it moved to
    sent: dict[int, list[float]] = defaultdict(list)
    form_s: dict[int, list[float]] = defaultdict(list)
    tries: dict[int, int] = defaultdict(int)
    downloads: dict[int, int] = defaultdict(int)
    joiner_downloads: dict[int, int] = defaultdict(int)
    adopted: dict[int, int] = defaultdict(int)
    lives_ended: dict[int, int] = defaultdict(int)
    for name, rows in journals.items():
        sent_before = 0.0  # averaging bytes this life had sent when its last applied round ended
        in_line = False  # this life applied a round since it (re)started
        at: int | None = None  # the step this life is at: None before its first line
        for row in rows:
            event, step = row.get("event"), row.get("step")
            if event == "joined":
                if at is not None:  # the previous life ended (killed or stopped) while at step ``at``
                    lives_ended[at] += 1
                sent_before, in_line, at = 0.0, False, step if isinstance(step, int) else 0
            elif event == "download" and isinstance(step, int):  # it loaded the state after step - 1
                downloads[step - 1] += 1
                joiner_downloads[step - 1] += not in_line
                at = step
            elif event == "round" and isinstance(step, int):
                outcome = row.get("outcome")
                tries[step] += outcome != "adopted"
                if outcome not in ("applied", "adopted"):
                    continue
                in_line, at = True, step + 1
                if outcome == "adopted":  # the step's combined result, taken from a peer ahead
                    adopted[step] += 1
                else:
                    groups[step][str(row.get("group", ""))] = (
                        int(row.get("size", 0)),
                        float(row.get("samples", 0.0)),
                    )
                applied[step][name] = str(row.get("state_hash", ""))
                now_sent = float(row.get("sent", 0.0))
                sent[step].append(max(0.0, now_sent - sent_before))
                sent_before = now_sent
                form_s[step].append(float(row.get("form_s", 0.0)))
    figures = []
    for step in range(steps):
        results = set(applied[step].values())
        figures.append({
            "step": step,
            "groups": len(groups[step]),
            "largest_group": max((size for size, _ in groups[step].values()), default=0),
            "samples": sum(samples for _, samples in groups[step].values()),
            "peers_applied": len(applied[step]),
            "round_tries": tries[step],
            "distinct_results": len(results),
            "same_update": len(results) == 1,
            "adopted": adopted[step],
            "state_downloads": downloads[step],
            "joiner_downloads": joiner_downloads[step],
            "lives_ended": lives_ended[step],
            "bytes_sent_per_peer": statistics.fmean(sent[step]) if sent[step] else 0.0,
            "form_s_median": statistics.median(form_s[step]) if form_s[step] else 0.0,
            "form_s_max": max(form_s[step], default=0.0),
        })  # fmt: skip
    return figures


def steady_downloads(figures: Sequence[dict], after_steps: int = 2) -> int:
    """Full-state downloads after the first ``after_steps`` steps by peers that had already applied a round
    in their life: zero when every peer of every step applied the same update."""
    return sum(f["state_downloads"] - f["joiner_downloads"] for f in figures if f["step"] >= after_steps)
