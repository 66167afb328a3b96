"""Benchmark drivers: real processes on this machine, optionally behind throttled links.

They sit beside ``cli``, above ``node`` and ``protocol``, which never import them::

    allreduce   ``diloco-node bench allreduce``: peers averaging random vectors, against
                hivemind's averager too
    chaos       a swarm whose nodes are killed, restarted and frozen at random
    launcher    peer processes forked from one warm interpreter (no imports per peer)
    netns       hosts in network namespaces behind ``tc tbf`` links (root), also for
                ``examples/throttled_swarm.sh``
    procs       a node process, its log and metrics; its helpers and footprint in /proc
    provenance  the commit, machine and torch version every benchmark's JSON records
    wan_proxy   a TCP proxy that delays every byte: round trips on loopback
"""
