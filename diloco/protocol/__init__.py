"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Pure pieces (``partition``, ``reducer``) import no networking, so the in-process trainer
can use them without starting hivemind.
"""
