"""The coordinator node, its store, and the ``swarm-coordinator`` CLI. It is not a parameter server.

- ``config``: ``CoordinatorConfig``, the typed settings behind ``swarm-coordinator start``'s flags
- ``store``: the run's record in SQLite (peers, certificates, metrics, bans, credit, metrics history)
- ``credit``: the verified step, and how pipeline roles' reports become credit; the rules credit shares
- ``stepshares``: credit from witnessed rounds: each step's share divided equally among its members
- ``witness``: the rounds a heartbeat reports its sender applied, opened and checked member by member
- ``suspicions``: which peers others avoid for breaking their rounds, as their heartbeats report it
- ``standing``: the credited peers the coordinator signs into heartbeat answers, for catch-up votes
- ``service``: the gRPC service: challenge-response admission, heartbeats, leave, status, accusations
- ``limits``: ``ServiceLimits``, per-caller and global limits on challenges, accusations and evidence
- ``accusations``: reading an accusation's evidence as it arrives, and judging it with the run's rule
- ``judging``: the one recompute at a time, whose turn caller addresses take in rotation
- ``stagestates``: a pipeline stage's state at a recent step, fetched from its replicas to judge evidence
- ``roundinputs``: the demand for the inputs behind an aggregate a validator could not collect, and its judgment
- ``contributions``: judging a sender check: the accused's contribution recomputed from the accuser's state
- ``banlist``: the bans in the store, and which of them the published ban list names first
- ``datadir``: the data dir's file names and ``DataDirLock``, which gives a data dir to one live coordinator
- ``node``: ``CoordinatorNode``, which runs the DHT bootstrap peer, the service and the liveness sweep
- ``metrics``: the run as the dashboard sees it (``/api/status`` JSON, Prometheus text, wandb/tensorboard)
- ``dashboard``: the web dashboard (aiohttp): the page in ``static/``, ``/api/status``, ``/metrics``
- ``checkpoints``: ``CheckpointKeeper``, which fetches the state the peers agree on and keeps it on disk
- ``dialback``: the DialBack RPC with which ``swarm-peer doctor`` learns whether peers can reach it
- ``cli``: the ``swarm-coordinator`` entry point (start, status, ban, unban)
"""
