"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Pure pieces (``partition``, ``reducer``, ``reduction``, ``norms``, ``agreement``,
``verification``, ``run_id``, ``wire``, ``state_wire``, ``check_wire``, ``fragment_state``)
import nothing of hivemind, so the in-process trainer can use them without starting it;
``group`` needs only hivemind's ``PeerID``.

Modules, one concern each (hivemind ``averaging/`` style)::

    run_id          run identity: name + hash of the configuration, 16-byte wire digest
    identity        the node's Ed25519 key (libp2p file), peer id <-> public key, signatures
    signed_records  signed envelopes under the author's peer id, their DHT validator
    records         per-node DHT records and round declarations, donor ranking, divergence
    discovery       run configurations in the DHT (size- and depth-bounded JSON)
    wire            frame and message formats (sans-I/O), size limits, reject codes
    state_wire      STATE_REQ / STATE_HDR bodies
    streams         frames over streams, transport errors, the shared handler wrapper
    group           GroupInfo (frozen, passed from matchmaking to the all-reduce), timeouts
    matchmaking     DHT declaration per round key run_id/frag{p}/round{k}, leader, GROUP
    reduction       pure core of a round: who sent what, who counts, average, assembly
    norms           pure: the chunk and block norms reducers report and members check
    agreement       pure: whether a member applies a round, from the REPORTs
    verification    pure: sampled checks of reducers' parts, who lied in a dispute
    check_wire      SEAL, CHECK_REQ / CHECK_RES, EVIDENCE_REQ / EVIDENCE bodies
    signatures      what members sign in a round (seals, check answers), and checks
    part_server     reducer side of a round over streams (PART in, AVERAGED out, evidence)
    allreduce       member side of a round over streams, reports, checks
    checking        the verification phase over streams: checks, answers, disputes
    routing         PART / REPORT / CHECK / EVIDENCE streams to their round
    fragment_state  FragmentState (outer params, momentum, version) and its one hash
    state_transfer  serve/fetch outer params + momentum, validated
    network         NetworkOptions: how a node reaches the swarm (one frozen record)
    swarm           Swarm (DHT + P2P + loop thread) and SwarmReducer (the Reducer)
    processes       the DHT process's p2pd held by pidfd, stopped if shutdown stalls

What the node layer imports from here: the outer loop and the in-process trainer
(``node.outer``, ``node.local``, ``node.trainer``) the ``reducer`` interface (``Reducer``,
``InProcessReducer``, ``Contribution``, ``RoundKey``, ``RoundResult``) and the state hash of
``state_transfer``; the swarm node and ``status`` (``node.swarm_node``,
``node.swarm_status``) also ``swarm`` (``Swarm``, ``SwarmReducer``, ``make_dht``),
``records``, ``discovery``, ``group`` (``RoundTimeouts``), ``run_id`` and
``state_transfer`` (``OuterState``). ``matchmaking``, ``allreduce``, ``wire``, ``partition``
and ``processes`` serve the protocol itself.
"""
