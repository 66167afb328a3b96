"""The pure core of a round: what the all-reduce computes and decides, with no I/O.

The in-process trainer runs these directly; ``allreduce`` runs them over streams, so both
transports share one algorithm. Nothing here imports hivemind beyond ``PeerID``::

    reducer       the Reducer interface (Contribution, RoundKey, RoundResult) and
                  InProcessReducer, which follows the wire path exactly
    partition     butterfly split of a fragment's vector into per-reducer parts
    aggregation   how contributions combine: weight cap, norm clipping, the mean
    round         one round's bookkeeping: who sent what, who counts, average
    assembly      a member's side: averaged parts received, the result they make
    norms         the chunk and block norms reducers report and members check
    agreement     whether a member applies a round, from the REPORTs (majority)
    verification  sampled checks of reducers' parts, who lied in a dispute
    group         GroupInfo (matchmaking -> all-reduce) and RoundTimeouts
    adaptive      part deadlines from recent rounds' transfer times, bounded
    budget        every deadline of a round: the loop times its phases end
    demotion      a node whose reducer part keeps failing asks for none a while
"""
