"""diloco.bench.provenance names the commit a benchmark ran on, as git itself reports it."""

import datetime
import subprocess
from pathlib import Path

import torch

from diloco.bench.provenance import TREE, provenance


def git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_the_commit_is_the_head_of_this_tree() -> None:
    record = provenance()
    assert record["commit"] == git(TREE, "rev-parse", "HEAD")
    assert record["dirty"] == bool(git(TREE, "status", "--porcelain", "--untracked-files=no"))
    assert record["torch"] == torch.__version__
    assert datetime.datetime.fromisoformat(record["date"]).utcoffset() == datetime.timedelta(0)
    assert record["machine"]["cpus"] >= 1


def test_a_changed_tracked_file_makes_the_tree_dirty(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "untracked.txt").write_text("not part of the commit\n")
    assert (provenance(tmp_path)["commit"], provenance(tmp_path)["dirty"]) == (head, False)
    (tmp_path / "a.txt").write_text("two\n")
    assert (provenance(tmp_path)["commit"], provenance(tmp_path)["dirty"]) == (head, True)


def test_outside_a_repository_the_commit_is_unknown(tmp_path: Path) -> None:
    record = provenance(tmp_path)
    assert (record["commit"], record["dirty"]) == ("unknown", False)
