"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Pure pieces (``partition``, ``reducer``, ``reduction``, ``agreement``, ``run_id``, ``wire``,
``state_wire``, ``group``) import no networking, so the in-process trainer can use them
without starting hivemind.

Modules, one concern each (hivemind ``averaging/`` style)::

    run_id          run identity: name + hash of the configuration, 16-byte wire digest
    records         per-node DHT records (validated), donor ranking, divergence check
    wire            frame and message formats (sans-I/O), size limits, reject codes
    state_wire      STATE_REQ / STATE_HDR bodies
    streams         frames over streams, transport errors, the shared handler wrapper
    group           GroupInfo (frozen, passed from matchmaking to the all-reduce), timeouts
    matchmaking     DHT declaration per round key run_id/frag{p}/round{k}, leader, GROUP
    reduction       pure core of a round: who sent what, who counts, average, assembly
    agreement       pure: whether a member applies a round, from the REPORTs
    part_server     reducer side of a round over streams (PART in, AVERAGED out)
    allreduce       member side of a round over streams, reports; stream routing
    state_transfer  serve/fetch outer params + momentum, validated
    swarm           Swarm (DHT + P2P + loop thread) and SwarmReducer (the Reducer)
    processes       the DHT process's p2pd held by pidfd, stopped if shutdown stalls
    bench           ``diloco-node bench allreduce``

The trainer uses ``Swarm`` and ``SwarmReducer`` (see ``swarm``) and never the rest.
"""
