"""``swarm-sim --stages S``: rehearse a SWARM pipeline run on one machine, then check it.

It starts a coordinator, ``peers_per_stage`` stage servers for each of the S stages and ``trainers``
trainer peers, all as separate processes on loopback; optionally kills one replica serving the last
stage outright at a given step (``--kill-stage-peer-at``) and starts a replacement that joins that
stage (it downloads the stage's state; rebalancing may then move a replica back to the
stage it came from). Replicas rebalance every ``rebalance_interval_s`` (8 s here). It follows the run
through the coordinator's status and the pipeline records in the DHT, and at the end checks that
validation loss fell, that no micro-batch was lost, and that the honest replicas of every stage hold
identical parameters. With ``--byzantine K --attack NAME[,NAME...]`` (pipeline attacks of
``swarm.byzantine.pipeline_attacks``), K replicas (of the last stage first, for an attack a stage
replica mounts) or K trainers (for one a trainer mounts) play each attacker. ``--timeout-s`` bounds a stall: the sim gives up when the trainers make no step for that
long, however long the whole run takes.

Example::

    swarm-sim --stages 2 --peers-per-stage 2 --trainers 2 --kill-stage-peer-at 3 --steps 8 --model-size tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time

from coordinator.cli import status_to_dict
from lab.localswarm import status
from lab.rehearsal import Rehearsal
from lab.simconfig import SimConfig
from protocols.errors import ConfigError, SwarmError
from swarm.config import RunConfig


def build_pipeline_run(config: SimConfig, base: RunConfig) -> RunConfig:
    """The sim's run with its model split into ``config.stages`` stages (at least one block per stage)."""
    model = dict(base.model.config)
    model["n_layer"] = max(model.get("n_layer", 6), config.stages)
    data = base.model_dump(mode="json")
    data["model"]["config"] = model
    data["training"].update(min_group_size=1)
    data["pipeline"] = {"stages": config.stages, "request_timeout_s": 5.0, "announce_interval_s": 0.3,
                        "failed_server_cooldown_s": 3.0, "rebalance_interval_s": 8.0}  # fmt: skip
    if config.stage_verify_probability is not None:
        data["pipeline"]["verify_probability"] = config.stage_verify_probability
    return RunConfig.parse(data, source="swarm-sim pipeline run")


class _Observer:
    """Reads the pipeline's records from the DHT, as a client node of the run's DHT."""

    def __init__(self, initial_peers: list[str], run: RunConfig):
        from swarm.dht import SpawnedDHT

        self.run = run
        self.dht = SpawnedDHT(start=True, client_mode=True, initial_peers=initial_peers)

    def view(self):
        from swarm.pipeline.records import fetch_view
        from swarm.records import RecordTrust

        async def fetch():  # signed records of any signer: the observer only reports what it sees
            return await fetch_view(self.dht, RecordTrust(self.run.run_id), self.run.pipeline.stages)

        return asyncio.run(fetch())

    def close(self) -> None:
        self.dht.shutdown()


def pipeline_attackers(config: SimConfig) -> dict[str, str]:
    """Who mounts which attack of ``config.attack`` (one pipeline attack, or a comma-separated list of
    them), ``config.byzantine`` peers each: a stage attack goes to replicas of the last stage (then of the
    stages before it), a trainer attack to the first trainers; every stage and the trainers keep at least
    one honest peer."""
    if not config.byzantine:
        return {}
    from swarm.byzantine.attacks import make_attack

    stage_slots = [
        f"stage{k}-{i}" for k in reversed(range(config.stages)) for i in range(config.peers_per_stage - 1)
    ]
    trainer_slots = [f"trainer{i}" for i in range(config.trainers - 1)]
    mounts: dict[str, str] = {}
    for attack in str(config.attack).split(","):
        role = make_attack(attack, group_size=2, attackers=1).pipeline_role
        if role is None:
            raise ConfigError(f"--attack {attack} is not a pipeline attack: with --stages, use one that a "
                              "stage replica or a trainer mounts (swarm/byzantine/pipeline_attacks.py)")  # fmt: skip
        slots, flag = (stage_slots, "--peers-per-stage") if role == "stage" else (trainer_slots, "--trainers")
        if len(slots) < config.byzantine:
            raise ConfigError(f"--byzantine {config.byzantine}: {attack} is mounted by a {role}, and {flag} "
                              f"{config.peers_per_stage if role == 'stage' else config.trainers} leaves no honest one "
                              "(once the attacks before it in the list have their peers)")  # fmt: skip
        for _ in range(config.byzantine):
            mounts[slots.pop(0)] = attack
    return mounts


