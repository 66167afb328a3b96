"""Whether a member applies a round: the agreement over REPORTs (docs/design.md "The round"). Pure.

After the gather every member sends every other member a REPORT: which parts it holds and
the sha256 over the averaged payloads and counted masks it assembled its result from (the
same bytes give the same values). A member then waits (the glue bounds how long) for the
reports of the *full contributors*, the members counted in every part it holds, and
``decide`` rules by majority: the round is accepted
iff this member holds every part and its digest is shared by a strict majority of the
full contributors, itself included. A report of a missing part, of another digest, or
none at all is not agreement. So:

* one liar (or one member whose part went missing) cannot fail the round for the others
  once there are three full contributors or more; its dissent is returned (``Verdict.
  dissent``) so the glue logs it and, for "another result", counts an offence;
* two digests cannot both win (each needs more than half of the same members), so the
  members that accept hold identical bytes, and a member in the minority fails the round
  and heals from the vouched state of the majority;
* with two full contributors no majority exists against a liar: either one's dissent
  fails the round for the other (a pair cannot tell which of them lies);
* a member excluded for bad input (not a full contributor) has no say in the others' round;
* with no full contributor at all (each part lacks someone: a frozen member in a pair) no
  member applies the round: its result would be a state nobody vouches for, from which a
  member never heals back (the chaos run: a pair split on a fragment for the rest of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.errors import ProtocolError
from diloco.protocol.wire.part import Report


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of a round for one member; ``reason`` says why it is not accepted.

    ``dissent`` maps the group index of every full contributor whose report disagreed with
    this member's result to how: ``MISSING_PARTS`` or ``ANOTHER_RESULT``.
    """

    accepted: bool
    reason: str = ""
    dissent: Mapping[int, str] = field(default_factory=dict)


MISSING_PARTS = "reported missing parts"
ANOTHER_RESULT = "reported another result"
"""The offence of a member that, with every part held, reported a digest the majority did
not assemble: it lies, or a reducer sent it other bytes (which verification catches)."""


def check_report(report: Report, group_id: bytes, num_members: int) -> None:
    """Raise ProtocolError unless ``report`` speaks of this group (its framing is checked)."""
    if report.group_id != group_id or len(report.parts) != num_members:
        raise ProtocolError("report for another group")


def awaited_reports(index: int, full: Sequence[bool]) -> set[int]:
    """Members whose reports member ``index`` waits for: the other full contributors."""
    return {i for i, bit in enumerate(full) if bit and i != index}


def decide(
    index: int,
    held: Sequence[bool],
    digest: bytes,
    full: Sequence[bool],
    reports: Mapping[int, Report],
) -> Verdict:
    """Accept the round iff every part is held here and a strict majority of the voters,
    the full contributors and member ``index`` itself, hold its digest: itself, and those
    that reported it with every part (module docstring). Reports of members that are not
    full contributors are ignored; a late member, counted in its own part only, votes too.

    ``held``, ``digest`` and ``full`` are this member's (``assembly.Assembled``);
    ``reports`` maps a member's group index to the report it sent.
    """
    dissent = {
        i: MISSING_PARTS if not all(report.parts) else ANOTHER_RESULT
        for i, report in sorted(reports.items())
        if full[i] and i != index and (not all(report.parts) or report.digest != digest)
    }
    if not all(held):
        missing = [j for j, ok in enumerate(held) if not ok]
        return Verdict(False, f"parts {missing} missing here", dissent)
    if not any(full):
        # Every part lacks someone: the result mixes partial averages, nobody could vouch
        # for it, and its holder could never heal back (no vouched state is newer).
        return Verdict(False, "no member is counted in every part", dissent)
    voters = {i for i, bit in enumerate(full) if bit} | {index}
    agreeing = 1 + sum(1 for i in reports if i in voters and i != index and i not in dissent)
    if 2 * agreeing > len(voters):
        return Verdict(True, dissent=dissent)
    heard = ", ".join(f"member {i} {how}" for i, how in dissent.items()) or "no dissent"
    return Verdict(
        False, f"result held by {agreeing} of {len(voters)} members, no majority ({heard})", dissent
    )
