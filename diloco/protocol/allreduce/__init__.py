"""One fragment round over streams (its pure core is ``protocol.core``)::

member         a member's side: PARTs out, AVERAGED in, reports, checks
contribution   a member's chunks: encoded once, sealed, recorded for checks
part_server    a reducer's side: PARTs in, AVERAGED out, evidence kept
reports        the REPORT exchange
checking       the verification phase: checks, answers, disputes, blame
substitute     a failed reducer's part re-reduced by its substitute
silence        members that send a reducer nothing: dropped early, charged
routing        PART / REPORT / CHECK / EVIDENCE streams to their round
swarm_reducer  SwarmReducer: the trainer's Reducer over the swarm
"""
