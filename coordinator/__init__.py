"""The coordinator node, its store, and the ``swarm-coordinator`` CLI. It is not a parameter server.

- ``config``: ``CoordinatorConfig``, the typed settings behind ``swarm-coordinator start``'s flags
- ``store``: the run's record in SQLite (peers, certificates, metrics, bans)
- ``service``: the gRPC service: challenge-response admission, heartbeats, leave, status
- ``node``: ``CoordinatorNode``, which runs the DHT bootstrap peer, the service and the liveness sweep
- ``cli``: the ``swarm-coordinator`` entry point (start, status, ban, unban)
"""
