"""``swarm-sim``: rehearse a whole collaborative run on one machine, then check it.

It starts a coordinator and N volunteer peers as separate processes on loopback, trains the demo run
(or a tinier preset) for S steps with a live progress line, optionally kills and restarts peers on the
way (``--churn``), and then verifies the outcome independently: it loads the coordinator's final
checkpoint, measures validation loss before and after training, and compares every peer's reported
parameter hash with the checkpoint's. It exits 0 only when validation loss fell and all peers agree.

Example::

    swarm-sim --peers 3 --steps 20 --json sim.json
"""

from __future__ import annotations

import swarm.procenv  # noqa: F401  # isort: skip  (before grpc loads: see its docstring)

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.cli import status_to_dict
from coordinator.metrics import is_paused
from lab.localswarm import COMMAND_MODULES, status, wait_until
from lab.rehearsal import Rehearsal
from lab.roundfigures import steady_downloads, step_figures
from lab.simconfig import SimConfig, build_run, samples_per_step
from lab.wanlab import LinkSpec, WanLab, peak_mbit
from peer.control import RESUME_SIGNAL
from protocols.errors import NetworkError, SwarmError
from swarm import forkserver, runtime
from swarm.cliargs import add_config_arguments, config_from_args
from swarm.config import RunConfig
from swarm.journal import read_journal

EVAL_WINDOWS = 256  # validation windows of the sim's own evaluation, spread over the whole split
EVAL_BATCH = 16


def evaluate(run: RunConfig, checkpoint: Path | None) -> tuple[float, str]:
    """Validation loss and parameter hash of the run's initial weights, or of a checkpoint's, over
    ``EVAL_WINDOWS`` fixed windows of the validation split (a mean over batches of equal size, but the
    last, which may hold fewer when the split is small)."""

    from swarm.data import build_dataset
    from swarm.models import build_model, model_config
    from swarm.training.checkpoint import load_checkpoint
    from swarm.training.state import build_shared_optimizer, load_state_tensors, params_hash

    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    if checkpoint is not None:
        optimizer = build_shared_optimizer(model, run)
        load_state_tensors(model, optimizer, load_checkpoint(checkpoint).tensors)
    dataset = build_dataset(run.dataset.name, run.dataset.config)
    seq_len = model_config(run.model.name, run.model.config).seq_len
    return validation_loss(model, eval_batches(dataset, seq_len)), params_hash(model)


