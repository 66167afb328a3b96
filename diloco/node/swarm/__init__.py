"""The node on the swarm: wiring, threads, healing.

- ``node``: ``SwarmNode``, the trainer wired to the swarm (records, rounds, summary).
- ``publisher``: the node's records kept alive on a thread of their own.
- ``first_step``: a node's first step held until enough peers are in the run.
- ``healing``: checking for divergence and adopting a state, on its own executor.
- ``donors``: whom a heal fetches which fragment from, and what it adopts (pure).
- ``before_send``: a fragment that lacks its last round is healed before its next send.
- ``fetch_groups``: a heal's downloads, one request per donor.
- ``state_source``: the swarm as healing's source; a leaving node's last record.
- ``ahead``: which rounds are announced before their send step.
- ``round_failures``: failed rounds told to a person, by cause.
- ``pinned_run``: which run a node trains; ``status``: ``diloco-node status``.
"""
