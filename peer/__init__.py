"""The volunteer process and the ``swarm-peer`` CLI.

- ``config``: ``PeerConfig``, the typed settings behind ``swarm-peer join``'s flags
- ``device``: choosing and describing the compute device (``--gpu``/``--cpu``)
- ``trust``: pinned coordinator keys (known_coordinators.json)
- ``volunteer``: ``Volunteer``, which joins, enters the DHT, heartbeats and leaves cleanly
- ``cli``: the ``swarm-peer`` entry point
"""
