"""Whether a member applies a round: the agreement over REPORTs (SPEC 4 "Faults"). Pure.

After the gather every member sends every other member a REPORT: which parts it holds and
the sha256 over the averaged payloads and counted masks it assembled its result from (the
same bytes give the same values). A member then waits (the glue bounds how long) for the
reports of the *full contributors*, the members counted in every part it holds, and
``decide`` rules: the round is accepted iff this member holds every part and every full
contributor's report that arrived says "every part, same digest". One part missing at a
full contributor therefore fails the round for everyone who hears of it, while a member
excluded for bad input (not a full contributor) cannot veto the others' round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco.errors import ProtocolError
from diloco.protocol.wire import Report


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of a round for one member; ``reason`` says why it is not accepted."""

    accepted: bool
    reason: str = ""


def check_report(report: Report, group_id: bytes, num_members: int) -> None:
    """Raise ProtocolError unless ``report`` speaks of this group (its framing is checked)."""
    if report.group_id != group_id or len(report.parts) != num_members:
        raise ProtocolError("report for another group")


def awaited_reports(index: int, full: Sequence[bool]) -> set[int]:
    """Members whose reports member ``index`` waits for: the other full contributors."""
    return {i for i, bit in enumerate(full) if bit and i != index}


def decide(
    held: Sequence[bool], digest: bytes, full: Sequence[bool], reports: Mapping[int, Report]
) -> Verdict:
    """Accept the round iff every part is held here and no full contributor reports a
    missing part or another digest (reports of other members are not evidence here).

    ``held``, ``digest`` and ``full`` are this member's (``reduction.Assembled``);
    ``reports`` maps a member's group index to the report it sent.
    """
    if not all(held):
        missing = [j for j, ok in enumerate(held) if not ok]
        return Verdict(False, f"parts {missing} missing here")
    for i, report in sorted(reports.items()):
        if not full[i]:
            continue
        if not all(report.parts):
            return Verdict(False, f"member {i} is missing parts")
        if report.digest != digest:
            return Verdict(False, f"member {i} assembled another result")
    return Verdict(True)