def simulate_pipeline(config: SimConfig, base: RunConfig) -> int:
    run = build_pipeline_run(config, base)
    try:
        pipeline_attackers(config)
    except ConfigError as e:
        return Rehearsal.failed(e)
    with Rehearsal(config) as rehearsal:
        try:
            return _simulate(config, run, rehearsal)
        except (SwarmError, TimeoutError) as e:
            return rehearsal.failed(e)


def _settled_view(observer: _Observer, run: RunConfig, steps: int, byzantine: set[str]):
    """The pipeline's records once every honest replica holds the last step and each stage's honest
    replicas one parameter hash, or after a bounded wait. A replica that fell out of the last stage round,
    or whose stage split into two groups at it (averaging timed out on a loaded machine), downloads its
    stage-mates' state like at any step; the check waits for that, not for a round that never comes: at
    most one averaging timeout, matchmaking, a catch-up's download and a few announcements."""
    settle_s = (
        run.training.averaging_timeout_s
        + run.training.matchmaking_time_s
        + 20 * run.pipeline.announce_interval_s
    )
    deadline = time.monotonic() + settle_s
    while True:
        view = observer.view()
        honest = [
            [r for r in view.replicas(k) if r.peer_id not in byzantine] for k in range(run.pipeline.stages)
        ]
        settled = all(
            all(r.step >= steps for r in replicas) and len({r.param_hash for r in replicas}) <= 1
            for replicas in honest
        )
        if settled or time.monotonic() > deadline:
            return view
        time.sleep(run.pipeline.announce_interval_s)


