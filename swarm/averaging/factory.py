"""The one way to build an ``Averager`` from the run config, for every role that averages.

``build_averager`` takes the run config, the peer's signing key, its ``PeerPolicy`` (certificates, bans,
suspects), the upload limiter and the accuser, so neither the data-parallel trainer nor a pipeline stage
worker can forget one of them or the run's aggregator options.

Example::

    policy = PeerPolicy(dht, run.run_id, coordinator_key)
    averager = build_averager(run, dht, prefix=run.run_id, numel=n, signing_key=key, policy=policy)
"""

from __future__ import annotations

import hivemind

from protocols.keys import SigningKey
from swarm.averaging.averager import Averager
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner


def build_averager(
    run: RunConfig,
    dht: hivemind.DHT,
    *,
    prefix: str,
    numel: int,
    signing_key: SigningKey | None,
    policy: PeerPolicy,
    upload_limiter: RateLimiter | None = None,
    accuse: Accuser | None = None,
    hooks: RoundHooks | None = None,
    max_weight: float | None = None,
    data_host: str = "127.0.0.1",
    data_port: int = 0,
    data_announce_host: str | None = None,
    client_mode: bool = False,
    record_signer: RecordSigner | None = None,
    compression: str | None = None,
    min_reducers: int | None = None,
    data_plane: bool = True,
) -> Averager:
    """The averager of one role of ``run`` (the data-parallel trainer, or one pipeline stage's replicas).

    ``max_weight`` (default: the run's target batch) caps what one member may claim. ``client_mode``:
    this peer cannot be dialed (it is behind NAT), so it joins groups but never leads one.
    ``record_signer`` attaches the peer's certificate to its matchmaking declarations. ``hooks``: what
    the peer does where a member could lie (``swarm.averaging.hooks``; None: honest). ``compression`` and
    ``min_reducers`` replace the run's for a role that needs its own (the second tier, ``tiers``), and
    ``data_plane=False`` sends every part stream over libp2p.
    """
    training = run.training
    return Averager(
        dht,
        prefix=prefix,
        numel=numel,
        aggregator=training.aggregator,
        aggregator_options=training.aggregator_options,
        verify_probability=training.verify_probability,
        compression=training.compression if compression is None else compression,
        topk_density=training.topk_density,
        max_group_size=training.max_group_size,
        matchmaking_time_s=training.matchmaking_time_s,
        sender_timeout_s=training.sender_timeout_s,
        averaging_timeout_s=training.averaging_timeout_s,
        max_weight=float(training.target_batch_size if max_weight is None else max_weight),
        signing_key=signing_key,
        policy=policy,
        upload_limiter=upload_limiter,
        accuse=accuse,
        hooks=hooks,
        data_host=data_host,
        data_port=data_port,
        data_announce_host=data_announce_host,
        client_mode=client_mode,
        record_signer=record_signer,
        data_plane=data_plane,
        # Enough members that can be dialed to reduce, so that in a group of the run's minimum size with
        # an honest majority, at least one reducer is honest.
        min_reducers=(training.min_group_size + 1) // 2 if min_reducers is None else min_reducers,
    )
