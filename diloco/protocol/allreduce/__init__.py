"""One fragment round over streams (its pure core is ``protocol.core``)::

member         a member's side: PARTs out, AVERAGED in, reports, checks
part_reply     a reducer's reply on a PART stream (AVERAGED chunks, SEAL), read and checked
channel        a PART stream kept open for the REPORT and CHECK_REQ to its reducer
contribution   a member's chunks: encoded once, sealed, recorded for checks
part_server    a reducer's side: PARTs in, AVERAGED out, evidence kept
reports        the REPORT exchange
checking       the verification phase: checks, answers, disputes, blame
substitute     a failed reducer's part re-reduced by its substitute
silence        members that send a reducer nothing: dropped early, charged
clock          the clock a round's timers run on (a test may step it)
transport      RoundTransport: the node's streams and the handler names runners open
routing        RoundRouter: the rounds in flight, their four handlers, streams routed to
               a round by the Routed interface (flat and staged runners implement it)
runners        RoundRunners: the runner factory of one round (flat, or each stage)

The owner of each round, flat or staged, is ``protocol.swarm_reducer`` (above this and
``staged``).
"""
