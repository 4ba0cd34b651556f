"""The volunteer process and the ``swarm-peer`` CLI.

- ``config``: ``PeerConfig``, the typed settings behind ``swarm-peer join``'s flags
- ``device``: choosing and describing the compute device (``--gpu``/``--cpu``)
- ``trust``: pinned coordinator keys (known_coordinators.json)
- ``limits``: politeness limits (``--max-gpu-memory``, ``--max-upload-mbps``)
- ``control``: ``swarm-peer pause``/``resume`` by signal to the running peer
- ``panel``: the live terminal panel of ``swarm-peer join`` (plain log lines when not a terminal)
- ``doctor``: ``swarm-peer doctor``, checks before joining, each problem with its fix
- ``reachability``: whether other peers can dial this machine, learned at join (one behind NAT never leads)
- ``volunteer``: ``Volunteer``, which joins, enters the DHT, heartbeats and leaves cleanly
- ``cli``: the ``swarm-peer`` entry point
"""
