"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Pure pieces (``partition``, ``reducer``, ``run_id``, ``wire``, ``group``) import no
networking, so the in-process trainer can use them without starting hivemind.

Modules, one concern each (hivemind ``averaging/`` style)::

    run_id          run identity: name + hash of the configuration, 16-byte wire digest
    identity        the node's Ed25519 key (libp2p file), peer id <-> public key, signatures
    signed_records  signed envelopes under the author's peer id, their DHT validator
    records         per-node DHT records and round declarations, donor ranking, divergence
    discovery       run configurations in the DHT (size- and depth-bounded JSON)
    wire            framing of every stream message, size limits, reject codes
    group           GroupInfo (frozen, passed from matchmaking to the all-reduce), timeouts
    matchmaking     DHT declaration per round key run_id/frag{p}/round{k}, leader, GROUP
    allreduce       butterfly all-reduce over p2pd streams, faults, report agreement
    state_transfer  serve/fetch outer params + momentum, validated
    swarm           Swarm (DHT + P2P + loop thread) and SwarmReducer (the Reducer)
    processes       the DHT process's p2pd held by pidfd, stopped if shutdown stalls
    bench           ``diloco-node bench allreduce``

The trainer uses ``Swarm`` and ``SwarmReducer`` (see ``swarm``) and never the rest.
"""
