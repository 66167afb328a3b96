"""The rounds a node reached the send step of, noted beside its checkpoints (docs/design.md
"Healing and joining").

A node killed right after it joined a round, and resumed from an older checkpoint with the
same identity, trains to that round's send step again. Its old process may have formed a
group that completed with the parts it sent; joining another group would make two groups of
one round from one prior, and the peers would end with two states. The declaration the old
process left in the DHT tells this only roughly: one announced ahead expires up to twice its
lead after the send step, so in a chaos run a round the old process reached just before it
died looked like one it had only announced; the resumed joiner formed it again with another
peer, and the round ended with two states.

So the node notes each round in its checkpoint folder before it starts it, and a process
resumed from that folder sits out the rounds noted past its checkpoint's step and heals
them (``SwarmReducer.reached_before``). A note is one unbuffered write to the file, which
a killed process (SIGKILL, the OOM killer) cannot lose; an operating system that crashes
before the page cache reaches the disk can, and the old declaration is then the evidence.
A folder that cannot be written (a full disk) costs the notes, never the run (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from diloco.node.model.fragments import send_step
from diloco.protocol.core.reducer import RoundKey

logger = logging.getLogger(__name__)

FILE_NAME = "sent_rounds"
"""The notes' file in the checkpoint folder: one line ``run_id fragment round`` per round."""


class SentRounds:
    """The notes of run ``run_id`` in ``folder``; ``note`` from any thread."""

    def __init__(self, folder: str | Path, run_id: str) -> None:
        self.path = Path(folder) / FILE_NAME
        self.run_id = run_id
        self._keep: tuple[RoundKey, ...] = ()
        self._started = False
        self._failed = False
        self._lock = threading.Lock()

    def reached_after(self, step: int, sync_every: int, num_fragments: int) -> set[RoundKey]:
        """The rounds of this run noted with their send step past ``step`` (the step this
        process resumed at): an earlier process reached them. They stay in the file when
        this process starts its own notes; older ones go."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return set()
        except OSError as error:
            logger.warning("could not read %s (%s): no round is sat out by it", self.path, error)
            return set()
        reached = set()
        for line in text.splitlines():
            fields = line.split()
            if len(fields) != 3 or fields[0] != self.run_id:
                continue  # another run's, or a line cut by a crash
            try:
                key = RoundKey(int(fields[1]), int(fields[2]))
            except ValueError:
                continue
            if send_step(key.fragment, key.round, sync_every, num_fragments) > step:
                reached.add(key)
        self._keep = tuple(sorted(reached, key=lambda k: (k.fragment, k.round)))
        return reached

    def note(self, key: RoundKey) -> None:
        """This node reaches round ``key``'s send step and is about to start it."""
        with self._lock:
            if self._failed:
                return
            try:
                if not self._started:
                    self._start()
                    self._started = True
                with self.path.open("ab", buffering=0) as notes:
                    notes.write(self._line(key))
            except OSError as error:
                self._failed = True
                logger.warning(
                    "could not note round %s in %s (%s): a restart from an older checkpoint "
                    "finds the rounds this process reached only by its declarations",
                    key,
                    self.path,
                    error,
                )

    def _start(self) -> None:
        """The file anew, with the rounds ``reached_after`` kept: older notes lie behind
        this process's checkpoints, and the file grows with one process's rounds only."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{FILE_NAME}-{os.getpid()}")
        temporary.write_bytes(b"".join(self._line(key) for key in self._keep))
        temporary.replace(self.path)

    def _line(self, key: RoundKey) -> bytes:
        return f"{self.run_id} {key.fragment} {key.round}\n".encode()
