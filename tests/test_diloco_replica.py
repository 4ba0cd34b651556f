"""DiLoCo's arithmetic in one process (``DilocoReplica``): what a replica sends, how an outer step lands,
what the wire leaves out, and how an overlapped window moves onto the synced copy."""

from __future__ import annotations

import torch

from lab.localswarm import tiny_run
from swarm.models import build_model
from swarm.training.diloco import DilocoReplica, flat_params
from swarm.training.state import build_optimizer, state_hash, state_tensors


def _replica(**training) -> DilocoReplica:
    run = tiny_run("replica", sync="diloco", inner_steps=3, **training)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    return DilocoReplica(model, build_optimizer(model, run.optimizer), run)


def _train(replica: DilocoReplica, seed: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randint(0, 256, (4, 32), generator=generator)
        replica.model.loss(inputs[:, :-1], inputs[:, 1:]).backward()
        replica.inner_step(0, 4, mean=True)


def _synced_hash(replica: DilocoReplica) -> str:
    return state_hash(1, state_tensors(replica.synced_model, replica.synced_optimizer))


def test_replicas_on_other_data_step_their_synced_copies_to_the_same_bits() -> None:
    a, b = _replica(), _replica()
    _train(a, seed=1, steps=3)
    _train(b, seed=2, steps=3)
    sent_a, sent_b = a.contribution(), b.contribution()
    assert not torch.equal(sent_a, sent_b), "other data, other pseudo-gradients"
    # The pseudo-gradient is how far the window moved the local copy from the synced one.
    assert torch.equal(sent_a, flat_params(a.synced_params) - flat_params(a.params))
    averaged = (sent_a + sent_b) / 2
    a.apply(averaged)
    b.apply(averaged)
    assert _synced_hash(a) == _synced_hash(b)
    # A new window starts from the synced copy, with no inner step taken.
    assert a.inner == 0 and torch.equal(flat_params(a.params), flat_params(a.synced_params))


def test_a_sparse_codec_keeps_what_the_wire_left_out_and_adds_it_decayed_to_the_next_window() -> None:
    replica = _replica(compression="topk", topk_feedback_decay=0.5)
    _train(replica, seed=1, steps=3)
    pseudo = replica.contribution()
    sent = torch.where(pseudo.abs() >= pseudo.abs().median(), pseudo, torch.zeros_like(pseudo))
    replica.apply(sent, sent)
    assert torch.equal(replica.residual, pseudo - sent)
    _train(replica, seed=2, steps=3)
    own = flat_params(replica.synced_params) - flat_params(replica.params)
    assert torch.allclose(replica.contribution(), own + 0.5 * (pseudo - sent))


def test_an_overlapped_window_lands_one_window_late_and_keeps_the_newest_local_progress() -> None:
    replica = _replica(outer_overlap=True)
    _train(replica, seed=1, steps=3)
    replica.close_window(samples=12)
    first = replica.contribution().clone()
    assert replica.weight(samples=0) == 12.0 and replica.inner == 0
    _train(replica, seed=2, steps=3)  # the next window computes while the first one's round runs
    progress = replica.window_start - flat_params(replica.params)
    replica.apply(first / 2)  # that round's result lands
    replica.close_window(samples=12)
    # The local copy is the new synced copy less this window's own progress; that progress is sent next.
    assert torch.allclose(flat_params(replica.params), flat_params(replica.synced_params) - progress)
    assert torch.allclose(replica.contribution(), progress)


def test_a_failed_overlapped_round_sends_its_window_again_with_the_next() -> None:
    replica = _replica(outer_overlap=True)
    _train(replica, seed=1, steps=3)
    replica.close_window(samples=12)
    first = replica.contribution().clone()
    _train(replica, seed=2, steps=3)
    second = replica.window_start - flat_params(replica.params)
    replica.close_window(samples=12)  # no result landed in between
    assert torch.allclose(replica.contribution(), first + second)
    assert replica.weight(samples=0) == 24.0
