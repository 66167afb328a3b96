"""What a node may believe of others (docs/design.md "Evidence"): pure decisions.

- ``witness``: the rounds this node applied and their members (who it saw work).
- ``claims``: which vouches, steps and states count, from witnessed peers only.
- ``suspects``: which fragments stay in doubt after a round the node may have missed.
"""
