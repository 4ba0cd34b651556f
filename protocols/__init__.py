"""What crosses the wire between swarm processes. Imports no torch.

- ``errors``: the one error hierarchy (``SwarmError`` and its families), shared by every package
- ``version``: the protocol version and the limits every side enforces
- ``codec``: msgpack encoding with size, depth and type limits for anything read from the network
- ``keys``: Ed25519 signing keys and libp2p peer IDs (the key that signs is the key of the peer ID)
- ``envelope``: signed messages bound to a run and a purpose, so they cannot be replayed elsewhere
- ``certificates``: peer certificates that the coordinator signs at admission
- ``messages``: the bodies of the coordinator's signed messages, checked field by field
- ``coordinator.proto``: the coordinator's gRPC service; ``coordinator_pb2*`` is the code made from it
- ``averaging.proto``: peer-to-peer messages of averaging rounds (over hivemind's P2P); ``averaging_pb2*``
  is the code made from it
- ``pipeline.proto``: forward and backward calls to pipeline stage servers (over hivemind's P2P)
"""

from protocols.version import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
