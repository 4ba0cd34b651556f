"""The attack library: each attack lies exactly where it says it does, the same way for the same seed."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Iterator

import pytest
import torch
from helpers import KEYS, start_dhts

from lab.localswarm import tiny_run
from protocols.errors import ConfigError
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.hooks import RoundHooks
from swarm.byzantine import attack_names, attack_options, make_attack
from swarm.byzantine.attacks import alie_z
from swarm.byzantine.colluders import exact_gradients, honest_gradients
from swarm.pipeline.hooks import PipelineHooks
from swarm.training.diloco import flat_params
from swarm.training.hooks import TrainingHooks
from swarm.training.progress import PeerProgress
from swarm.training.state import flat_mean_gradient
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(60)

ALL = ["alie", "bad_reducer", "delayed_gradient", "huge_weight", "ipm", "label_flip", "nan", "random_direction", "sign_flip", "step_liar"]  # fmt: skip
HOOKS = ("batch", "contribution", "weight", "reduce", "entry")
# The hooks at which each attack lies; at every other hook it is honest.
LIES_AT = {
    "sign_flip": {"contribution"},
    "random_direction": {"contribution"},
    "label_flip": {"batch"},
    "delayed_gradient": {"contribution"},
    "alie": {"contribution"},
    "ipm": {"contribution"},
    "nan": {"contribution"},
    "huge_weight": {"contribution", "weight"},
    "bad_reducer": {"reduce"},
    "step_liar": {"entry"},
}


def _gradient(step: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(100 + step))


def _hooks_changed(name: str) -> set[str]:
    """Which hooks return something other than their input, over a few steps."""
    attack = make_attack(name, group_size=8, attackers=3, seed=5)
    changed = set()
    inputs, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    new_inputs, new_targets = attack.batch(inputs, targets)
    if not (torch.equal(new_inputs, inputs) and torch.equal(new_targets, targets)):
        changed.add("batch")
    for step in range(12):
        honest = _gradient(step)
        sent = attack.contribution(honest.clone(), step)
        if sent.shape != honest.shape or not torch.equal(sent, honest):
            changed.add("contribution")
    if attack.weight(16.0) != 16.0:
        changed.add("weight")
    aggregate = _gradient(99)
    if not torch.equal(attack.reduce(aggregate.clone()), aggregate):
        changed.add("reduce")
    extra = {"step": 7, "state_hash": "ab" * 32}
    if attack.entry(dict(extra)) != extra:
        changed.add("entry")
    return changed


def test_every_issue_attack_is_registered():
    assert set(ALL) <= set(attack_names())


@pytest.mark.parametrize("name", ALL)
def test_each_attack_lies_exactly_where_it_says(name: str):
    assert _hooks_changed(name) == LIES_AT[name]


@pytest.mark.parametrize("name", ALL)
def test_attacks_replay_exactly_for_the_same_seed(name: str):
    def run(seed: int) -> list[torch.Tensor]:
        attack = make_attack(name, group_size=8, attackers=3, seed=seed)
        return [attack.contribution(_gradient(s), s) for s in range(4)] + [attack.reduce(_gradient(9))]

    first, again = run(1), run(1)
    assert all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(first, again, strict=True)
    )
    if name == "random_direction":
        assert not torch.equal(run(1)[0], run(2)[0])


def test_sign_flip_and_huge_weight():
    honest = _gradient(0)
    assert torch.equal(
        make_attack("sign_flip", {"scale": 4}, group_size=4, attackers=1).contribution(honest, 0), -4 * honest
    )
    huge = make_attack("huge_weight", {"weight": 1e9}, group_size=4, attackers=1)
    assert huge.weight(3.0) == 1e9 and torch.equal(huge.contribution(honest, 0), -honest)
    assert torch.equal(make_attack("huge_weight", {"flip_sign": False}, group_size=4, attackers=1).contribution(honest, 0), honest)  # fmt: skip


def test_random_direction_has_the_asked_norm_and_no_relation_to_the_gradient():
    honest = _gradient(0)
    sent = make_attack("random_direction", {"norm_ratio": 3.0}, group_size=4, attackers=1).contribution(
        honest, 0
    )
    assert float(sent.norm()) == pytest.approx(3.0 * float(honest.norm()), rel=1e-5)
    cosine = float(torch.nn.functional.cosine_similarity(sent, honest, dim=0))
    assert abs(cosine) < 0.5


def test_label_flip_flips_class_targets_and_keeps_inputs_and_padding():
    attack = make_attack("label_flip", {"num_classes": 10}, group_size=4, attackers=1)
    inputs = torch.arange(6)
    targets = torch.tensor([0, 1, 9, 4, -100, 12])
    new_inputs, new_targets = attack.batch(inputs, targets)
    assert new_inputs is inputs
    assert new_targets.tolist() == [9, 8, 0, 5, -100, 12]
    with pytest.raises(ConfigError, match="integer class targets"):
        attack.batch(inputs, torch.zeros(6))


def test_delayed_gradient_sends_the_gradient_of_delay_steps_ago():
    attack = make_attack("delayed_gradient", {"delay": 3}, group_size=4, attackers=1)
    sent = [attack.contribution(_gradient(step), step) for step in range(8)]
    # Until it has a gradient that old it sends its oldest one, then always the one from 3 steps back.
    assert all(torch.equal(sent[s], _gradient(0)) for s in range(4))
    assert all(torch.equal(sent[s], _gradient(s - 3)) for s in range(4, 8))
    assert len(attack.history.by_step) <= 4  # bounded memory


def test_alie_uses_the_published_z_and_the_colluders_statistics():
    # z_max = Phi^-1((n - s) / n) with s = floor(n/2 + 1) - f.
    assert alie_z(50, 24) == pytest.approx(statistics.NormalDist().inv_cdf(48 / 50))  # 1.75
    assert alie_z(8, 2) == pytest.approx(statistics.NormalDist().inv_cdf(5 / 8))
    assert alie_z(4, 1) == pytest.approx(0.0)
    peers = torch.stack([_gradient(s) for s in range(3)])
    attack = make_attack("alie", group_size=8, attackers=3, seed=0)
    sent = attack.contribution(peers[0], 0, peers=peers)
    expected = peers.mean(dim=0) + alie_z(8, 3) * peers.std(dim=0, correction=0)
    assert torch.allclose(sent, expected, atol=1e-6)
    # Alone, it estimates from its own recent honest gradients.
    alone = make_attack("alie", {"z": 1.0, "window": 2}, group_size=8, attackers=1)
    alone.contribution(_gradient(0), 0)
    own = torch.stack([_gradient(0), _gradient(1)])
    expected = own.mean(dim=0) + own.std(dim=0, correction=0)
    assert torch.allclose(alone.contribution(_gradient(1), 1), expected, atol=1e-6)


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    peers = torch.stack([_gradient(s) for s in range(3)])
    attack = make_attack("ipm", {"epsilon": 0.5}, group_size=8, attackers=3)
    sent = attack.contribution(peers[1], 0, peers=peers)
    assert torch.allclose(sent, -0.5 * peers.mean(dim=0), atol=1e-6)
    assert float(sent @ peers.mean(dim=0)) < 0


def test_nan_poisons_the_asked_fraction():
    honest = torch.ones(100)
    sent = make_attack("nan", {"fraction": 0.25}, group_size=4, attackers=1).contribution(honest, 0)
    assert int(sent.isnan().sum()) == 25 and torch.equal(sent[~sent.isnan()], torch.ones(75))
    assert torch.equal(honest, torch.ones(100)), "the honest gradient must not be modified in place"
    inf = make_attack("nan", {"value": "-inf"}, group_size=4, attackers=1).contribution(honest, 0)
    assert bool((inf == float("-inf")).all())


def test_bad_reducer_shifts_the_aggregate_by_its_rms():
    aggregate = torch.tensor([3.0, -4.0, 0.0, 0.0])  # RMS 2.5
    shifted = make_attack("bad_reducer", {"shift": 0.4}, group_size=4, attackers=1).reduce(aggregate)
    assert torch.allclose(shifted, aggregate + 1.0)


def test_bad_options_and_contexts_are_config_errors():
    with pytest.raises(ConfigError, match="field 'epsilon'"):
        attack_options("ipm", {"epsilon": -1})
    with pytest.raises(ConfigError, match="unknown attack 'krum_breaker'; available: alie"):
        make_attack("krum_breaker", group_size=4, attackers=1)
    with pytest.raises(ConfigError, match="attackers <= group_size"):
        make_attack("sign_flip", group_size=2, attackers=3)


@contextlib.contextmanager
def two_trainers(run) -> Iterator[list[Trainer]]:
    """Two honest trainers of ``run`` on their own DHT nodes (one thread each, so replays are exact)."""
    dhts = start_dhts(2)
    try:
        torch.set_num_threads(1)
        yield [
            Trainer(run, d, peer_id=d.peer_id.to_base58(), signing_key=KEYS[d.peer_id.to_base58()])
            for d in dhts
        ]
    finally:
        for d in dhts:
            d.shutdown()


@pytest.mark.timeout(120)
def test_an_attacker_recomputes_every_honest_peers_exact_gradient_from_public_seeds():
    """Batches derive from public seeds: the omniscient colluders' view is the honest peers' real gradients,
    bit for bit, and what omniscient_alie sends sits at their true mean + z * std."""
    with two_trainers(tiny_run("colluders")) as honest:
        run = honest[0].peer.config
        for trainer, micro_batches in zip(honest, (3, 2), strict=True):
            for _ in range(micro_batches):
                trainer._micro_step()
        peers = [t.peer for t in honest]
        sent = {p.peer_id: flat_mean_gradient(p.params, p.samples) for p in peers}
        before = [p.grad.clone() for p in peers[0].params]
        rows = honest_gradients(
            peers[0].model, honest[0].dataset, run_id=run.run_id, step=0,
            micro_batch=run.training.micro_batch_size, seq_len=peers[0].seq_len,
            peers={p.peer_id: p.samples for p in peers},
        )  # fmt: skip
        assert rows is not None and rows.shape[0] == 2
        for row, peer_id in zip(rows, sorted(sent), strict=True):
            assert torch.equal(row, sent[peer_id]), "the recomputed gradient is the honest peer's, exactly"
        assert all(torch.equal(p.grad, g) for p, g in zip(peers[0].params, before, strict=True))
        # The peer's hook: its own honest gradient, then each peer its verified view shows at this step (the
        # batches drawn from the run's public dataset, as any attacker can).
        other = peers[1]
        peers[0].view = {other.peer_id: PeerProgress(other.peer_id, 0, other.samples, 1.0, "h", 0.0)}
        seen = exact_gradients(peers[0], sent[peers[0].peer_id])
        assert torch.equal(seen, torch.stack([sent[peers[0].peer_id], sent[other.peer_id]]))
        attack = make_attack("omniscient_alie", group_size=5, attackers=2)
        assert attack.omniscient and not make_attack("alie", group_size=5, attackers=2).omniscient
        lie = attack.contribution(rows[0], 0, peers=rows)
        expected = rows.mean(dim=0) + alie_z(5, 2) * rows.std(dim=0, correction=0)
        assert torch.allclose(lie, expected)


@pytest.mark.timeout(120)
def test_an_attacker_replays_every_honest_peers_diloco_window_bit_for_bit_across_outer_steps():
    """In diloco a peer's pseudo-gradient also depends on its inner optimizer's state, which only its own
    earlier windows made: the omniscient attacker keeps a shadow of each peer and replays each window from
    the public seeds, so the second window (whose inner optimizer state the first one left) is exact too."""
    with two_trainers(tiny_run("colluders-diloco", sync="diloco", inner_steps=3)) as trainers:
        attacker, honest = (t.peer for t in trainers)
        attack = make_attack("omniscient_ipm", group_size=2, attackers=1)
        for step, micro_batches in enumerate((3, 4)):
            for trainer, count in zip(trainers, (3, micro_batches), strict=True):
                for _ in range(count):
                    trainer._micro_step()
            sent = honest.strategy.contribution(honest.samples)
            own = attacker.strategy.contribution(attacker.samples)
            attacker.view = {
                honest.peer_id: PeerProgress(honest.peer_id, step, honest.samples, 1.0, "h", 0.0)
            }
            lie = attack.contribute(attacker, own)
            # The same window replayed again (a round retried at the same step) starts where it started.
            rows = attack._shadows.pseudo_gradients(attacker, own)
            assert torch.equal(rows[1], sent), f"the replayed window of outer step {step} is the honest one"
            assert torch.allclose(lie, -attack.options.epsilon * (own + sent) / 2)
            averaged = (own + sent) / 2
            for peer in (attacker, honest):  # the outer step, as a peer takes a round's result
                peer._apply_round(RoundResult(averaged, complete=True))
                asyncio.run(peer.synced.commit(step + 1))
            assert torch.equal(
                flat_params(attacker.strategy.replica.synced_params),
                flat_params(honest.strategy.replica.synced_params),
            )


def test_every_attack_is_the_librarys_three_hooks_and_turns_on_only_its_own_flags():
    """An attack plugs in as a peer's TrainingHooks, RoundHooks and PipelineHooks at once (its round hooks
    are itself). The library skips a hook whose flag is off, so an attack that lies there without its flag
    would silently be honest: each flag is on for exactly the attacks that need it."""
    attacks = {name: make_attack(name, group_size=4, attackers=1) for name in attack_names()}
    for name, attack in attacks.items():
        assert isinstance(attack, TrainingHooks) and isinstance(attack, RoundHooks), name
        assert isinstance(attack, PipelineHooks) and attack.round_hooks is attack, name

    def flagged(flag: str) -> set[str]:
        return {name for name, attack in attacks.items() if getattr(attack, flag)}

    assert flagged("rewrites_aggregates") == {"bad_reducer", "draw_aware_reducer", "refusing_reducer"}
    assert flagged("withholds_aggregates") == {"withholder"}
    assert flagged("refuses_inputs") == {"refusing_reducer"}
    assert flagged("denies_rounds") == {"denier"}
    assert flagged("hears_microbatches") == {"forged_retried"}
    assert flagged("front_runs") == {"front_runner"}
    honest, gradient = TrainingHooks(), _gradient(0)
    assert honest.contribute(None, gradient) is gradient and honest.weight(16.0) == 16.0
    assert honest.entry({"step": 3}) == {"step": 3}
    assert not honest.omniscient and honest.round_hooks.frame(object(), None) is None


def test_diloco_with_outer_overlap_refuses_an_omniscient_attack_and_names_it():
    """The omniscient attacker replays each peer's window as it closes; with outer_overlap a peer sends a
    window frozen one round earlier, which it does not replay."""
    run = tiny_run("diloco", sync="diloco", inner_steps=2, outer_overlap=True)
    attack = make_attack("omniscient_alie", group_size=5, attackers=2)
    with pytest.raises(ConfigError, match="'omniscient_alie' is not rehearsed with outer_overlap"):
        Trainer(run, None, peer_id="peer", hooks=attack)


def test_orthogonal_bias_pushes_every_step_along_one_direction_orthogonal_to_the_honest_vector():
    """The time-coupled attack: what it adds is orthogonal to the honest vector, ``scale`` times its norm,
    and points the same way at every step and for every colluder (so outer momentum adds it up)."""
    colluders = [
        make_attack("orthogonal_bias", {"scale": 0.5}, group_size=5, attackers=2, seed=i) for i in range(2)
    ]
    generator = torch.Generator().manual_seed(3)
    pushes = []
    for step, attack in enumerate([*colluders, colluders[0]]):
        honest = torch.randn(4096, generator=generator)
        push = attack.contribution(honest, step) - honest
        assert abs(float(torch.dot(push, honest))) < 1e-3 * float(honest.norm() * push.norm())
        assert float(push.norm()) == pytest.approx(0.5 * float(honest.norm()), rel=1e-4)
        pushes.append(push / push.norm())
    assert all(float(torch.dot(pushes[0], p)) > 0.9 for p in pushes[1:]), "one shared direction"
