"""Offline data preparation: text, JSONL or Parquet files, or a Hugging Face dataset, into
the token folder the node trains on (nanoGPT's ``prepare.py`` step; STYLE, "data").

The folder holds ``train.bin`` and ``val.bin`` (flat token ids, documents back to back,
each followed by the tokenizer's end-of-text token when it has one) and ``manifest.json``
(``diloco.node.data.manifest``), written last: a folder with a manifest is complete.

Inputs are cut into shards: a byte range of whole lines of a JSONL or text file, one row
group of a Parquet file, or a list of documents streamed from a dataset. Worker processes
read, parse and tokenize shards; the main process writes their tokens in input order, so
the output does not depend on the number of processes. A JSONL line or Parquet row is one
document (its ``text_field``); a text file is one document (cut at line ends into shards,
which may tokenize a seam differently from the whole file). A document goes to
``val.bin`` when the crc32 of its text (a text file: of its name) falls in the first
``val_fraction`` of the range: a pure function of the document, stable under re-sharding,
that sends duplicates to the same side.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.pool
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diloco.errors import ConfigError
from diloco.node.data.manifest import (
    MANIFEST_NAME,
    InputRecord,
    Manifest,
    SplitRecord,
    file_sha256,
    token_dtype,
)
from diloco.node.data.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

SUFFIX_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
"""File suffixes read, and how; other files in an input folder are ignored."""

ProgressCallback = Callable[[int, int], None]
"""Called after each shard with (input bytes done, total input bytes; 0 when unknown)."""


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """One preparation run (the options of ``diloco-node prepare-data``)."""

    inputs: list[str]
    """Files or folders (searched recursively for the suffixes of ``SUFFIX_FORMATS``);
    unused by ``prepare_hf_dataset``."""
    output: str
    """Folder to write ``train.bin``, ``val.bin`` and ``manifest.json`` into."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` (or a folder holding one); None or ``bytes``: byte tokens."""
    eos_token: str | None = None
    """End-of-text token appended to each document; None looks for a usual one."""
    text_field: str = "text"
    """JSONL key or Parquet column holding a document's text."""
    val_fraction: float = 0.005
    """Share of documents held out for evaluation, in [0, 1)."""
    processes: int = 0
    """Worker processes; 0: one per CPU core; 1: all in this process."""
    shard_bytes: int = 4 * 2**20
    """Bytes of a JSONL or text file per unit of work."""

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.processes < 0 or self.shard_bytes < 1:
            raise ConfigError("need processes >= 0 (0: one per core) and shard_bytes >= 1")


@dataclass(frozen=True, slots=True)
class Shard:
    """One unit of work (see the module docstring)."""

    format: str
    name: str
    path: str | None = None
    start: int = 0
    """jsonl/text: first byte; parquet: row group index."""
    stop: int = 0
    """jsonl/text: byte after the last."""
    ends_file: bool = True
    """text: whether this shard ends its file (the document's end-of-text goes there)."""
    documents: tuple[str | None, ...] = ()
    """dataset: texts (None for a record without text)."""
    size_bytes: int = 0


@dataclass(slots=True)
class ShardTokens:
    train: np.ndarray
    val: np.ndarray
    train_documents: int
    val_documents: int
    skipped: int
    size_bytes: int


@dataclass(slots=True)
class _Encoder:
    """What a worker needs: the tokenizer and the split rule."""

    tokenizer: Tokenizer
    text_field: str
    val_fraction: float
    dtype: str = field(init=False)

    def __post_init__(self) -> None:
        self.dtype = token_dtype(self.tokenizer.record.vocab_size)

    def is_val(self, key: str) -> bool:
        return zlib.crc32(key.encode("utf-8", errors="replace")) < self.val_fraction * 2**32

    def texts(self, shard: Shard) -> tuple[list[str], int]:
        """The shard's documents and how many records had no usable text."""
        if shard.format == "dataset":
            texts = [t for t in shard.documents if isinstance(t, str)]
            return texts, len(shard.documents) - len(texts)
        assert shard.path is not None
        if shard.format == "parquet":
            import pyarrow.parquet as pq

            column = pq.ParquetFile(shard.path).read_row_group(
                shard.start, columns=[self.text_field]
            )
            values = column.column(0).to_pylist()
            texts = [t for t in values if isinstance(t, str)]
            return texts, len(values) - len(texts)
        with open(shard.path, "rb") as f:
            f.seek(shard.start)
            data = f.read(shard.stop - shard.start)
        if shard.format == "text":
            return [data.decode("utf-8", errors="replace")], 0
        texts, skipped = [], 0
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                text = json.loads(line).get(self.text_field)
            except (ValueError, AttributeError):  # bad JSON, or JSON that is not an object
                text = None
            if isinstance(text, str):
                texts.append(text)
            else:
                skipped += 1
        return texts, skipped

    def encode(self, shard: Shard) -> ShardTokens:
        texts, skipped = self.texts(shard)
        eos = self.tokenizer.record.eos_id
        ends = [] if eos is None or (shard.format == "text" and not shard.ends_file) else [eos]
        train: list[list[int]] = []
        val: list[list[int]] = []
        for text, ids in zip(texts, self.tokenizer.encode_batch(texts), strict=True):
            key = shard.name if shard.format == "text" else text
            (val if self.is_val(key) else train).append(ids + ends)
        counted = shard.format != "text" or shard.ends_file  # a text file counts once
        return ShardTokens(
            train=_flat(train, self.dtype),
            val=_flat(val, self.dtype),
            train_documents=len(train) if counted else 0,
            val_documents=len(val) if counted else 0,
            skipped=skipped,
            size_bytes=shard.size_bytes,
        )


