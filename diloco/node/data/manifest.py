"""The manifest of a prepared token folder: what made the tokens, and what they are.

A folder written by ``diloco.node.data.prepare`` holds ``train.bin``, ``val.bin`` and
``manifest.json``::

    {"format": "diloco-tokens", "version": 1,
     "tokenizer": {"kind", "name", "sha256", "vocab_size", "eos_id"},
     "inputs": [{"name", "format", "bytes", "sha256"}, ...],
     "text_field", "val_fraction", "dtype",
     "train": {"file", "documents", "tokens", "sha256"}, "val": {...},
     "skipped_documents", "fingerprint"}

The manifest holds no absolute paths and no clock, so the same inputs and tokenizer give
the same manifest on every machine; ``fingerprint`` (sha256 of the canonical JSON of the
rest) is what a run configuration can pin to say "these tokens".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco.errors import ConfigError

MANIFEST_NAME = "manifest.json"
FORMAT = "diloco-tokens"
VERSION = 1
DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> str:
    """The narrowest token dtype holding ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerRecord:
    kind: str
    """``bytes`` or ``tokenizers`` (a Hugging Face ``tokenizer.json``)."""
    name: str
    sha256: str | None
    """Of the ``tokenizer.json`` file; None for bytes."""
    vocab_size: int
    eos_id: int | None
    """Token appended after every document, or None (bytes: documents simply abut)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputRecord:
    name: str
    """Path relative to the input argument it was found under (or a dataset's name)."""
    format: str
    """``text``, ``jsonl``, ``parquet`` or ``dataset``."""
    bytes: int
    sha256: str | None
    """Of the file; None for a streamed dataset."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRecord:
    file: str
    documents: int
    tokens: int
    sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    tokenizer: TokenizerRecord
    inputs: tuple[InputRecord, ...]
    text_field: str
    val_fraction: float
    dtype: str
    train: SplitRecord
    val: SplitRecord
    skipped_documents: int
    """Records without usable text (no such field, not a string, bad JSON), left out."""

    def body(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"] = [asdict(i) for i in self.inputs]
        return {"format": FORMAT, "version": VERSION, **data}

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self.body(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def serialize(self) -> str:
        return json.dumps({**self.body(), "fingerprint": self.fingerprint}, indent=2) + "\n"

    @classmethod
    def parse(cls, text: str) -> Manifest:
        """A manifest from its JSON; ``ConfigError`` if anything is missing or off."""
        try:
            data = json.loads(text)
            if (data.get("format"), data.get("version")) != (FORMAT, VERSION):
                raise ValueError(f"not a {FORMAT} v{VERSION} manifest")
            manifest = cls(
                tokenizer=TokenizerRecord(**data["tokenizer"]),
                inputs=tuple(InputRecord(**i) for i in data["inputs"]),
                text_field=data["text_field"],
                val_fraction=data["val_fraction"],
                dtype=data["dtype"],
                train=SplitRecord(**data["train"]),
                val=SplitRecord(**data["val"]),
                skipped_documents=data["skipped_documents"],
            )
            manifest.check()
            if data.get("fingerprint") != manifest.fingerprint:
                raise ValueError("its fingerprint does not match its content")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"bad token manifest ({error}); prepare the data again") from error
        return manifest

    def check(self) -> None:
        if self.dtype not in DTYPES or self.dtype != token_dtype(self.tokenizer.vocab_size):
            raise ValueError(f"dtype {self.dtype!r} does not fit vocabulary of the tokenizer")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction {self.val_fraction} is not in [0, 1)")
        for split in (self.train, self.val):
            if Path(split.file).name != split.file or not split.file.endswith(".bin"):
                raise ValueError(f"token file {split.file!r} is not a .bin name in the folder")
            if split.tokens < 0 or split.documents < 0:
                raise ValueError(f"negative counts in {split.file}")


def read_manifest(folder: str | Path, verify: bool = False) -> Manifest:
    """The manifest of a prepared folder, its token files' sizes checked against it.

    ``verify`` also hashes both token files (a full read: slow for large corpora).
    """
    folder = Path(folder)
    try:
        manifest = Manifest.parse((folder / MANIFEST_NAME).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {folder / MANIFEST_NAME}: {error}") from error
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in (manifest.train, manifest.val):
        path = folder / split.file
        if not path.is_file() or path.stat().st_size != split.tokens * itemsize:
            raise ConfigError(
                f"{path} does not hold the {split.tokens} {manifest.dtype} tokens its manifest "
                "lists; prepare the data again"
            )
        if verify and file_sha256(path) != split.sha256:
            raise ConfigError(f"{path} does not match its manifest's sha256")
    return manifest


def file_sha256(path: str | Path, chunk_bytes: int = 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
