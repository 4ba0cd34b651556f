"""Collaborative training: the state every peer holds bit for bit, how it is saved, shared and advanced.

- state.py: optimizer and learning-rate schedule from ``OptimizerConfig``; the flat ``name -> tensor``
  state of model plus optimizer, its hashes, and its safetensors encoding for peers that join late
- checkpoint.py: atomic on-disk checkpoints with the run config, newest-first loading that skips damaged files
- progress.py: who is at which step with how many samples, shared through the DHT, and whether a
  groupmate's signed step fits this peer's round (``step_misfit``)
- readiness.py: how much of the samples others claim at its step an every_step peer counts toward the
  target batch: as far as its last round showed their work (``counted_claims``)
- catchup.py: the one catch-up rule: when a holder of state must move to another state, and from whom
- sync.py: downloading the full state from another peer, verified against the agreed hash
- optimizers.py: LAMB and LARS, the layer-wise adaptive optimizers for large global batches
- precision.py: autocast for ``training.precision`` (fp32, bf16, fp16) and fp16's deterministic loss scale
- memory.py: a peer's peak memory (GPU or RSS) and recognizing out-of-memory errors
- microbatch.py: one micro-batch's forward and backward: precision, checkpointing, shrinking when out of memory
- peer.py: ``TrainingPeer``, one data-parallel peer whoever computes its gradients: takes micro-batch
  gradients, averages them with a group, steps, catches up; every loop drives one
- trainer.py: the built-in loop (``Trainer``): the run's own data through a ``TrainingPeer``
- strategies.py: what a sync mode decides for the peer (``EveryStepSync``; diloco's in diloco.py)
- tiered.py: ``SecondTier``, what every group of a step applies when a step has more peers than a group
- witness.py: the applied rounds a peer's heartbeats show the coordinator, whose members it credits
- collaboration.py: ``Collaboration``: a ``TrainingPeer`` driven by the researcher's own loop
  (``collab.step`` after each backward), with the ``EveryStep`` and ``DiLoCo`` strategies
- hf.py: ``SwarmCallback``, with which a Hugging Face ``Trainer`` script joins a run (the ``[hf]`` extra)
- ownmodel.py: the checks on a model and optimizer the researcher built: the run's tensors, the run's
  optimizer on single-tensor kernels
- synced.py: ``SyncedState``, the state every peer holds bit for bit: its step, hashes, encoding, commit and load
- resync.py: ``CatchUp``, the peer's state serving and catch-up: download the agreed state, or the
  coordinator's checkpoint
- diloco.py: DiLoCo (``DilocoSync``): inner steps on the local copy, averaged pseudo-gradients, the
  outer optimizer
- hooks.py: ``TrainingHooks``, what the peer trains on, sends and claims (honest; rehearsed attacks override)
- replay.py: a peer's gradient replayed from public facts (the state at a step, the dataset, its batch seeds)
- contribution.py: a sender's contribution recomputed and compared, and the ``wrong_contribution``
  evidence of a lie
- picks.py: whom a round replays (drawn, standing out, fitting its own batch poorly) and which signed
  sample counts the built-in loop never signs
- sendercheck.py: ``SenderChecks``: a drawn validator (or one that saw a sender stand out) replays a
  groupmate's contribution and files the lie
- fitbudget.py: ``FitBudget``: what fits of a sender, and the replays they point to, may cost a member
- filings.py: ``Accusations``: the lies one validator files, one at a time, with the states they were
  found on (bounded)

Only the names of state.py and checkpoint.py are re-exported here (they need no hivemind).

Low-level surface: names may change while the training loop is built on it.

Example::

    from swarm.training import build_optimizer, state_tensors, state_hash
    optimizer = build_optimizer(model, run.optimizer)
    print(state_hash(step, state_tensors(model, optimizer)))
"""

from swarm.training.checkpoint import (
    Checkpoint,
    CorruptCheckpoint,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from swarm.training.state import (
    DecodedState,
    build_optimizer,
    clip_gradients,
    decode_state,
    encode_state,
    ensure_optimizer_state,
    learning_rate,
    load_state_tensors,
    params_hash,
    set_learning_rate,
    state_hash,
    state_tensors,
)

__all__ = [
    "Checkpoint",
    "CorruptCheckpoint",
    "DecodedState",
    "build_optimizer",
    "checkpoint_name",
    "clip_gradients",
    "decode_state",
    "encode_state",
    "ensure_optimizer_state",
    "latest_checkpoint",
    "learning_rate",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_state_tensors",
    "params_hash",
    "save_checkpoint",
    "set_learning_rate",
    "state_hash",
    "state_tensors",
]
