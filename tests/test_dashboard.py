"""The coordinator's dashboard over a real 2-peer run: the JSON API, Prometheus metrics, bad paths,
no secrets, the page in a headless browser, and how reported contributions become durable credit."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.metrics import MetricsLogger, leaderboard
from coordinator.store import HistoryPoint, PeerRecord, Store
from lab.localswarm import Child, LocalSwarm, tiny_run, wait_until
from protocols.errors import ConfigError
from swarm.config import RunConfig
from swarm.identity import load_identity

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

JOIN_TOKEN = "dashboard-test-secret-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Run:
    swarm: LocalSwarm
    coordinator: Child
    peers: list[Child]
    url: str
    address: str
    data_dir: Path


def start_coordinator(swarm: LocalSwarm, run, *extra: str, name: str = "coordinator") -> tuple[Child, dict]:
    data_dir = swarm.root / f"{name}-data"
    child = swarm.spawn(
        name,
        ["-m", "coordinator.cli", "start", "--config", str(swarm.write_config(run, f"{name}.toml")),
         "--host", "127.0.0.1", "--port", "0", "--dht-port", "0", "--data-dir", str(data_dir),
         "--dashboard-port", "0", "--history-interval-s", "0.5", *extra],
    )  # fmt: skip
    endpoint = data_dir / "endpoint.json"

    def ready() -> dict | None:
        assert child.process.poll() is None, child.output()
        return json.loads(endpoint.read_text()) if endpoint.exists() else None

    return child, wait_until(ready, timeout_s=90, what="the coordinator to serve")


def get(url: str) -> tuple[int, str, str]:
    """Status, content type and body of a GET (error statuses included)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def api(run: Run) -> dict:
    return json.loads(get(run.url + "api/status")[2])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    swarm = LocalSwarm(tmp_path_factory.mktemp("dashboard"))
    try:
        spec = tiny_run("dashboard", max_steps=6).model_dump()
        config = RunConfig.model_validate(
            {**spec, "admission": {"policy": "token", "join_token": JOIN_TOKEN}}
        )
        coordinator, endpoint = start_coordinator(swarm, config)
        peers = [
            swarm.start_peer(
                endpoint["address"], f"peer{i}", "--join-token", JOIN_TOKEN, "--status-interval-s", "1"
            )
            for i in range(2)
        ]
        result = Run(swarm, coordinator, peers, endpoint["dashboard_url"], endpoint["address"],
                     swarm.root / "coordinator-data")  # fmt: skip

        def trained() -> bool:
            status = api(result)
            steps = [p["step"] for p in status["peers"] if p["state"] == "online"]
            return steps == [6, 6] and len(status["leaderboard"]) == 2 and status["history"][-1]["step"] == 6

        wait_until(trained, timeout_s=180, what="2 peers to train 6 steps")
        yield result
    finally:
        swarm.kill_all()


def test_api_status_reflects_the_two_peer_run(run: Run):
    status = api(run)
    assert status["run_id"] == "dashboard"
    # The dashboard labels steps as outer steps only for a diloco run.
    assert (status["run"]["sync"], status["run"]["inner_steps"]) == ("every_step", 1)
    peers = {p["name"]: p for p in status["peers"]}
    assert set(peers) == {"peer0", "peer1"}
    for child in run.peers:
        peer = peers[child.name]
        assert peer["peer_id"] == load_identity(child.extra["identity"]).peer_id
        assert peer["state"] == "online" and not peer["paused"]
        assert peer["role"] == "data" and peer["device"].startswith("cpu")
        assert peer["step"] == 6
        # Credit: the samples each put into the 6 applied rounds, at most a full batch (plus one
        # micro-batch of overshoot) per step, and nothing refused for an honest peer.
        assert 0 < peer["contributed_samples"] <= 6 * (32 + 4)
        assert peer["credit_refused"] == 0
        assert peer["metrics"]["train_loss"] < 6
        assert peer["metrics"]["peak_memory_bytes"] > 50 * 2**20, (
            "a CPU peer's peak RSS: torch alone holds more"
        )
    assert status["contributed_samples"] == sum(p["contributed_samples"] for p in status["peers"])
    board = status["leaderboard"]
    assert [e["rank"] for e in board] == [1, 2]
    assert board[0]["contributed_samples"] >= board[1]["contributed_samples"]
    assert abs(sum(e["share"] for e in board) - 1.0) < 1e-9
    # The history the loss plot draws: the loss fell, both peers were online, the step advanced.
    history = status["history"]
    losses = [p["train_loss"] for p in history if p["train_loss"] is not None]
    assert len(losses) >= 2 and min(losses) < losses[0]
    assert max(p["peers_online"] for p in history) == 2
    assert history[-1]["step"] == 6 and any(p["val_loss"] is not None for p in history)
    assert status["bans"] == []
    # Without a terminal, the volunteer's panel becomes a plain status line in its log.
    assert re.search(r"state: online \| step: \d+ \| samples/s \(local\): [\d,.]+ \| my contribution: [\d,]+ samples",
                     run.peers[0].output())  # fmt: skip