def _flat(documents: list[list[int]], dtype: str) -> np.ndarray:
    count = sum(len(d) for d in documents)
    return np.fromiter(itertools.chain.from_iterable(documents), dtype=dtype, count=count)


_worker_encoder: _Encoder | ConfigError | None = None


def _init_worker(tokenizer: str | None, eos_token: str | None, field: str, val: float) -> None:
    """A worker's encoder, or the error that prevents one: raised by its first task, once.
    An initializer that raises makes ``Pool`` start a new worker for ever."""
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    try:
        _worker_encoder = _Encoder(load_tokenizer(tokenizer, eos_token), field, val)
    except ConfigError as error:
        _worker_encoder = error


def _encode_in_worker(shard: Shard) -> ShardTokens:
    assert _worker_encoder is not None, "worker started without _init_worker"
    if isinstance(_worker_encoder, ConfigError):
        raise _worker_encoder
    return _worker_encoder.encode(shard)


def find_inputs(inputs: Iterable[str]) -> list[tuple[Path, str]]:
    """(file, name) pairs in a fixed order; a folder's files are named relative to it."""
    found: list[tuple[Path, str]] = []
    for given in inputs:
        root = Path(given)
        if root.is_file():
            found.append((root, root.name))
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and _format(p))
            found.extend((p, p.relative_to(root).as_posix()) for p in files)
        else:
            raise ConfigError(f"input {given} does not exist")
    if not found:
        raise ConfigError(f"no {', '.join(SUFFIX_FORMATS)} files in {', '.join(inputs)}")
    for path, _ in found:
        if not _format(path):
            raise ConfigError(f"{path}: unknown format; use one of {', '.join(SUFFIX_FORMATS)}")
    return found


def _format(path: Path) -> str | None:
    return SUFFIX_FORMATS.get(path.suffix.lower())


def plan_shards(path: Path, name: str, text_field: str, shard_bytes: int) -> list[Shard]:
    """The shards of one input file, in order."""
    fmt = _format(path)
    size = path.stat().st_size
    if fmt == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            columns = ", ".join(parquet.schema_arrow.names)
            raise ConfigError(f"{path} has no column {text_field!r} (it has {columns})")
        groups = parquet.metadata.num_row_groups
        return [
            Shard(
                "parquet",
                name,
                str(path),
                start=i,
                size_bytes=(i + 1) * size // groups - i * size // groups,
            )
            for i in range(groups)
        ]
    assert fmt is not None
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + shard_bytes < size:
            f.seek(bounds[-1] + shard_bytes)
            f.readline()  # to the end of the line in progress: shards hold whole lines
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [
        Shard(fmt, name, str(path), start=a, stop=b, ends_file=b == size, size_bytes=b - a)
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]


def prepare(config: PrepareConfig, on_progress: ProgressCallback | None = None) -> Manifest:
    """Tokenize the files of ``config`` into ``config.output``; returns the manifest."""
    if not config.inputs:
        raise ConfigError("give at least one input file or folder")
    tokenizer = load_tokenizer(config.tokenizer, config.eos_token)  # a bad one: before workers
    files = find_inputs(config.inputs)
    shards = [
        s
        for path, name in files
        for s in plan_shards(path, name, config.text_field, config.shard_bytes)
    ]
    processes = min(config.processes or os.cpu_count() or 1, max(1, len(shards)))
    with _Workers(config, processes) as pool:
        hashes = pool.map(file_sha256, [p for p, _ in files]) if pool else None
        records = [
            InputRecord(
                name=name,
                format=_format(path) or "",
                bytes=path.stat().st_size,
                sha256=hashes[i] if hashes else file_sha256(path),
            )
            for i, (path, name) in enumerate(files)
        ]
        total = sum(s.size_bytes for s in shards)
        return _write(
            config, tokenizer, shards, lambda: records, total, pool, processes, on_progress
        )


