"""Wire formats, sans I/O: what every stream of the protocol carries (``runtime.streams``
moves the frames)::

    run_id   run identity: name + hash of the configuration, 16-byte wire digest
    frames   the frame, message kinds, round tags, size limits, reject codes, JOIN / GROUP
    part     PART and AVERAGED prefixes, AVERAGED and REPORT bodies
    check    SEAL, CHECK_REQ / CHECK_RES, EVIDENCE_REQ / EVIDENCE bodies
    state    STATE_REQ / STATE_HDR bodies
"""
