"""What the node's swarm handle (``protocol.swarm``) runs on::

network       NetworkOptions: listen / announce addresses, identity, relays, key
dht_upkeep    peers the DHT dropped (a stall of either side) are pinged back every 10 s
processes     the DHT process's p2pd held by pidfd, stopped if shutdown stalls
parent_end    a child ends with its parent: the parent watch, the death signal
event_loop    uvloop where installed, else asyncio's; wait_set, every event wait with a timeout
streams       frames over p2pd streams, transport errors, the handler wrapper
reachability  dial-back check: a node nobody can dial becomes a client
round_trips   the exchanges on a round's critical path, counted per round
offload       a round's CPU work: on the loop when small, else in the executor
"""
