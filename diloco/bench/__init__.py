"""Benchmark drivers: real processes on this machine, optionally behind throttled links.

They sit beside ``cli``, above ``node`` and ``protocol``, which never import them::

    allreduce   ``diloco-node bench allreduce``: peers averaging random vectors, against
                hivemind's averager too
    netns       hosts in network namespaces behind ``tc tbf`` links (root), also for
                ``examples/throttled_swarm.sh``
    provenance  the commit, machine and torch version every benchmark's JSON records
"""
