"""``RoundTransport``: how the runners of a round reach their peers (docs/design.md "The
round").

The router (``routing``) serves the node's four all-reduce handlers and hands every runner
the same transport: the node's streams and the names of those handlers, to which the
runner opens its PART, REPORT, CHECK and EVIDENCE streams at the other members. A runner
thus never reaches into the swarm, and a test runs the production runners over in-memory
streams by giving them another ``StreamTransport``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hivemind.p2p import PeerID

from diloco.protocol.runtime.streams import StreamTransport


@dataclass(frozen=True, slots=True)
class RoundTransport:
    """The node's streams and the router's handler names, one per kind of stream."""

    p2p: StreamTransport
    part: str
    report: str
    check: str
    evidence: str

    @classmethod
    def of(cls, p2p: StreamTransport, run_id: str) -> RoundTransport:
        """The transport of run ``run_id``: its handlers are named after it, so two runs
        served by one daemon never mix their streams."""
        return cls(
            p2p,
            part=f"/diloco/{run_id}/part/2",  # 2: REPORT and CHECK_REQ follow the part
            report=f"/diloco/{run_id}/report/1",
            check=f"/diloco/{run_id}/check/1",
            evidence=f"/diloco/{run_id}/evidence/1",
        )

    @property
    def peer_id(self) -> PeerID:
        """This node's peer id: its place in every group."""
        return self.p2p.peer_id

    @property
    def handlers(self) -> tuple[str, str, str, str]:
        """PART, REPORT, CHECK and EVIDENCE handler names."""
        return self.part, self.report, self.check, self.evidence
