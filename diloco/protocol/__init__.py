"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Split by concern (as hivemind splits ``averaging/``, ``dht/`` and ``p2p/``); each
subpackage's ``__init__`` maps its modules. Read them in this order::

    core/         pure: one round without I/O (the Reducer interface, the in-process reducer,
                  the round's bookkeeping, aggregation, agreement, verification, deadlines)
    wire/         pure: frames and message bodies of every stream, size limits, reject codes
    trust/        identities and signatures, closed swarms, bans, caps on what peers may ask
    records/      what nodes publish in the DHT: run ids and configurations, node records,
                  round declarations, metrics; RUN_INFO for a joiner
    matchmaking/  who meets in a fragment round: declarations read, a leader, its GROUP
    allreduce/    one round over streams: member and reducer sides, reports, checks,
                  re-reduction, the router and transport, the runner factory and its
                  fault hook, and ``SwarmReducer`` (the trainer's view)
    staged/       bounded groups: the grid, its stages over the wire, views with members lost
    state/        a fragment's outer state, its hash, and serving / fetching it
    runtime/      the node's swarm handle: DHT + p2pd processes, event loop, streams, dial-back

Imports go down this list's layers only in the sense that ``core`` and ``wire`` import
nothing of hivemind but ``PeerID``, so the in-process trainer uses them without a swarm.
What the node layer imports: ``core.reducer`` (``Reducer``, ``InProcessReducer``,
``Contribution``, ``RoundKey``, ``RoundResult``), ``state`` (``OuterState``, the state hash),
and for the swarm node and ``status``: ``runtime.swarm``, ``allreduce.swarm_reducer``,
``records``, ``trust.identity``, ``trust.swarm_key`` and ``core.group`` (``RoundTimeouts``).
"""
