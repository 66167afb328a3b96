"""Who meets in a fragment round::

lobby       a round's DHT key, its leader, the prior check, this node's lobby state
matchmaker  the protocol: declare, read the view, lead (GROUP) or follow (JOIN)
answers     the leader's side: each JOIN answered from what this node knows of the round
follower    the round reads, and a follower's JOIN and wait for GROUP (silent leader)
ahead       declaring and reading a round before its send step (lobbies opened early)
"""
