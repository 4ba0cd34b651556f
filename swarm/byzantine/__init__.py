"""Misbehaving peers for rehearsal: what a Byzantine volunteer can send, as a library of named attacks.

Attacks plug into the library through its typed hooks, each owned by the layer that calls it:
``TrainingHooks`` (``swarm.training.hooks``: batch, contribution, claimed weight), ``RoundHooks``
(``swarm.averaging.hooks``: as reducer, validator and group leader) and ``PipelineHooks``
(``swarm.pipeline.hooks``: records, requests, stage replies). ``Attack`` implements all three; ``peer/`` and
``lab/`` pass one as the ``hooks`` of a trainer or stage worker. No library module imports this package
(``tests/test_layering.py`` checks it).

- ``attacks``: ``Attack`` (honest at every hook) and the registry of named attacks (``sign_flip``,
  ``alie``, ``ipm``, ... ``bad_reducer``)
- ``colluders``: what an attacker who reads the code knows: every peer's exact gradient from public seeds
- ``coupled``: time-coupled attacks (``orthogonal_bias``): the same small push every step, which outer
  momentum and error feedback add up; registered with the others
- ``group_attacks``: attacks on the averaging group by a leader (``duplicate_member``,
  ``rewrite_commitments``), registered with the others
- ``pipeline_attacks``: attacks on the SWARM pipeline (``stage_throughput_lie``, ``stuck_in_flight``,
  ``forged_retried``, ``front_runner``), registered with the others
- ``protocol_attacks``: what an unadmitted process with a stock ``hivemind.DHT`` tries against the run's
  DHT and state servers (``swarm-sim --protocol-attack``)
- ``hostile``: the hostile-peer harness, the protocol attack that sends malformed, oversized, far-future
  and replayed inputs to every DHT key rule and libp2p handler the code has, registered with the others
- ``coordinator_sybils``: cheap identities against the coordinator (joins, credit, suspicions, stalled
  accusations, self-bans), the protocol attack ``swarm-sim`` mounts for it
- ``abuse``: attacks on the coordinator's endpoints (``stalled_accuser``, ``challenge_flood``), mounted
  against a live coordinator by ``tests/test_accuse_abuse.py``

These exist to test defenses (``swarm-sim --byzantine K --attack NAME``); an honest peer never builds one.
"""

from swarm.byzantine import coordinator_sybils as _coordinator_sybils  # noqa: F401 - registers it
from swarm.byzantine import coupled as _coupled  # noqa: F401 - registers the time-coupled attacks
from swarm.byzantine import group_attacks as _group_attacks  # noqa: F401 - registers the group attacks
from swarm.byzantine import hostile as _hostile  # noqa: F401 - registers the hostile-peer harness
from swarm.byzantine import pipeline_attacks as _pipeline_attacks  # noqa: F401 - registers the pipeline attacks
from swarm.byzantine.attacks import Attack, AttackContext, attack_names, attack_options, make_attack

__all__ = ["Attack", "AttackContext", "attack_names", "attack_options", "make_attack"]
