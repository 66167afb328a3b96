"""The swarm protocol: DHT records, matchmaking, butterfly all-reduce, state transfer.

Pure pieces (``partition``, ``aggregation``, ``reducer``, ``reduction``, ``norms``,
``agreement``, ``verification``, ``grid``, ``staged``, ``run_id``, ``wire``, ``state_wire``,
``check_wire``, ``fragment_state``, ``limits``, ``demotion``) import nothing of hivemind,
so the in-process trainer can use them without starting it; ``group``, ``bans`` and
``adaptive`` need only hivemind's ``PeerID``.

Modules, one concern each (hivemind ``averaging/`` style)::

    run_id          run identity: name + hash of the configuration, 16-byte wire digest
    identity        the node's Ed25519 key (libp2p file), peer id <-> public key, signatures
    signed_records  signed envelopes under the author's peer id, their DHT validator
    records         per-node DHT records, round declarations and vouches, donor ranking
    discovery       run configurations signed by the run's creator, in the DHT (bounded JSON)
    run_info        RUN_INFO: a joiner asks the peer it was given which run it trains
    swarm_key       closed swarms: the key, AUTH on every stream, declaration proofs
    wire            frame and message formats (sans-I/O), size limits, reject codes
    state_wire      STATE_REQ / STATE_HDR bodies
    streams         frames over streams, transport errors, the shared handler wrapper
    group           GroupInfo (frozen, passed from matchmaking to the all-reduce), timeouts
    matchmaking     DHT declaration per round key run_id/frag{p}/round{k}, leader, GROUP
    aggregation     pure: how contributions combine (weight cap, norm clipping, the mean)
    reduction       pure core of a round: who sent what, who counts, average, assembly
    norms           pure: the chunk and block norms reducers clip by, report and members check
    agreement       pure: whether a member applies a round, from the REPORTs (majority)
    grid            pure: bounded groups, members placed on a grid, the plan of stages
    staged          pure: the in-process reducer following a grid plan's stages
    verification    pure: sampled checks of reducers' parts, who lied in a dispute
    bans            offences per peer; repeated ones (or one proven lie) ban the peer a while
    demotion        pure: a node whose own reducer part keeps failing asks for none a while
    reachability    dial-back check: a node nobody can dial becomes a client (no part)
    check_wire      SEAL, CHECK_REQ / CHECK_RES, EVIDENCE_REQ / EVIDENCE bodies
    signatures      what members sign in a round (seals, check answers), and checks
    part_server     reducer side of a round over streams (PART in, AVERAGED out, evidence)
    allreduce       member side of a round over streams, reports, checks
    rereduction     churn: a failed reducer's part re-reduced by its substitute
    report_exchange REPORTs of a round over streams
    adaptive        pure: part deadlines from recent rounds' transfer times, bounded
    checking        the verification phase over streams: checks, answers, disputes, blame
    routing         PART / REPORT / CHECK / EVIDENCE streams to their round
    fragment_state  FragmentState (outer params, momentum, version) and its one hash
    state_transfer  serve/fetch outer params + momentum, validated; caps, hashes per snapshot
    limits          pure caps on a server's streams: per peer, per-peer rate, in total
    network         NetworkOptions: how a node reaches the swarm (one frozen record)
    swarm           Swarm (DHT + P2P + loop thread) and SwarmReducer (the Reducer)
    processes       the DHT process's p2pd held by pidfd, stopped if shutdown stalls

What the node layer imports from here: the outer loop and the in-process trainer
(``node.outer``, ``node.local``, ``node.trainer``) the ``reducer`` interface (``Reducer``,
``InProcessReducer``, ``Contribution``, ``RoundKey``, ``RoundResult``) and the state hash of
``state_transfer``; the swarm node and ``status`` (``node.swarm_node``,
``node.pinned_run``, ``node.swarm_status``) also ``swarm`` (``Swarm``, ``SwarmReducer``,
``make_dht``), ``records``, ``discovery``, ``run_info``, ``swarm_key``, ``identity``,
``group`` (``RoundTimeouts``), ``run_id`` and ``state_transfer`` (``OuterState``).
``matchmaking``, ``allreduce``, ``wire``, ``partition`` and ``processes`` serve the
protocol itself.
"""
