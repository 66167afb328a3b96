"""The node: everything one volunteer's process does, in subpackages by concern.

- ``config``, ``flags``: the run's and the node's typed configuration, and the CLI flags
  derived from it (one table for ``start``, ``join`` and ``local``).
- ``model/``: the decoder, fragments, compute options, device transfers, exports.
- ``data/``: corpora, ``prepare-data``, tokenizers and what a run's data must match.
- ``training/``: inner and outer steps, the outer loop, both trainers, tau, pace, checkpoints.
- ``evidence/``: what a node has seen and which claims of others count.
- ``swarm/``: the node wired to the swarm, its publisher and healing threads.
- ``observe/``: metrics, trackers, traffic; ``dashboard/``: the web page.
- ``demo``: the README's main job (a small local swarm).
"""
