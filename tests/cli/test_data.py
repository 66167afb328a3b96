"""``prepare-data`` through CliRunner on a small JSONL file with a BPE tokenizer.json."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bpe_corpus import write_bpe_corpus
from click.testing import CliRunner
from tokenizers import Tokenizer

from diloco.cli import main
from diloco.errors import ConfigError
from diloco.node.data import prepare as prepare_data
from diloco.node.data.prepare import Shard, _encode_in_worker, _init_worker


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("inputs")
    return root, write_bpe_corpus(root)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_prepare_data_writes_the_tokens_of_tokenizers_and_a_manifest(
    inputs: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, texts = inputs
    out = tmp_path / "tokens"
    code, output = invoke(
        "prepare-data", str(root / "docs.jsonl"), "--tokenizer", str(root / "tokenizer.json"),
        "-o", str(out), "--val-fraction", "0", "--processes", "2", "--shard-bytes", "2000",
    )  # fmt: skip
    assert code == 0, output
    reference = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = reference.token_to_id("<|endoftext|>")
    expected = [i for text in texts for i in [*reference.encode(text).ids, eos]]
    assert np.fromfile(out / "train.bin", dtype=np.uint16).tolist() == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train"]["tokens"] == len(expected)
    assert manifest["train"]["documents"] == len(texts)
    assert manifest["tokenizer"]["vocab_size"] == reference.get_vocab_size()
    assert f"fingerprint {manifest['fingerprint']}" in output
    assert f"--dataset-fingerprint {manifest['fingerprint']}" in output
    assert (out / "tokenizer.json").read_bytes() == (root / "tokenizer.json").read_bytes()
    sha = hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["tokenizer"]["sha256"] == sha and f"tokenizer sha256 {sha}" in output


def test_prepare_data_with_bytes_is_the_utf8_of_the_texts(
    inputs: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, texts = inputs
    code, output = invoke(
        "prepare-data", str(root / "docs.jsonl"), "-o", str(tmp_path), "--val-fraction", "0",
        "--processes", "1",
    )  # fmt: skip
    assert code == 0, output
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tobytes()
    assert np.frombuffer(tokens, dtype=np.uint16).astype(np.uint8).tobytes() == "".join(
        texts
    ).encode("utf-8")
    assert not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "give INPUTS files or folders, or --hf-dataset NAME"),
        (["--hf-dataset", "x/y", "{docs}"], 2, "not both"),
        (["{docs}", "--val-fraction", "1.5"], 2, "val_fraction must be in [0, 1)"),
        (["/missing.jsonl"], 2, "'/missing.jsonl' does not exist"),
        (["{docs}", "--tokenizer", "{docs}"], 1, "cannot load tokenizer"),
        (["{docs}", "--text-field", "body"], 1, "no text found for training (field 'body')"),
    ],
)
def test_prepare_data_names_the_fix(
    inputs: tuple[Path, list[str]], tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    docs = str(inputs[0] / "docs.jsonl")
    argv = [a.replace("{docs}", docs) for a in args]
    result = invoke("prepare-data", *argv, "-o", str(tmp_path / "out"), "--processes", "1")
    assert result[0] == code, result[1]
    assert message in result[1]


def test_a_missing_tokenizer_with_workers_is_one_line_before_any_worker(
    inputs: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """In a child process with a bound: a failing pool initializer restarts workers for
    ever, which would hang this test instead of failing it. The bound is against that, not
    a speed claim: at the idle lane's priority the child, which imports torch, once had
    printed its error and not exited after 120 s while the other lanes held the cores."""
    command = [
        *(sys.executable, "-c", "from diloco.cli import main; main()", "prepare-data"),
        *(str(inputs[0] / "docs.jsonl"), "--tokenizer", str(tmp_path / "nope.json")),
        *("-o", str(tmp_path / "out"), "--processes", "2", "--shard-bytes", "2000"),
    ]  # several shards: a pool of 2 workers
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"prepare-data still runs after 600 s: {error.stderr!r:.2000}")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"Error: cannot load tokenizer {tmp_path / 'nope.json'}: No such file or directory "
        "(os error 2)"
    ]


def test_a_worker_that_cannot_load_the_tokenizer_fails_its_first_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not its initializer: ``Pool`` would replace a worker whose initializer raised."""
    monkeypatch.setattr(prepare_data, "_worker_encoder", None)  # restored after the test
    _init_worker("/nonexistent/tokenizer.json", None, "text", 0.0)
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        _encode_in_worker(Shard("dataset", "x", documents=("a",)))
