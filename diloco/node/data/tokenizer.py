"""Tokenizers: raw bytes, or a Hugging Face ``tokenizers`` ``tokenizer.json``.

Both turn text into ids and describe themselves as a ``TokenizerRecord`` for the data
manifest, so a run can tell which tokenizer made its tokens. ``tokenizers`` is imported
only when a ``tokenizer.json`` is used (the ``data`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from diloco.errors import ConfigError
from diloco.node.data.manifest import TokenizerRecord, file_sha256

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
"""End-of-text tokens looked for, in this order, when none is named."""


class Tokenizer(Protocol):
    record: TokenizerRecord

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without the end-of-text token."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256, no end-of-text token): the CPU presets' own."""

    def __init__(self) -> None:
        self.record = TokenizerRecord(
            kind="bytes", name="bytes", sha256=None, vocab_size=256, eos_id=None
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A ``tokenizer.json`` run by ``tokenizers`` (BPE, Unigram, WordPiece: any it reads).

    Ids are ``Tokenizer.encode(text).ids`` with the file's own post-processing (a BOS token
    where it adds one). The end-of-text token is ``eos_token``, else the first of
    ``EOS_CANDIDATES`` in the vocabulary, else none.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ModuleNotFoundError as error:
            raise ConfigError(
                "a tokenizer.json needs the tokenizers package: pip install 'diloco-node[data]'"
            ) from error
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            self._tokenizer: Any = HFTokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own Exception for any bad file
            raise ConfigError(f"cannot load tokenizer {path}: {error}") from error
        names = [eos_token] if eos_token is not None else list(EOS_CANDIDATES)
        eos_id = next((i for n in names if (i := self._tokenizer.token_to_id(n)) is not None), None)
        if eos_token is not None and eos_id is None:
            raise ConfigError(f"end-of-text token {eos_token!r} is not in {path}")
        self.record = TokenizerRecord(
            kind="tokenizers",
            name=path.name,
            sha256=file_sha256(path),
            vocab_size=self._tokenizer.get_vocab_size(with_added_tokens=True),
            eos_id=eos_id,
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))


def load_tokenizer(spec: str | Path | None = None, eos_token: str | None = None) -> Tokenizer:
    """``None`` or ``"bytes"``: bytes; otherwise a ``tokenizer.json`` (or a folder with one)."""
    if spec is None or str(spec) == "bytes":
        if eos_token is not None:
            raise ConfigError("the byte tokenizer has no end-of-text token to choose")
        return ByteTokenizer()
    return JsonTokenizer(spec, eos_token)
