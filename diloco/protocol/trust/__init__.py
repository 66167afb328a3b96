"""Who a peer is and what it may do::

identity          the node's Ed25519 key (libp2p file), peer id <-> public key
envelopes         signed DHT records under the author's peer id, their validator
remembered        a process's bounded memory of checks that passed (signatures, records)
round_signatures  what members sign in a round (seals, check answers), and checks
swarm_key         closed swarms: the key, AUTH on every stream, record and declaration proofs
admission         who may influence a node: key holders, the creator's admitted peer ids
bans              offences per peer; repeated ones (or one proven lie) ban a while
stalls            this node's own stalls, across which it charges no peer's silence
limits            caps on a server's streams: per peer, per-peer rate, in total
"""
