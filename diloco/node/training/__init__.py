"""Training, the same for every transport (docs/design.md "Algorithm and schedule").

- ``inner``: AdamW and its schedule; the one inner step both trainers use.
- ``outer_step``: the arithmetic of one outer step and the merge, on flat FP32 vectors.
- ``outer``: the outer loop (send at ``s``, apply at ``s + tau``) over any ``Reducer``;
  ``outer_config``: its configuration (H, the outer optimizer, tau, alpha, the weight cap).
- ``pending``: a round in flight between its send and receive steps, and an applied one.
- ``trainer``: one replica on the swarm's reducer (the node's trainer).
- ``local``, ``local_config``: the in-process multi-replica trainer for experiments.
- ``tau``: ``--tau auto``; ``pace``: adaptive rows per step.
- ``checkpoint``: atomic, resumable checkpoints read without pickle.
"""
