"""The notes of the rounds a node reached (``diloco.node.training.sent_rounds``): what a
resumed process reads back, and a folder that cannot be written."""

from __future__ import annotations

import logging

from diloco.node.training.sent_rounds import FILE_NAME, SentRounds
from diloco.protocol.core.reducer import RoundKey

RUN = "run-0123456789abcdef"
H, F = 10, 5
"""Fragment p sends round k at step 2p + 10k."""


def test_only_this_runs_rounds_past_the_resumed_step_are_read(tmp_path) -> None:
    (tmp_path / FILE_NAME).write_text(
        f"{RUN} 0 3\n"  # sent at step 30: in the checkpoint of step 30
        f"{RUN} 1 3\n"  # step 32
        "other-run-0000000000000000 2 3\n"
        f"{RUN} x 3\n"
        f"{RUN} 4\n"
        f"{RUN} 4 3"  # step 38, its line cut before the newline: still whole
    )
    notes = SentRounds(tmp_path, RUN)
    assert notes.reached_after(30, H, F) == {RoundKey(1, 3), RoundKey(4, 3)}
    assert SentRounds(tmp_path / "none", RUN).reached_after(0, H, F) == set()


def test_a_new_process_keeps_the_rounds_it_read_and_drops_the_rest(tmp_path) -> None:
    (tmp_path / FILE_NAME).write_text(f"{RUN} 0 1\n{RUN} 1 3\n")
    notes = SentRounds(tmp_path, RUN)
    assert notes.reached_after(30, H, F) == {RoundKey(1, 3)}
    notes.note(RoundKey(2, 3))
    notes.note(RoundKey(3, 3))
    lines = (tmp_path / FILE_NAME).read_text().splitlines()
    assert lines == [f"{RUN} 1 3", f"{RUN} 2 3", f"{RUN} 3 3"]


def test_a_folder_that_cannot_be_written_costs_the_notes_not_the_run(tmp_path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    notes = SentRounds(blocked, RUN)
    with caplog.at_level(logging.WARNING):
        notes.note(RoundKey(0, 1))
        notes.note(RoundKey(1, 1))
    warnings = [r for r in caplog.records if "could not note round" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, and the run goes on