def _simulate(config: SimConfig, run: RunConfig, rehearsal: Rehearsal) -> int:
    local = rehearsal.local
    last_step = -1
    killed: list[dict] = []
    replaced: list[dict] = []
    print(f"swarm-sim: coordinator + {config.stages} stages x {config.peers_per_stage} servers + "
          f"{config.trainers} trainers, {config.steps} steps, model {config.model_size} (logs in {rehearsal.root})",
          flush=True)  # fmt: skip
    coordinator = local.start_coordinator(run)
    address = coordinator.extra["address"]
    mounts = pipeline_attackers(config)
    byzantine = list(mounts)

    def flags(name: str) -> list[str]:
        if name not in mounts:
            return []
        group = config.trainers if name.startswith("trainer") else config.peers_per_stage
        return ["--rehearse-attack", mounts[name], "--rehearse-attackers", str(config.byzantine),
                "--rehearse-group-size", str(max(2, group))]  # fmt: skip

    servers = {}
    for stage in range(config.stages):
        for replica in range(config.peers_per_stage):
            name = f"stage{stage}-{replica}"
            servers[name] = local.start_peer(
                address, name, "--role", "stage", "--stage", str(stage), *flags(name)
            )
    trainers = {f"trainer{i}": local.start_peer(address, f"trainer{i}", "--role", "trainer", *flags(f"trainer{i}"))
                for i in range(config.trainers)}  # fmt: skip
    if byzantine:
        print(f"attackers: {', '.join(f'{n} ({a})' for n, a in mounts.items())}", flush=True)
    honest = [n for n in trainers if n not in byzantine]  # the run's progress is theirs
    observer = _Observer(coordinator.extra["dht_initial_peers"], run)
    rehearsal.on_exit.append(observer.close)
    last_line = 0.0
    while True:
        snapshot = status_to_dict(status(address))
        rows = {p["name"]: p for p in snapshot["peers"]}
        rehearsal.check_children(
            {**servers, **trainers}, expected_gone={k["name"] for k in killed} | set(byzantine)
        )
        steps = [rows[n]["step"] for n in honest if n in rows]
        step = min(steps) if len(steps) == len(honest) else 0
        if step > last_step:  # a stall limit, not a wall-time one: on a busy 2-core machine the demo
            last_step = step  # model takes 30 s or more a step, and a run that keeps stepping is not stuck
            rehearsal.extend_deadline()
        if time.monotonic() - last_line > 5:
            rate = sum(rows[n]["metrics"].get("samples_per_s", 0.0) for n in trainers if n in rows)
            print(
                f"step {step}/{config.steps}  {rate:.1f} samples/s  {rehearsal.elapsed_s():.0f}s", flush=True
            )
            last_line = time.monotonic()
        # Mid-step, so that micro-batches are in flight through the victim when it dies.
        done = [rows[n]["metrics"].get("samples", 0.0) for n in honest if n in rows]
        mid_step = step > (config.kill_stage_peer_at or 0) or (done and min(done) > 0)
        if (
            config.kill_stage_peer_at is not None
            and not killed
            and step >= config.kill_stage_peer_at
            and mid_step
        ):
            last = config.stages - 1
            by_id = {p["peer_id"]: p["name"] for p in rows.values()}
            # A replica serving the last stage now: names say where a peer started, not where it is.
            serving = sorted(by_id.get(r.peer_id, "") for r in observer.view().replicas(last))
            victim = next((n for n in reversed(serving) if n in servers), None)
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(servers[victim].process.pid, signal.SIGKILL)
                killed.append({"name": victim, "stage": last, "at_step": step})
                print(f"killed {victim} (a replica of stage {last}) at step {step}", flush=True)
        if killed and not replaced:  # at once: a peer takes 20 s or more to start on a busy machine
            into = last if config.replace_into_stage is None else config.replace_into_stage
            name = f"stage{into}-{config.peers_per_stage}"
            servers[name] = local.start_peer(address, name, "--role", "stage", "--stage", str(into))
            replaced.append({"name": name, "stage": into, "at_step": step, "replaces": killed[0]["name"]})
            print(f"started {name} to replace {killed[0]['name']} in stage {into} at step {step}", flush=True)
        finished = [rows[n]["metrics"].get("finished", 0.0) == 1.0 for n in honest if n in rows]
        if len(finished) == len(honest) and all(finished):
            break
        rehearsal.check_deadline(
            f"the run made no step for {config.timeout_s:.0f}s (stuck at step {step} of {config.steps})"
        )
        time.sleep(1.0)
    duration = rehearsal.elapsed_s()
    time.sleep(2 * run.membership.heartbeat_interval_s)  # the trainers' final metrics reach the record
    rows = {p["name"]: p for p in status_to_dict(status(address))["peers"]}
    by_id = {p["peer_id"]: p["name"] for p in rows.values()}
    view = _settled_view(observer, run, config.steps, {rows[n]["peer_id"] for n in byzantine if n in rows})
    stages = []
    for stage in range(config.stages):
        replicas = [{"name": by_id.get(r.peer_id, "?"), "peer_id": r.peer_id, "step": r.step,
                     "param_hash": r.param_hash, "state_hash": r.state_hash,
                     "byzantine": by_id.get(r.peer_id) in byzantine, "announced_samples_per_s": r.samples_per_s,
                     "microbatches_served": rows.get(by_id.get(r.peer_id), {}).get("metrics", {}).get(
                         "microbatches_served", math.nan)}
                    for r in sorted(view.replicas(stage), key=lambda r: by_id.get(r.peer_id, ""))]  # fmt: skip
        stages.append({"stage": stage, "replicas": replicas})
    trainer_rows = [{"name": n, "peer_id": rows[n]["peer_id"], **{k: rows[n]["metrics"].get(k, math.nan) for k in (
        "step", "samples_per_s", "microbatches_issued", "microbatches_completed", "microbatches_lost",
        "microbatches_waiting", "retries", "val_loss", "val_loss_initial", "stage_checks", "stage_mismatches")}}
        for n in trainers]  # fmt: skip
    for name in [*servers, *trainers]:
        (servers.get(name) or trainers[name]).signal(signal.SIGTERM)
    honest = [[r for r in s["replicas"] if not r["byzantine"]] for s in stages]
    agree = all(
        len(replicas) >= 1
        and len({r["param_hash"] for r in replicas}) == 1
        and all(r["step"] == config.steps for r in replicas)
        for replicas in honest
    )
    honest_trainers = [t for t in trainer_rows if t["name"] not in byzantine]
    lost = int(sum(t["microbatches_lost"] for t in honest_trainers))
    left_over = int(sum(t["microbatches_waiting"] for t in honest_trainers))
    moves = {n: int(rows[n]["metrics"].get("moves", 0)) for n in servers if n in rows}
    initial, final = honest_trainers[0]["val_loss_initial"], honest_trainers[0]["val_loss"]
    result = {
        "initial_val_loss": initial,
        "final_val_loss": final,
        "steps": config.steps,
        "stages": stages,
        "stages_agree": agree,
        "lost_microbatches": lost,
        "left_over_microbatches": left_over,
        "samples_per_s": sum(t["samples_per_s"] for t in trainer_rows),
        "trainers": trainer_rows,
        "killed": killed,
        "replaced": replaced,
        "moves": moves,
        "duration_s": duration,
        "attack": config.attack,
        "byzantine": byzantine,
        # Banned replicas' records are ignored, so they are missing from ``stages``: read the coordinator's.
        "banned": sorted(n for n in rows if rows[n].get("state") == "banned"),
    }
    line = (f"validation loss {initial:.4f} -> {final:.4f} over {config.steps} steps in {duration:.0f}s; "
            f"{result['samples_per_s']:.1f} samples/s; {lost} micro-batches lost ({left_over} left over at the last step); "
            f"{sum(moves.values())} moves; the honest replicas of every stage {'hold identical parameters' if agree else 'DISAGREE'}")  # fmt: skip
    return rehearsal.finish(result, final < initial and lost == 0 and agree, line)
