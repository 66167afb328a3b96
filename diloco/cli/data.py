"""``prepare-data``: text, JSONL or Parquet files (or a Hugging Face dataset) into the token
folder a node trains on (``diloco.node.data.prepare``), with a progress bar.

Bad options are ``click.UsageError`` (exit 2), found before any work starts; failures while
preparing are ``click.ClickException`` (exit 1).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import click

from diloco.errors import ConfigError
from diloco.node.data.corpus import BYTES, TOKENIZER_FILE, tokenizer_identity
from diloco.node.data.manifest import Manifest
from diloco.node.data.prepare import PrepareConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}


@click.command("prepare-data")
@click.argument("inputs", nargs=-1, type=click.Path(exists=True))
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder to write train.bin, val.bin, manifest.json (and the tokenizer.json) into.",
)
@click.option(
    "--tokenizer",
    default="bytes",
    help="A Hugging Face tokenizer.json (or a folder holding one), or `bytes`.",
)
@click.option(
    "--eos-token",
    default=_DEFAULTS["eos_token"],
    help="End-of-text token after each document [default: <|endoftext|>, </s>, ... if any].",
)
@click.option("--text-field", default=_DEFAULTS["text_field"], help="JSONL key / Parquet column.")
@click.option(
    "--val-fraction",
    type=float,
    default=_DEFAULTS["val_fraction"],
    help="Share of documents held out for evaluation, e.g. 0.005.",
)
@click.option(
    "--processes",
    type=int,
    default=_DEFAULTS["processes"],
    help="Worker processes (0: one per CPU core; 1: none).",
)
@click.option(
    "--shard-bytes",
    type=int,
    default=_DEFAULTS["shard_bytes"],
    help="Bytes of a JSONL or text file per unit of work.",
)
@click.option(
    "--hf-dataset",
    default=None,
    help="Read this Hugging Face dataset (streamed; needs internet and `datasets`) "
    "instead of INPUTS, e.g. HuggingFaceFW/fineweb-edu.",
)
@click.option("--subset", default=None, help="The dataset's configuration, e.g. sample-10BT.")
@click.option("--split", default="train", help="The dataset's split.")
def prepare_data(
    inputs: tuple[str, ...],
    output: str,
    hf_dataset: str | None,
    subset: str | None,
    split: str,
    **options: Any,
) -> None:
    """Tokenize INPUTS (.txt, .md, .jsonl, .parquet files or folders of them) for --data.

    e.g. `diloco-node prepare-data corpus/ --tokenizer tokenizer.json -o tokens/`
    """
    from diloco.node.data.prepare import prepare, prepare_hf_dataset

    if bool(inputs) == bool(hf_dataset):
        raise click.UsageError("give INPUTS files or folders, or --hf-dataset NAME (not both)")
    try:
        config = PrepareConfig(inputs=list(inputs), output=output, **options)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    progress = _Progress()
    try:
        if hf_dataset:
            manifest = prepare_hf_dataset(
                config, hf_dataset, split=split, subset=subset, on_progress=progress
            )
        else:
            manifest = prepare(config, on_progress=progress)
    except ConfigError as error:
        raise click.ClickException(str(error)) from error
    finally:
        progress.close()
    if manifest.tokenizer.kind == "tokenizers" and config.tokenizer is not None:
        source = Path(config.tokenizer)
        source = source / TOKENIZER_FILE if source.is_dir() else source
        shutil.copyfile(source, Path(output) / TOKENIZER_FILE)  # for --export-hf
    _echo_summary(manifest, output)


class _Progress:
    """``prepare``'s progress callback: a bar over input bytes, or (a streamed dataset,
    whose size is unknown) a line every few seconds."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.done = 0
        self.printed_at = 0.0

    def __call__(self, done: int, total: int) -> None:
        if total:
            if self.bar is None:
                self.bar = click.progressbar(length=total, label="tokenizing", show_pos=False)
                self.bar.__enter__()
            self.bar.update(done - self.done)
        elif time.monotonic() - self.printed_at > 5.0:
            self.printed_at = time.monotonic()
            click.echo(f"tokenized {done / 1e6:,.1f} MB of text", err=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _echo_summary(manifest: Manifest, output: str) -> None:
    t = manifest.tokenizer
    click.echo(
        f"{manifest.train.tokens:,} training tokens ({manifest.train.documents:,} documents) "
        f"and {manifest.val.tokens:,} held-out tokens ({manifest.val.documents:,}) in {output}; "
        f"tokenizer {t.name} (vocabulary {t.vocab_size:,}); "
        f"{manifest.skipped_documents:,} records without text left out"
    )
    click.echo(f"fingerprint {manifest.fingerprint}")
    identity = tokenizer_identity(t.kind, t.sha256)
    if identity != BYTES:
        click.echo(f"tokenizer sha256 {identity}")
    click.echo(
        f"train on it with `diloco-node start --data {output}` (the run's vocabulary and "
        "tokenizer follow it: a joiner's --data must be prepared with the same tokenizer); add "
        f"`--dataset-fingerprint {manifest.fingerprint}` to make every node use exactly these "
        "tokens"
    )