def eval_batches(dataset, seq_len: int) -> list:
    """The ``EVAL_WINDOWS`` windows every run is judged on, whatever its micro-batch, so that runs of
    different configurations compare."""
    return dataset.validation_batches(EVAL_BATCH, seq_len, EVAL_WINDOWS // EVAL_BATCH)


def validation_loss(model, batches: list) -> float:
    """The mean loss of ``model`` (left in eval mode) over ``batches``."""
    import torch

    model.eval()
    with torch.no_grad():
        return sum(float(model.loss(x, y)) for x, y in batches) / len(batches)


def throughput(steps: int, target_batch_size: int, seconds: float) -> float:
    """The run's samples/s, as the live line and the JSON both report it: samples of completed global
    steps (``steps * target_batch_size``) per second since the first peer came online (start-up and
    the final evaluation excluded). A peer's own ``samples/s (local)`` counts its forward/backward
    passes instead, and is higher."""
    return steps * target_batch_size / seconds if seconds > 0 else 0.0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


class Progress:
    """A progress bar with ETA on a terminal (rich); a plain line every few seconds otherwise.

    ``peers`` counts the peers the rehearsal started that are running and have joined, so a late
    heartbeat on a loaded machine does not show as a peer lost."""

    def __init__(self, steps: int, target_batch_size: int) -> None:
        self.steps = steps
        self.target_batch_size = target_batch_size
        self.training_started: float | None = None
        self.last_plain = 0.0
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[line]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False,
            )  # fmt: skip
            self.task = self.bar.add_task("train", total=steps, line="starting peers")
            self.bar.start()

    def rate(self, step: int) -> float:
        if self.training_started is None:
            return 0.0
        return throughput(step, self.target_batch_size, time.monotonic() - self.training_started)

    def show(self, snapshot: dict, running: set[str], started: float) -> int:
        """Draw the line for a status ``snapshot``; returns the step shown."""
        joined = [
            p for p in snapshot["peers"] if p["name"] in running and p["state"] not in ("left", "banned")
        ]
        online = [p for p in joined if p["state"] == "online"]
        if online and self.training_started is None:
            self.training_started = time.monotonic()
        step = max((p["step"] for p in joined), default=0)
        losses = [p["metrics"]["train_loss"] for p in joined if "train_loss" in p["metrics"]]
        vals = [p["metrics"]["val_loss"] for p in joined if "val_loss" in p["metrics"]]
        fields = (
            f"loss {_fmt(min(losses, default=None))}  val {_fmt(min(vals, default=None))}  "
            f"peers {len(joined)}  {self.rate(step):.1f} samples/s"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=min(step, self.steps), line=fields)
        elif time.monotonic() - self.last_plain > 5:
            print(f"step {step}/{self.steps}  {fields}  {time.monotonic() - started:.0f}s", flush=True)
            self.last_plain = time.monotonic()
        return step

    def phase(self, what: str) -> None:
        """Say what the rehearsal is doing before and after the training steps (seconds each, minutes on
        a busy machine), so the terminal never sits silent."""
        if self.bar is not None:
            self.bar.update(self.task, line=what)
        else:
            print(f"swarm-sim: {what}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def simulate(config: SimConfig) -> int:
    run = build_run(config)
    if config.stages:
        from lab.pipeline_sim import simulate_pipeline

        return simulate_pipeline(config, run)
    with Rehearsal(config) as rehearsal:
        gpus = f" ({config.gpu_peers} on the GPU)" if config.gpu_peers else ""
        print(f"swarm-sim: coordinator + {config.peers} peers{gpus}, {config.steps} steps, model "
              f"{config.model_size} (logs in {rehearsal.root}; kept with --keep-logs)", flush=True)  # fmt: skip
        progress = Progress(config.steps, samples_per_step(config))
        rehearsal.on_exit.append(progress.close)
        try:
            return _simulate(config, run, rehearsal, progress)
        except (SwarmError, TimeoutError) as e:
            progress.close()
            if config.json_path:  # what the rounds did up to the failure is what explains it
                report = {"failed": str(e), **_round_report(rehearsal.root, config, run)}
                config.json_path.write_text(json.dumps(report, indent=2))
            return rehearsal.failed(e)


def _simulate(config: SimConfig, run: RunConfig, rehearsal: Rehearsal, progress: Progress) -> int:
    local = rehearsal.local
    lab: WanLab | None = None
    if config.wan or config.nat:
        link = LinkSpec.parse(config.wan) if config.wan else LinkSpec()
        lab = WanLab(hosts=config.peers + 1, nat=config.nat, link=link, reaper=local.reaper)
        rehearsal.on_exit.append(lab.down)
    # Before any peer starts: evaluating 256 windows takes seconds, and the peers' own evaluations
    # of those seconds would go unrecorded in val_history.
    progress.phase("evaluating the initial model")
    initial_loss, _ = evaluate(run, None)
    churn_events: list[dict] = []
    val_history: list[float] = []
    link_samples: list[tuple[float, list[int]]] = []  # (time, bytes each peer's link sent), in the lab
    if lab is not None:
        lab.up()
    progress.phase("starting the coordinator")
    coordinator = local.start_coordinator(run, **_placement(lab, 0))
    progress.phase(f"starting {config.peers} peers")
    address = coordinator.extra["address"]
    # In the lab no route leads from here to the coordinator's namespace: ask through its socket.
    control = coordinator.extra["socket"] if lab is not None else address
    checkpoints = coordinator.extra["data_dir"] / "checkpoints"
    names = _peer_names(config)
    devices = {name: "gpu" if i < config.gpu_peers else "cpu" for i, name in enumerate(names)}
    # Attackers are peer1.. (the churn victim is the last peer, always honest).
    byzantine = set(names[1 : 1 + config.byzantine])
    group_size = min(config.peers, config.max_group_size or config.peers)
    rehearsal_flags = ["--rehearse-attack", str(config.attack), "--rehearse-attackers", str(config.byzantine),
                       "--rehearse-group-size", str(group_size)]  # fmt: skip
    flags = ["--activation-checkpointing"] if config.activation_checkpointing else []

    def launch(name: str, *, paused: bool, attacker: bool = True):
        return local.start_peer(
            address, name, *(["--start-paused"] if paused else []), *flags,
            "--round-journal", str(_journal_path(local.root, name)),
            *(rehearsal_flags if attacker and name in byzantine else ()),
            device=devices[name], **_placement(lab, names.index(name) + 1),
        )  # fmt: skip

    # With --join-over, peer i starts at i / (N - 1) of that span (and trains as soon as it is in).
    due = {name: i * config.join_over / max(1, len(names) - 1) for i, name in enumerate(names)}
    peers = {} if config.join_over else {name: launch(name, paused=True) for name in names}

    def mount_protocol_attacks() -> None:
        """Start the stranger once every honest peer has joined (its flood of challenges would refuse their
        joins from the same loopback address) and before they train: it is there from the first step."""
        if not config.protocol_attack:
            return
        from swarm.byzantine.protocol_attacks import protocol_attack_names

        mounted = (
            protocol_attack_names() if config.protocol_attack == "all" else config.protocol_attack.split(",")
        )
        # Not ``-m``: the package imports the module first (its attacks register there), and runpy warns.
        attacker = (
            "import sys; from swarm.byzantine.protocol_attacks import main; sys.exit(main(sys.argv[1:]))"
        )
        child = local.spawn("protocol-attacker", ["-c", attacker, "--run-id", run.run_id,
                                                  "--initial-peers", *coordinator.extra["dht_initial_peers"],
                                                  "--coordinator", address, "--attack", *mounted])  # fmt: skip
        while "sent so far" not in child.output():
            if child.process.poll() is not None:
                raise SwarmError(
                    f"the protocol attacker exited {child.process.returncode}; see {child.log_path}"
                )
            rehearsal.check_deadline("the protocol attacker mounted nothing")
            time.sleep(0.5)

    if config.join_over:
        started_at = time.monotonic()
    else:
        _start_together(control, peers, rehearsal, before_resume=mount_protocol_attacks)
    churned = False
    final = checkpoints / f"ckpt-{config.steps:08d}.safetensors"
    while True:
        if config.join_over and len(peers) < len(names):
            for name in names:
                if name not in peers and time.monotonic() - started_at >= due[name]:
                    peers[name] = launch(name, paused=False)
            if len(peers) == len(names):
                mount_protocol_attacks()
        snapshot = status_to_dict(_status(control, rehearsal))
        _record_validation(snapshot, byzantine, val_history)
        if lab is not None:
            link_samples.append((time.monotonic(), [lab.link_bytes(i + 2)[0] for i in range(len(names))]))
        progress.show(snapshot, {n for n, c in peers.items() if c.process.poll() is None}, rehearsal.started)
        steps = {
            p["name"]: p["step"]
            for p in snapshot["peers"]
            if p["state"] == "online" and p["name"] in peers and p["name"] not in byzantine
        }
        if (
            config.churn
            and not churned
            and config.peers > 1
            and names[-1] in steps  # the victim (the last peer) is online: with --join-over it starts last
            and max(steps.values(), default=0) >= config.steps // 3
        ):
            victim = names[-1]
            peers[victim].process.kill()
            # Reaped at once: an unreaped (zombie) victim still looks alive to its restart's pid check.
            peers[victim].wait(timeout_s=30)
            churn_events.append({"killed": victim, "at_step": max(steps.values())})
            wait_until(
                lambda v=victim: _state(control, rehearsal, v) == "offline",
                timeout_s=30,
                what=f"{victim} offline",
            )
            peers[victim] = launch(victim, paused=False, attacker=False)
            churn_events[-1]["restarted"] = True
            churned = True
        if (
            len(peers) == len(names)
            and len(steps) == config.peers - len(byzantine)
            and all(s >= config.steps for s in steps.values())
            and final.exists()
        ):
            break
        # A peer that cannot start must not leave us waiting (an attacker may be banned and leave).
        rehearsal.check_children(peers, expected_gone=byzantine)
        rehearsal.check_deadline(f"the run did not reach step {config.steps} within {config.timeout_s:.0f}s")
        time.sleep(1.0)
    progress.close()
    samples_per_s = progress.rate(config.steps)
    print(f"swarm-sim: reached step {config.steps}; evaluating the final checkpoint", flush=True)
    final_loss, final_hash = evaluate(run, final)
    print("swarm-sim: stopping the peers", flush=True)
    snapshot = status_to_dict(_status(control, rehearsal))
    wan = _wan_report(lab, names, link_samples) if lab is not None else None
    for name in names:
        if peers[name].process.poll() is None:
            peers[name].signal(signal.SIGTERM)
    for name in names:
        peers[name].wait(timeout_s=60)
    duration = rehearsal.elapsed_s()
    peer_rows = [
        {"peer_id": p["peer_id"], "name": p["name"], "param_hash": p["param_hash"], "step": p["step"],
         "bytes_sent": p["metrics"].get("bytes_sent", 0.0), "state": p["state"], "device": p["device"],
         "contributed_samples": p["metrics"].get("contributed_samples", 0.0),
         "senders_checked": p["metrics"].get("senders_checked", 0.0),
         "senders_caught": p["metrics"].get("senders_caught", 0.0),
         "senders_outliers": p["metrics"].get("senders_outliers", 0.0),
         "senders_fit_scored": p["metrics"].get("senders_fit_scored", 0.0),
         "sender_fit_s": p["metrics"].get("sender_fit_s", 0.0),
         "sender_replay_s": p["metrics"].get("sender_replay_s", 0.0),
         "compute_s": p["metrics"].get("compute_s", 0.0),
         "averaging_s": p["metrics"].get("averaging_s", 0.0),
         "compute_utilization": p["metrics"].get("compute_utilization", 0.0),
         "byzantine": p["name"] in byzantine, "banned": p["state"] == "banned" or bool(p["ban_reason"]),
         "ban_reason": p["ban_reason"]}
        for p in snapshot["peers"]
        if p["name"] in peers
    ]  # fmt: skip
    # Identities the sim did not start (a protocol attacker's Sybils): what the coordinator made of them.
    strangers = [p for p in snapshot["peers"] if p["name"] not in peers]
    # Attackers may hold anything; the run is healthy when the honest peers agree with the checkpoint.
    agree = all(row["param_hash"] == final_hash for row in peer_rows if not row["byzantine"])
    honest = [row for row in peer_rows if not row["byzantine"]]
    samples = sum(row["contributed_samples"] for row in honest)
    result = {
        "sync": run.training.sync,
        "compression": run.training.compression,
        "outer_steps": config.steps if run.training.sync == "diloco" else 0,
        "inner_steps": run.training.inner_steps if run.training.sync == "diloco" else 1,
        # Averaging bytes the honest peers sent, per sample they trained on in applied rounds.
        "bytes_sent_per_sample": sum(row["bytes_sent"] for row in honest) / max(samples, 1.0),
        "compute_utilization": sum(row["compute_utilization"] for row in honest) / max(len(honest), 1),
        "initial_val_loss": initial_loss,
        "final_val_loss": final_loss,
        "steps": config.steps,
        "peers": peer_rows,
        "bytes_sent_per_peer": {row["peer_id"]: row["bytes_sent"] for row in peer_rows},
        "final_param_hash": final_hash,
        "peers_agree": agree,
        "strangers": {
            "rows": len(strangers),
            "online": sum(p["state"] == "online" for p in strangers),
            "banned": sum(p["state"] == "banned" or bool(p["ban_reason"]) for p in strangers),
        },
        "churn_events": churn_events,
        **_round_report(local.root, config, run),
        "val_history": val_history,
        "wan": wan,
        "attack": config.attack,
        "protocol_attack": config.protocol_attack,
        "aggregator": run.training.aggregator,
        "duration_s": duration,
        "samples_per_s": samples_per_s,
    }
    line = (f"validation loss {initial_loss:.4f} -> {final_loss:.4f} over {config.steps} steps in {duration:.0f}s; "
            f"{len(peer_rows)} peers {'hold identical parameters' if agree else 'DISAGREE'} ({final_hash[:16]}); "
            f"one update at {result['steps_with_one_update']} of {config.steps} steps, "
            f"{result['state_downloads']} state downloads ({result['steady_state_downloads']} after the first 2 steps "
            "by peers already in line)")  # fmt: skip
    return rehearsal.finish(result, final_loss < initial_loss and agree, line)


def _round_report(root: Path, config: SimConfig, run: RunConfig) -> dict:
    """The per-step figures of the peers' round journals (``lab.roundfigures``), with their sums."""
    names = _peer_names(config)
    journals = {name: read_journal(path) for name in names if (path := _journal_path(root, name)).exists()}
    figures = step_figures(journals, config.steps)
    return {
        # Per step: groups, the largest, state downloads (a joiner's among them), bytes, matchmaking time.
        "per_step": figures,
        "state_downloads": sum(f["state_downloads"] for f in figures),
        "steady_state_downloads": steady_downloads(figures),
        "steps_with_one_update": sum(f["same_update"] for f in figures),
        "join_over_s": config.join_over,
        "max_group_size": run.training.max_group_size,
        "min_group_size": run.training.min_group_size,
    }


def _peer_names(config: SimConfig) -> list[str]:
    return [f"peer{i}" for i in range(config.peers)]


def _journal_path(root: Path, name: str) -> Path:
    """Where peer ``name`` writes its round journal (``swarm.journal``); a restart appends to it."""
    return root / f"{name}-rounds.jsonl"


def _placement(lab: WanLab | None, index: int) -> dict:
    """Where process ``index`` runs (0: the coordinator, K: peer K-1): loopback, or its lab host."""
    if lab is None:
        return {}
    return {"host": lab.host(index + 1).address, "prefix": lab.exec_prefix(index + 1)}


def _wan_report(lab: WanLab, names: list[str], samples: list[tuple[float, list[int]]]) -> dict:
    """The lab's links, what the kernel counted on each peer's link, and each link's busiest 2 s."""
    counted = {name: lab.link_bytes(i + 2) for i, name in enumerate(names)}
    return {
        "peak_up_mbit": {name: peak_mbit(samples, i) for i, name in enumerate(names)},
        "up_mbit": lab.link.up_mbit,
        "down_mbit": lab.link.down_mbit,
        "behind_nat": [name for i, name in enumerate(names) if lab.host(i + 2).behind_nat],
        "link_bytes_sent": {name: sent for name, (sent, _) in counted.items()},
        "link_bytes_received": {name: received for name, (_, received) in counted.items()},
    }


def _record_validation(snapshot: dict, byzantine: set[str], history: list[float]) -> None:
    """Append each new validation loss the honest peers report (they evaluate the same parameters)."""
    for peer in snapshot["peers"]:
        value = peer["metrics"].get("val_loss")
        if value is None or peer["name"] in byzantine:
            continue
        # GPU and CPU peers may evaluate the same parameters a few ulps apart: that is not a new value.
        if not history or abs(value - history[-1]) > 1e-6 * abs(history[-1]):
            history.append(value)
        return


def _start_together(
    control: str, peers: dict, rehearsal: Rehearsal, before_resume: Callable[[], None] = lambda: None
) -> None:
    """Every peer joins paused; once all are online, paused and through their start (a heartbeat with the
    validation loss of the state they start from), ``before_resume`` runs and all are resumed at once. A
    peer that took longer to start (seconds on a loaded machine) used to meet the others' rounds at another
    step, and so did one resumed before its start's validation: the other two of three formed every group
    of the run without it."""
    while True:
        waiting = {
            p.name
            for p in _status(control, rehearsal).peers
            if is_paused(p) and p.metrics.get("val_step", -1.0) >= 0  # validated: at the loop's pause point
        }
        missing = sorted(set(peers) - waiting)
        if not missing:
            break
        rehearsal.check_children(peers)
        rehearsal.check_deadline(
            f"{', '.join(missing)} did not join within {rehearsal.config.timeout_s:.0f}s"
        )
        time.sleep(0.5)
    before_resume()
    for child in peers.values():
        child.signal(RESUME_SIGNAL)


def _status(control: str, rehearsal: Rehearsal):
    """The coordinator's status; a call that times out (a coordinator slow to answer on a loaded machine,
    among dozens of peers) is made again until the rehearsal's deadline."""
    while True:
        try:
            return status(control)
        except NetworkError as e:
            rehearsal.check_deadline(f"the coordinator did not answer: {e}")
            time.sleep(1.0)


def _state(control: str, rehearsal: Rehearsal, name: str) -> str:
    return next((p.state for p in _status(control, rehearsal).peers if p.name == name), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swarm-sim", description=__doc__.splitlines()[0])
    add_config_arguments(parser, SimConfig)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(SimConfig, args)
    except SwarmError as e:
        print(f"swarm-sim: error: {e}", file=sys.stderr)
        return 2
    runtime.setup_logging("WARNING")
    if not config.fresh_interpreters:
        forkserver.start(preload=COMMAND_MODULES)
    return simulate(config)


if __name__ == "__main__":
    sys.exit(main())
