"""The lab: whole runs rehearsed on one machine. It composes a coordinator and volunteers as separate
processes, so it sits above ``peer`` and ``coordinator`` and neither of them imports it.

- ``localswarm``: ``LocalSwarm``, a coordinator and peers as processes on loopback (sims, tests, demo)
- ``forked``: ``ForkedCommand``, a coordinator or peer command forked from the rehearsal's fork server
- ``testsession``: the test suite's process set up as a command's (``-p lab.testsession``): its fork server
- ``wanlab``: ``WanLab``, hosts in network namespaces behind kernel-capped links and NAT (``--wan``, ``--nat``)
- ``simconfig``: ``SimConfig``, the settings of ``swarm-sim`` (its flags), and the run it trains
- ``rehearsal``: ``Rehearsal``, the skeleton both sims share: log directory, processes, bounds, report
- ``sim``: the ``swarm-sim`` entry point: rehearse a data-parallel run, then check it
- ``pipeline_sim``: ``swarm-sim --stages S``: rehearse a pipeline run, then check it
- ``roundfigures``: the per-step figures of a rehearsal (groups, downloads, bytes) from its peers' round journals
- ``scalesim``: ``ScaleSim``, a discrete-event model of a run at 8 to 1,000+ peers over the real round decisions
"""
