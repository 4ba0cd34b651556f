"""SWARM pipeline parallelism: a model too large for one volunteer, split into stages served by many.

- layout.py: which blocks each stage holds (``stage_layout``), building one stage (``build_stage``)
- wire.py: tensors on the wire (fp16 activations and gradients) and the checks on everything received
- records.py: what stage servers and trainers announce in the DHT (``PipelineView``)
- balance.py: which stage a peer takes, which server a trainer calls, who moves to the bottleneck
- gate.py: who may call a stage server (verified members, not banned)
- replica.py: one replica of a stage: forward, backward, accumulation once per micro-batch, the step
- held.py: what a replica holds of a micro-batch (``HeldForward``) and the per-caller bound on it
- server.py: the P2P handlers of a stage server (``StageServicer``), every refusal a code and a message
- worker.py: a peer hosting a stage (``StageWorker``): serve, average with the stage's replicas, catch up,
  rebalance
- moves.py: how that peer joins a stage, serves it, catches up with it (whom it follows: its anchors),
  leaves it and moves to another (``StageMoves``)
- history.py: the states a replica serves: its current one and those of its last steps (``StateHistory``)
- verify.py: signed replies of stage replicas (``check_reply``) and the micro-batch's dropout seed
- evidence.py: two replicas' different answers to one micro-batch (``StageMismatchEvidence``), judged
- check.py: a trainer's checks of stage replicas, repeated at a second replica (``StageCheck``)
- hooks.py: ``PipelineHooks``, what a replica or trainer announces and sends (honest; attacks override)
- trainer.py: a peer streaming micro-batches through the stages (``PipelineTrainer``), with retries

Example::

    run = RunConfig(run_id="r", model={"name": "gpt", "config": {"n_layer": 6}}, pipeline={"stages": 3})
    stages = split_model(run)   # three modules; composed, they compute the whole model's forward
"""

from swarm.pipeline.layout import StageSpec, build_stage, split_model, stage_layout

__all__ = ["StageSpec", "build_stage", "split_model", "stage_layout"]
