"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Split by concern (as hivemind splits ``averaging/``, ``dht/`` and ``p2p/``); each
subpackage's ``__init__`` maps its modules. In layers, bottom up: each imports only what
is listed above it (folders included; modules import one another without a cycle)::

    wire/         pure: run ids, frames and message bodies of every stream, size limits,
                  reject codes
    core/         pure: one round without I/O (the Reducer interface, the in-process reducer,
                  the round's bookkeeping, aggregation, agreement, verification, deadlines)
    runtime/      what the swarm handle runs on: DHT + p2pd processes, event loop, streams,
                  dial-back, round trips
    trust/        identities and signatures, closed swarms, bans and stalls, caps on what
                  peers may ask
    records/      what nodes publish in the DHT: run configurations, node records,
                  round declarations, metrics; RUN_INFO for a joiner
    state/        a fragment's outer state, its hash, and serving / fetching it
    matchmaking/  who meets in a fragment round: declarations read, a leader, its GROUP
    allreduce/    one round over streams: member and reducer sides, reports, checks,
                  re-reduction, the router and transport, the runner factory and its
                  fault hook
    staged/       bounded groups: the grid, its stages over the wire, views with members lost
    swarm         Swarm: the node's handle (DHT, p2pd, the protocol's event-loop thread),
                  its records, state server and bans
    swarm_reducer SwarmReducer: the trainer's Reducer over the swarm, owner of each round
                  (flat or staged)

``core`` and ``wire`` import nothing of hivemind but ``PeerID``, so the in-process trainer
uses them without a swarm.
What the node layer imports: ``core.reducer`` (``Reducer``, ``InProcessReducer``,
``Contribution``, ``RoundKey``, ``RoundResult``), ``state`` (``OuterState``, the state hash),
and for the swarm node and ``status``: ``swarm``, ``swarm_reducer``,
``records``, ``trust.identity``, ``trust.swarm_key`` and ``core.group`` (``RoundTimeouts``).
"""