def test_metrics_expose_swarm_metrics_for_prometheus(run: Run):
    code, content_type, body = get(run.url + "metrics")
    assert code == 200 and content_type.startswith("text/plain")
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert samples and all(line.startswith("swarm_") for line in samples), samples
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in samples}
    assert values["swarm_step"] == 6
    assert values['swarm_peers{state="online"}'] == 2
    assert values["swarm_contributed_samples_total"] > 0
    credited = [k for k in values if k.startswith("swarm_peer_contributed_samples_total{")]
    assert len(credited) == 2 and all(values[k] > 0 for k in credited)
    assert 'run_id="dashboard"' in body


def test_unknown_paths_get_json_errors_and_no_secret_is_served(run: Run):
    for path in ("api/nope", "api/status/extra", "static/../coordinator-data/identity.key", "admin"):
        code, content_type, body = get(run.url + path)
        assert code == 404 and content_type.startswith("application/json"), (path, code)
        assert json.loads(body)["error"].startswith("no such page")
    request = urllib.request.Request(run.url + "api/status", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405 and "use GET" in json.loads(refused.value.read())["error"]

    served = "".join(
        get(run.url + path)[2]
        for path in ("", "static/dashboard.js", "static/dashboard.css", "api/status", "metrics")
    )
    assert JOIN_TOKEN not in served, "the join token must never be served"
    for key_file in [run.data_dir / "identity.key"] + [p.extra["identity"] for p in run.peers]:
        seed = key_file.read_bytes()[4:36]  # libp2p's Ed25519 key file: a 4-byte header, then the seed
        assert seed.hex() not in served and seed.hex().upper() not in served


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (apt-get install chromium); .ci/run installs it"
)
def test_the_page_renders_live_peers_and_the_loss_plot_in_a_browser(run: Run, tmp_path: Path):
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--window-size=1400,1250", "--virtual-time-budget=6000",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run([*flags, "--dump-dom", run.url], capture_output=True, text=True, timeout=120).stdout
    assert 'data-loaded="1"' in dom, "the page fetched /api/status and rendered it"
    for child in run.peers:
        peer_id = load_identity(child.extra["identity"]).peer_id
        assert re.search(rf'<tr data-peer-id="{peer_id}" data-state="online">\s*<td>{child.name}</td>', dom)
    train = re.search(r'<path d="(M[^"]+)" class="line train" data-series="train" data-count="(\d+)"', dom)
    assert train and int(train.group(2)) >= 2, "the loss plot draws the training loss over time"
    assert train.group(1).count("L") == int(train.group(2)) - 1
    assert re.search(r'id="kpi-step">6<', dom) and re.search(r'id="kpi-peers">2<', dom)

    shot = tmp_path / "dashboard.png"
    subprocess.run([*flags, f"--screenshot={shot}", run.url], capture_output=True, timeout=120)
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000, "a screenshot of a rendered page"


def test_a_ban_shows_with_its_reason(run: Run):
    rogue = run.peers[1]
    peer_id = load_identity(rogue.extra["identity"]).peer_id
    subprocess.run(
        ["swarm-coordinator", "ban", peer_id, "--data-dir", str(run.data_dir), "--reason", "sent NaN gradients"],
        check=True, capture_output=True, timeout=30, env=run.swarm.env,
    )  # fmt: skip
    status = api(run)
    assert [(b["peer_id"], b["name"], b["reason"]) for b in status["bans"]] == [
        (peer_id, "peer1", "sent NaN gradients")
    ]
    assert {p["name"]: p["state"] for p in status["peers"]}["peer1"] == "banned"
    assert "swarm_bans 1.0" in get(run.url + "metrics")[2]


