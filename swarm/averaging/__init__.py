"""Averaging among the peers of a run: fault-tolerant butterfly all-reduce with bit-identical results.

- ``compression``: fp16/fp32 encodings of vectors on the wire, with checked decoding
- ``aggregators``: the pluggable rule each reducer applies to its part (``mean``, ...)
- ``allreduce``: ``ButterflyAllReduce``, one round in which every peer ends with the same bits
- ``averager``: ``Averager``: hivemind's matchmaking plus our all-reduce and state-download handlers
"""
