"""swarm: the core library and public Python API of the decentralized training network.

- ``config``: ``RunConfig``, the typed definition of a run, and its TOML form (no torch)
- ``components``: ``check_components``, the run's model, dataset, aggregator and pipeline split checked
  against the registries installed here
- ``identity``: persistent Ed25519 identities (signing key = libp2p peer ID)
- ``coordinator_client``: ``CoordinatorClient``, the coordinator's gRPC API from the peer side
- ``trust``: pinned coordinator keys (a run's coordinator key is trusted on first join, and no other)
- ``reachability``: whether other peers can dial this machine, learned at join from the coordinator
- ``session``: ``Session``, a peer's membership in a run: join, DHT, heartbeats, certificate renewal, leave
- ``connection``: ``swarm.connect``, a session for a synchronous program, in a ``with`` block
- ``training.collaboration``: ``session.collaborate(model)``: the researcher's own loop calls ``step``
  after each backward (strategies ``EveryStep``, ``DiLoCo``); ``describe_model`` declares a model that
  lives in the researcher's code to the run (``swarm.models.external``)
- ``membership``: verified peer certificates published in the DHT
- ``records``: signed DHT records, the one trust boundary for everything read from the run's DHT
- ``bans``: the coordinator-signed ban list, published in pages in the DHT and enforced by every peer
- ``standing``: the run's standing as a peer last heard it: each credited peer's samples, coordinator-signed
- ``keyspace``: every DHT key a run uses, each with its check (``RunValidator``); other keys are refused
- ``dht``: starting hivemind's DHT under a swarm identity
- ``journal``: a peer's round journal, one JSON line per round tried and state downloaded (no torch)
- ``dhtstorage``: ``BoundedStorage``, what a DHT node keeps for others, bounded in total and per signer
- ``hivemind_import``: hivemind imported once, with its one import-time torch warning filtered
- ``hf_import``: the optional Hugging Face extra, imported on first use and offline
- ``contract``: the model, model config and dataset protocols every run's components meet, and their checks
- ``registry``: named registries with typed configs (shared by models and datasets)
- ``models``: the model registry, the built-in byte-level ``gpt`` and ``hf-causal-lm``
- ``data``: the dataset registry (``stdlib``, ``text-files``, ``hf-dataset``) and deterministic per-peer
  sampling
- ``averaging``: robust butterfly all-reduce among a group of peers, signed and verified
- ``training``: one peer's training loop, the shared state, checkpoints (``load_model`` reads one into
  its model) and catching up
- ``pipeline``: SWARM pipeline parallelism: stage servers, stage workers and pipeline trainers
- ``byzantine``: named attacks for rehearsal (``swarm-sim --byzantine K --attack NAME``), plugged in through
  the hooks of ``training``, ``averaging`` and ``pipeline``; no other module of ``swarm`` imports it
- ``rpc``: how errors cross the gRPC boundary
- ``inbound``: ``BoundedServicer``, the size, stream and admission bounds of every libp2p handler
- ``ratelimit``: ``RateLimiter``, the token bucket behind a peer's ``--max-upload-mbps``
- ``cliargs``: CLI flags derived from typed configs
- ``runtime``: process entry helpers (uvloop, logging, signals, the fork server); only CLIs call them
- ``forkserver``: child processes (the DHT node's) forked from a copy of the process made before any thread
- ``procenv``: environment settings for gRPC that must precede its loading; only CLIs import it

Everything in ``protocols.errors`` is re-exported here. Names not listed in ``__all__`` are internal and
may change. Importing ``swarm`` does not import torch: the model and dataset names load on first use.

Example::

    import swarm
    run = swarm.RunConfig(run_id="my-run", model={"name": "gpt", "config": {"n_layer": 4}})
    run.to_toml("run.toml")
"""

from __future__ import annotations

import importlib
from typing import Any

from protocols.errors import (
    ConfigError,
    NetworkError,
    ProtocolError,
    SecurityError,
    SwarmError,
)

# Loaded on first use, so that ``import swarm`` (which every CLI's first import of a submodule runs) stays
# cheap: ``swarm-peer --help`` needs none of them.
_LAZY = {
    "AdmissionConfig": "swarm.config",
    "ComponentSpec": "swarm.config",
    "MembershipConfig": "swarm.config",
    "RunConfig": "swarm.config",
    "load_or_create_identity": "swarm.identity",
    "build_model": "swarm.models",
    "register_model": "swarm.models",
    "available_models": "swarm.models",
    "build_dataset": "swarm.data",
    "register_dataset": "swarm.data",
    "available_datasets": "swarm.data",
    "CoordinatorClient": "swarm.coordinator_client",
    "Session": "swarm.session",
    "SessionConfig": "swarm.session",
    "connect": "swarm.connection",
    "check_components": "swarm.components",
    "describe_model": "swarm.models",
    "Collaboration": "swarm.training.collaboration",
    "EveryStep": "swarm.training.collaboration",
    "DiLoCo": "swarm.training.collaboration",
    "load_model": "swarm.training.checkpoint",
}

__all__ = [
    "AdmissionConfig",
    "Collaboration",
    "ComponentSpec",
    "ConfigError",
    "CoordinatorClient",
    "DiLoCo",
    "EveryStep",
    "MembershipConfig",
    "NetworkError",
    "ProtocolError",
    "RunConfig",
    "SecurityError",
    "Session",
    "SessionConfig",
    "SwarmError",
    "available_datasets",
    "available_models",
    "build_dataset",
    "build_model",
    "check_components",
    "connect",
    "describe_model",
    "load_model",
    "load_or_create_identity",
    "register_dataset",
    "register_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
