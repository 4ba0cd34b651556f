"""Averaging among the peers of a run: fault-tolerant butterfly all-reduce with bit-identical results.

- ``compression``: wire codecs (fp16, fp32, int8, sparse topk) with checked decoding
- ``validation``: checks on a groupmate's contribution (size, dtype, finite, norm) and fair weights
- ``aggregators``: the pluggable rule each reducer applies to its part (``centered_clip``, ``mean``, ...)
- ``groups``: signed matchmaking entries and the checks on a group before its round
- ``declarations``: signed, certified matchmaking declarations under one fixed DHT key per averaging prefix
- ``matchmaking``: ``RunMatchmaking``, hivemind's matchmaking held to the peer policy
- ``policy``: ``PeerPolicy``, who a peer may average with (certified, not banned, not a suspect)
- ``missed``: ``MissedRounds``, reducers that missed rounds, avoided for searches and forgiven by rounds delivered
- ``evidence``: what round members sign, the run's chunk layout, and evidence a third party can judge
- ``allreduce``: ``ButterflyAllReduce``, one round in which every peer ends with the same bits
- ``sender``: ``PartSender``, the round's sender side: stream this peer's chunks, check the aggregates back
- ``reducer``: ``PartReducer``, the round's reducer side: check, aggregate, sign and return this peer's part
- ``repair``: ``PartRepairs``, a withheld part relayed or re-reduced by its substitute in the same round
- ``verification``: validators drawn after delivery, who collect signed inputs and recompute a chunk
- ``scores``: each input of a checked chunk scored against the others, to pick senders to replay
- ``transport``: ``DataPlane``, a direct TCP path for the bulk part streams beside libp2p
- ``deadlines``: the data path's deadlines from measured upload throughput and the bytes moved
- ``rounds``: ``RoundRegistry``, where an inbound part stream finds its round (live or just finished)
- ``archive``: ``InputArchive``, the inputs this peer aggregated, kept for the coordinator's demand
- ``hooks``: ``RoundHooks``, what a member does as reducer, validator and leader (honest; attacks override)
- ``averager``: ``Averager``: hivemind's matchmaking plus our all-reduce and state-download handlers
- ``factory``: ``build_averager``, the one way every role builds its ``Averager`` from the run config
- ``tiers``: the second tier beyond one group: representatives, their signed hand-off and its check
- ``tiercert``: a first-tier group's certificate, its members' attestations that let its representative in
- ``tierserve``: the hand-off's board and handler, and a member's fetch of it
"""
