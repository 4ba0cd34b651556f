"""Misbehaving peers for rehearsal: what a Byzantine volunteer can send, as a library of named attacks.

- ``attacks``: ``Attack`` (hooks on the batch, the contribution, the claimed weight and, as reducer, the
  aggregate) and the registry of named attacks (``sign_flip``, ``alie``, ``ipm``, ... ``bad_reducer``)
- ``group_attacks``: attacks on the averaging group by a leader (``duplicate_member``,
  ``rewrite_commitments``), registered with the others
- ``pipeline_attacks``: attacks on the SWARM pipeline (``stage_throughput_lie``, ``stuck_in_flight``,
  ``forged_retried``, ``front_runner``), registered with the others
- ``protocol_attacks``: what an unadmitted process with a stock ``hivemind.DHT`` tries against the run's
  DHT and state servers (``swarm-sim --protocol-attack``)
- ``abuse``: attacks on the coordinator's endpoints (``stalled_accuser``, ``challenge_flood``), mounted
  against a live coordinator by ``tests/test_accuse_abuse.py``

These exist to test defenses (``swarm-sim --byzantine K --attack NAME``); an honest peer never builds one.
"""

from swarm.byzantine import group_attacks as _group_attacks  # noqa: F401 - registers the group attacks
from swarm.byzantine import pipeline_attacks as _pipeline_attacks  # noqa: F401 - registers the pipeline attacks
from swarm.byzantine.attacks import Attack, AttackContext, attack_names, attack_options, make_attack

__all__ = ["Attack", "AttackContext", "attack_names", "attack_options", "make_attack"]