def test_reported_contributions_become_durable_credit(tmp_path: Path):
    """How a pipeline peer's cumulative counter is merged (data-parallel peers are credited from the rounds
    other members witnessed instead: tests/test_store.py): growth counts, a restart (a lower value) starts
    a new count, credit never falls, and claims beyond one share of a round per step advanced are refused
    (with two peers at the state: twice the batch over two, one batch)."""

    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "credit", max_samples_per_step=32)
        seq = iter(range(1, 100))

        async def beat(step: int, reported: float) -> float:
            # A second peer at the same step with the same parameters makes the step verified.
            agreed = f"{step:064x}"
            for peer_id, metrics in (("q", {}), ("p", {"contributed_samples": reported})):
                n = next(seq)  # a minute apart: slower than the verified step's rate limit
                await store.record_heartbeat(
                    peer_id, seq=n, seen_at=60.0 * n, metrics=metrics, step=step, param_hash=agreed
                )
            return (await store.get_peer("p")).contributed_samples

        for peer_id in ("p", "q"):
            await store.admit(
                PeerRecord(peer_id, b"k", peer_id, "cpu", "stage", "online", 0.0, 0.0, 0, 1, 1e12)
            )
        try:
            assert await beat(0, 0) == 0  # the baseline
            assert await beat(2, 60) == 60  # two rounds
            assert await beat(2, 60) == 60  # paused: nothing new
            assert await beat(3, 20) == 80, "a restarted trainer counts from 0 again; credit does not fall"
            assert await beat(3, 10_000) == 80, "no step advanced: nothing more can be credited"
            assert await beat(4, 10_100) == 112, "one step advanced: at most one share (2 x 32 / 2 peers)"
            assert (await store.credit_refused())["p"] == 10_000 - 20 + (100 - 32)
            # A replayed heartbeat (old sequence number) changes nothing.
            assert not await store.record_heartbeat(
                "p", seq=1, seen_at=0.0, metrics={"contributed_samples": 1e9}, step=99, param_hash=""
            )
            assert (await store.get_peer("p")).contributed_samples == 112
        finally:
            store.close()
        reopened = Store.open_sync(tmp_path / "c.db", "credit", max_samples_per_step=32)
        try:
            assert (await reopened.get_peer("p")).contributed_samples == 112, "credit survives a restart"
        finally:
            reopened.close()

    asyncio.run(scenario())


def test_history_goes_to_tensorboard_when_asked(tmp_path: Path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger("tensorboard", tmp_path, "tb-run")
    for step, loss in ((1, 5.0), (2, 4.5), (3, 4.1)):
        logger.log(HistoryPoint(t=1000.0 + step, step=step, train_loss=loss, val_loss=None, samples_per_s=10.0,
                                peers_online=2))  # fmt: skip
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb-run"))
    events.Reload()
    scalars = events.Scalars("run/train_loss")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert [e.value for e in scalars] == pytest.approx([5.0, 4.5, 4.1])  # stored as float32
    assert [e.value for e in events.Scalars("run/peers_online")] == [2.0, 2.0, 2.0]
    assert "run/val_loss" not in events.Tags()["scalars"], "an unknown loss is not logged as a number"


def test_logging_to_a_package_that_is_not_installed_says_what_to_install(tmp_path: Path):
    missing = [kind for kind in ("wandb", "tensorboard") if importlib.util.find_spec(kind) is None]
    if not missing:
        pytest.skip("both wandb and tensorboard are installed here")
    with pytest.raises(
        ConfigError, match=f"--log-to {missing[0]} needs the {missing[0]} package: pip install"
    ):
        MetricsLogger(missing[0], tmp_path, "run")


def test_a_banned_peer_is_left_out_of_the_leaderboard():
    def record(peer_id: str, state: str, samples: float) -> PeerRecord:
        return PeerRecord(
            peer_id=peer_id, public_key=b"", name=peer_id, device="cpu", role="data", state=state, joined_at=0.0,
            last_seen=0.0, last_seq=0, cert_serial=1, cert_expires_at=1e12, contributed_samples=samples,
        )  # fmt: skip

    board = leaderboard(
        [record("sybil", "banned", 900.0), record("honest", "online", 300.0), record("left", "left", 100.0)]
    )
    assert [(e["rank"], e["name"]) for e in board] == [(1, "honest"), (2, "left")]
    assert [e["share"] for e in board] == [0.75, 0.25]
