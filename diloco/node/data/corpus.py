"""Training data: byte-level text corpora and nanoGPT-style token files.

Sources (``load_corpus``):
- no path: the **embedded corpus**, the Python standard library's own source files (present
  wherever Python is, so a demo needs no download);
- a text file or a folder of text files: their bytes (vocabulary 256); never a tokenizer or
  JSONL/Parquet records, which ``prepare-data`` makes into tokens;
- a folder written by ``diloco.node.data.prepare`` (or its ``manifest.json``): ``train.bin``
  and ``val.bin`` in the manifest's dtype, vocabulary and fingerprint from the manifest;
- a folder holding ``train.bin`` and ``val.bin`` without a manifest, or one ``.bin`` file:
  uint16 tokens (nanoGPT's own layout).
Token files are memory-mapped, never loaded whole.

Train and held-out data are split deterministically (by file for text, by the two files or
the last 5% of tokens for ``.bin``). Each replica samples with its own seeded generator, and
the generator state is the data position of a resumable run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.errors import ConfigError
from diloco.node.data.manifest import MANIFEST_NAME, file_sha256, read_manifest

logger = logging.getLogger(__name__)

HELD_OUT_EVERY = 20
"""One text file in this many (by a hash of its relative path) is held out for evaluation."""

EMBEDDED_CORPUS_BYTES = 24 * 2**20
"""The embedded corpus reads files in path order until it holds this many training bytes."""


BYTES = "bytes"
"""Tokenizer identity of raw bytes (the embedded corpus, text files, ``--tokenizer bytes``)."""
UNRECORDED = "unrecorded"
"""Tokenizer identity of token files without a manifest (nanoGPT's layout): unknown."""
RECORD_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
"""Files of records that must be prepared (``prepare-data``), never read as raw bytes."""


def tokenizer_identity(kind: str, sha256: str | None) -> str:
    """The name a run gives the tokenizer of its data (``RunConfig.tokenizer``): ``bytes``,
    or the sha256 of the ``tokenizer.json`` that ``prepare-data`` used (its manifest
    records it). Two corpora with one identity give one token id for one text, whatever
    their texts (docs/design.md "Data and exports")."""
    return BYTES if kind == "bytes" or sha256 is None else sha256


def check_tokenizer_identity(identity: str) -> None:
    """Raise ConfigError unless ``identity`` is one ``tokenizer_identity`` can give."""
    if identity not in (BYTES, UNRECORDED) and not re.fullmatch(r"[0-9a-f]{64}", identity):
        raise ConfigError(
            f"tokenizer must be {BYTES!r}, {UNRECORDED!r} or the 64 lowercase hex digits of "
            f"a tokenizer.json's sha256, got {identity!r}"
        )


def check_tokenizer(run: str, corpus: str, what: str) -> None:
    """Refuse a corpus (``what``) whose tokenizer identity is not the run's, in one line
    that names the fix.

    Raises:
        ConfigError: the identities differ.
    """
    if corpus != run:
        raise ConfigError(
            f"the run trains on {_tokens_of(run)} but {what} holds {_tokens_of(corpus)}; "
            f"{_fix_for(run)}"
        )


def _tokens_of(tokenizer: str) -> str:
    if tokenizer == BYTES:
        return "raw bytes"
    if tokenizer == UNRECORDED:
        return "token files without a manifest (tokenizer unknown)"
    return f"tokens of the tokenizer.json with sha256 {tokenizer[:16]}..."


def _fix_for(tokenizer: str) -> str:
    """How a joiner gets data of the run's ``tokenizer``."""
    if tokenizer == BYTES:
        return "pass text files as --data, or no --data (the embedded corpus)"
    if tokenizer == UNRECORDED:
        return "pass --data token files of the same tokenizer, without a manifest"
    return (
        "get the run's tokenizer.json from its creator (`sha256sum tokenizer.json` must "
        f"print {tokenizer[:16]}...), run `diloco-node prepare-data YOUR_TEXT --tokenizer "
        "tokenizer.json -o tokens/` and pass --data tokens/"
    )


@dataclass(frozen=True)
class CorpusInfo:
    """What a node checks of its corpus against the run before it loads any token."""

    vocab_size: int
    fingerprint: str | None
    tokenizer: str


@dataclass(frozen=True)
class Corpus:
    """Token arrays for training and held-out evaluation (1-D, integer)."""

    train: np.ndarray
    held_out: np.ndarray
    vocab_size: int
    description: str
    fingerprint: str | None = None
    """The token manifest's fingerprint, for a prepared folder; None otherwise."""
    tokenizer: str = BYTES
    """What made the tokens (``tokenizer_identity``): what every node of a run must share."""


def _is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_EVERY == 0


def _text_files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def _byte_corpus(root: Path, files: list[Path], limit: int | None, description: str) -> Corpus:
    train, held_out = bytearray(), bytearray()
    for path in files:
        relative = path.relative_to(root).as_posix() if path != root else path.name
        data = path.read_bytes()
        (held_out if _is_held_out(relative) else train).extend(data)
        if limit is not None and len(train) >= limit:
            break
    if not held_out:  # a single file: hold out its last 5%
        cut = len(train) * 19 // 20
        train, held_out = train[:cut], train[cut:]
    return Corpus(
        train=np.frombuffer(bytes(train), dtype=np.uint8),
        held_out=np.frombuffer(bytes(held_out), dtype=np.uint8),
        vocab_size=256,
        description=description,
    )


_SKIPPED_STDLIB_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def embedded_corpus() -> Corpus:
    """The Python standard library's ``.py`` sources (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_STDLIB_FOLDERS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    files.sort()
    return _byte_corpus(root, files, EMBEDDED_CORPUS_BYTES, f"python stdlib sources ({root})")


TOKENIZER_FILE = "tokenizer.json"
"""A prepared folder's copy of its tokenizer (not part of the manifest)."""

BIN_VOCAB_SIZE = 65536
"""Vocabulary of uint16 token files without a manifest (all that their dtype can hold)."""


def _source(path: str | Path) -> tuple[Path, str]:
    """``path`` (a manifest's folder for a manifest) and its kind: ``prepared``,
    ``bin_folder``, ``bin_file``, ``text_folder`` or ``text_file``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.name == MANIFEST_NAME and path.is_file():
        path = path.parent
    if path.is_dir() and (path / MANIFEST_NAME).exists():
        return path, "prepared"
    if path.is_dir() and (path / "train.bin").exists() and (path / "val.bin").exists():
        return path, "bin_folder"
    if path.is_file() and path.suffix == ".bin":
        return path, "bin_file"
    _check_raw_text(path)
    return path, "text_folder" if path.is_dir() else "text_file"


def _check_raw_text(path: Path) -> None:
    """Refuse to read a tokenizer or files of records as raw bytes (a node would train on
    JSON syntax or Parquet pages without a word of warning).

    Raises:
        ConfigError: naming the ``prepare-data`` command that makes usable tokens.
    """
    files = _text_files(path, "*") if path.is_dir() else [path]
    if path.is_file() and _is_tokenizer(path):
        raise ConfigError(
            f"{path} is a tokenizer, not data: prepare text with it (`diloco-node prepare-data "
            f"TEXT --tokenizer {path} -o tokens/`) and pass the folder tokens/ as the data"
        )
    records = [f for f in files if f.suffix in RECORD_SUFFIXES]
    if records:
        raise ConfigError(
            f"{path} holds files of records ({records[0].name}), not raw text: prepare them "
            f"(`diloco-node prepare-data {path} --tokenizer TOKENIZER -o tokens/`, with the "
            "run's tokenizer) and pass the folder tokens/ as the data"
        )


def _is_tokenizer(path: Path) -> bool:
    """A Hugging Face ``tokenizer.json``: a JSON object with a ``model`` and ``added_tokens``."""
    if path.suffix != ".json":
        return False
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, OSError):
        return False
    return isinstance(data, dict) and "model" in data and "added_tokens" in data


def corpus_info(path: str | Path | None) -> CorpusInfo:
    """Vocabulary size, manifest fingerprint and tokenizer identity of ``load_corpus(path)``,
    read without its tokens: what a node checks against the run before it starts anything.

    Raises:
        ConfigError: a tokenizer or files of records given as raw data (``_check_raw_text``).
    """
    if path is None:
        return CorpusInfo(256, None, BYTES)
    path, kind = _source(path)
    if kind == "prepared":
        manifest = read_manifest(path)
        t = manifest.tokenizer
        return CorpusInfo(t.vocab_size, manifest.fingerprint, tokenizer_identity(t.kind, t.sha256))
    if kind in ("bin_folder", "bin_file"):
        return CorpusInfo(BIN_VOCAB_SIZE, None, UNRECORDED)
    return CorpusInfo(256, None, BYTES)


def tokenizer_file(path: str | Path | None) -> Path | None:
    """The ``tokenizer.json`` that made a prepared corpus, if its folder holds it (as
    ``prepare-data`` leaves it) with the sha256 its manifest names; else None."""
    if path is None:
        return None
    folder, kind = _source(path)
    candidate = folder / TOKENIZER_FILE
    if kind != "prepared" or not candidate.is_file():
        return None
    expected = read_manifest(folder).tokenizer.sha256
    return candidate if expected is not None and file_sha256(candidate) == expected else None


def export_tokenizer(path: str | Path | None, tokenizer: str) -> Path | str | None:
    """What an export of a model trained on ``load_corpus(path)`` carries as its tokenizer
    (``hf_export.export_hf``): ``BYTES`` for raw bytes, the prepared folder's
    ``tokenizer.json``, or None (token files of unknown origin, or a prepared folder whose
    ``tokenizer.json`` is gone)."""
    return BYTES if tokenizer == BYTES else tokenizer_file(path)


def load_corpus(path: str | Path | None = None) -> Corpus:
    """The corpus at ``path`` (see the module docstring), or the embedded one."""
    if path is None:
        return embedded_corpus()
    path, kind = _source(path)
    if kind == "prepared":
        return prepared_corpus(path)
    if kind == "bin_folder":
        return Corpus(
            train=np.memmap(path / "train.bin", dtype=np.uint16, mode="r"),
            held_out=np.memmap(path / "val.bin", dtype=np.uint16, mode="r"),
            vocab_size=BIN_VOCAB_SIZE,
            description=f"token files in {path}",
            tokenizer=UNRECORDED,
        )
    if kind == "bin_file":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        cut = len(tokens) * 19 // 20
        return Corpus(
            tokens[:cut], tokens[cut:], BIN_VOCAB_SIZE, f"token file {path}", tokenizer=UNRECORDED
        )
    if kind == "text_folder":
        files = _text_files(path, "*")
        return _byte_corpus(path, files, None, f"text files in {path}")
    return _byte_corpus(path, [path], None, f"text file {path}")


def prepared_corpus(folder: Path) -> Corpus:
    """The token folder of ``diloco.node.data.prepare``, checked against its manifest."""
    manifest = read_manifest(folder)
    train: np.ndarray = np.memmap(folder / manifest.train.file, dtype=manifest.dtype, mode="r")
    held_out: np.ndarray
    if manifest.val.tokens:
        held_out = np.memmap(folder / manifest.val.file, dtype=manifest.dtype, mode="r")
    else:  # no document drew the held-out lot (a tiny corpus): the last 5%, as for one .bin
        cut = len(train) * 19 // 20
        train, held_out = train[:cut], train[cut:]
    tokenizer = manifest.tokenizer
    return Corpus(
        train=train,
        held_out=held_out,
        vocab_size=tokenizer.vocab_size,
        description=f"{manifest.train.tokens:,} {tokenizer.name} tokens in {folder}",
        fingerprint=manifest.fingerprint,
        tokenizer=tokenizer_identity(tokenizer.kind, tokenizer.sha256),
    )


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from one array, with its own generator.

    The generator state is the whole data position: ``state_dict`` / ``load_state_dict``
    make a resumed run read exactly the batches an uninterrupted one would.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (B, T) int64."""
        starts = torch.randint(
            0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.generator
        )
        rows = [
            torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
            for s in starts.tolist()
        ]
        window = torch.stack(rows)  # (B, T+1)
        self.batches_drawn += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_batches(
    tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of held-out batches, so every evaluation sees the same tokens."""
    sampler = BatchSampler(tokens, batch_size, seq_len, seed)
    return [sampler.next_batch() for _ in range(num_batches)]


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | None = None,
) -> float:
    """Mean cross-entropy (no z-loss) of ``model`` over fixed held-out ``batches``."""
    was_training = model.training
    model.eval()
    total = 0.0
    for inputs, targets in batches:
        logits, _ = model(inputs.to(device) if device else inputs)
        targets = targets.to(device) if device else targets
        total += torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)).float(), targets.reshape(-1)
        ).item()
    model.train(was_training)
    return total / len(batches)