def prepare_hf_dataset(
    config: PrepareConfig,
    name: str,
    split: str = "train",
    subset: str | None = None,
    documents_per_shard: int = 1000,
    on_progress: ProgressCallback | None = None,
) -> Manifest:
    """Like ``prepare``, reading Hugging Face dataset ``name`` (streamed; needs internet and
    the ``datasets`` package) instead of ``config.inputs``, which is ignored."""
    tokenizer = load_tokenizer(config.tokenizer, config.eos_token)  # a bad one: before workers
    try:
        import datasets
    except ModuleNotFoundError as error:
        raise ConfigError("a Hugging Face dataset needs: pip install datasets") from error
    records = iter(datasets.load_dataset(name, subset, split=split, streaming=True))
    label = f"{name}/{subset or ''}:{split}"
    size = 0

    def shards() -> Iterator[Shard]:
        nonlocal size
        while batch := list(itertools.islice(records, documents_per_shard)):
            texts = tuple(r.get(config.text_field) for r in batch)
            nbytes = sum(len(t.encode()) for t in texts if isinstance(t, str))
            size += nbytes
            yield Shard("dataset", label, documents=texts, size_bytes=nbytes)

    def inputs() -> list[InputRecord]:
        return [InputRecord(name=label, format="dataset", bytes=size, sha256=None)]

    processes = config.processes or os.cpu_count() or 1
    with _Workers(config, processes) as pool:
        return _write(config, tokenizer, shards(), inputs, 0, pool, processes, on_progress)


class _Workers:
    """A spawn-context pool of ``processes`` encoders, or None to encode in this process."""

    def __init__(self, config: PrepareConfig, processes: int) -> None:
        self.config = config
        self.processes = processes
        self.pool: multiprocessing.pool.Pool | None = None

    def __enter__(self) -> multiprocessing.pool.Pool | None:
        if self.processes > 1:
            c = self.config
            # spawn, not fork: the parent may hold torch or tokenizers threads.
            self.pool = multiprocessing.get_context("spawn").Pool(
                self.processes,
                initializer=_init_worker,
                initargs=(c.tokenizer, c.eos_token, c.text_field, c.val_fraction),
            )
        return self.pool

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _in_order(
    pool: multiprocessing.pool.Pool, shards: Iterable[Shard], window: int
) -> Iterator[ShardTokens]:
    """Encoded shards in input order, at most ``window`` in flight: unlike ``Pool.imap``,
    which queues its whole input at once, this keeps a streamed dataset out of memory."""
    pending: deque[multiprocessing.pool.AsyncResult[ShardTokens]] = deque()
    for shard in shards:
        pending.append(pool.apply_async(_encode_in_worker, (shard,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write(
    config: PrepareConfig,
    tokenizer: Tokenizer,
    shards: Iterable[Shard],
    inputs: Callable[[], list[InputRecord]],
    total_bytes: int,
    pool: multiprocessing.pool.Pool | None,
    processes: int,
    on_progress: ProgressCallback | None,
) -> Manifest:
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # no stale manifest over partial files
    if pool is None:
        encoder = _Encoder(tokenizer, config.text_field, config.val_fraction)
        results: Iterable[ShardTokens] = map(encoder.encode, shards)
    else:
        results = _in_order(pool, shards, window=2 * processes)
    splits = {"train": _SplitWriter(out / "train.bin"), "val": _SplitWriter(out / "val.bin")}
    skipped = done = 0
    try:
        for result in results:
            splits["train"].add(result.train, result.train_documents)
            splits["val"].add(result.val, result.val_documents)
            skipped += result.skipped
            done += result.size_bytes
            if on_progress:
                on_progress(done, total_bytes)
    finally:
        for writer in splits.values():
            writer.file.close()
    if splits["train"].tokens == 0:
        raise ConfigError(f"no text found for training (field {config.text_field!r})")
    manifest = Manifest(
        tokenizer=tokenizer.record,
        inputs=tuple(inputs()),
        text_field=config.text_field,
        val_fraction=config.val_fraction,
        dtype=token_dtype(tokenizer.record.vocab_size),
        train=splits["train"].record(),
        val=splits["val"].record(),
        skipped_documents=skipped,
    )
    if skipped:
        logger.warning("left out %d records without a %r string", skipped, config.text_field)
    (out / MANIFEST_NAME).write_text(manifest.serialize())
    return manifest


class _SplitWriter:
    """Appends token arrays to one ``.bin`` file, hashing and counting as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 (closed by _write)
        self.digest = hashlib.sha256()
        self.tokens = 0
        self.documents = 0

    def add(self, tokens: np.ndarray, documents: int) -> None:
        data = tokens.tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.tokens += len(tokens)
        self.documents += documents

    def record(self) -> SplitRecord:
        return SplitRecord(
            file=self.path.name,
            documents=self.documents,
            tokens=self.tokens,
            sha256=self.digest.hexdigest(),
        )
