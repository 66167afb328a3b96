"""prepare-data on small local files: the tokens and manifest are what `tokenizers` gives."""

import hashlib
import json
import sys
import types
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco.errors import ConfigError
from diloco.node.data.corpus import load_corpus
from diloco.node.data.manifest import read_manifest
from diloco.node.data.prepare import PrepareConfig, prepare, prepare_hf_dataset
from diloco.node.training.local import LocalConfig, LocalTrainer

WORDS = ["the", "a", "swarm", "of", "nodes", "trains", "model", "café", "naïve", "東京", "42"]


def _documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + f" #{seed}-{i}."
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A BPE tokenizer.json trained here, a JSONL file (with 3 bad records) and a Parquet file
    of 4 row groups."""
    root = tmp_path_factory.mktemp("inputs")
    jsonl_docs, parquet_docs = _documents(60, 1), _documents(70, 2)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(jsonl_docs + parquet_docs, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(jsonl_docs)]
    lines[10:10] = ["{not json", json.dumps({"id": -1}), json.dumps({"text": None})]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    table = pa.table({"text": parquet_docs, "n": list(range(len(parquet_docs)))})
    pq.write_table(table, root / "docs.parquet", row_group_size=20)
    return root, jsonl_docs + parquet_docs


def _config(root, out, **overrides) -> PrepareConfig:
    base = dict(
        inputs=[str(root / "docs.jsonl"), str(root / "docs.parquet")],
        output=str(out),
        tokenizer=str(root / "tokenizer.json"),
        val_fraction=0.0,
        processes=1,
    )
    base.update(overrides)
    return PrepareConfig(**base)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepare_jsonl_and_parquet_gives_the_tokens_of_tokenizers(files, tmp_path) -> None:
    root, documents = files
    manifest = prepare(_config(root, tmp_path))
    reference = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = reference.token_to_id("<|endoftext|>")
    expected = [i for d in documents for i in [*reference.encode(d).ids, eos]]
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert tokens.tolist() == expected
    assert (tmp_path / "val.bin").stat().st_size == 0

    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["tokenizer"] == {
        "kind": "tokenizers",
        "name": "tokenizer.json",
        "sha256": _sha256(root / "tokenizer.json"),
        "vocab_size": reference.get_vocab_size(),
        "eos_id": eos,
    }
    assert written["inputs"] == [
        {"name": n, "format": f, "bytes": (root / n).stat().st_size, "sha256": _sha256(root / n)}
        for n, f in [("docs.jsonl", "jsonl"), ("docs.parquet", "parquet")]
    ]
    assert written["dtype"] == "uint16" and written["skipped_documents"] == 3
    assert written["train"] == {
        "file": "train.bin",
        "documents": len(documents),
        "tokens": len(expected),
        "sha256": _sha256(tmp_path / "train.bin"),
    }
    assert (
        written["val"]["tokens"] == 0 and written["val"]["sha256"] == hashlib.sha256().hexdigest()
    )
    assert written["fingerprint"] == manifest.fingerprint == read_manifest(tmp_path).fingerprint


def test_prepare_splits_documents_by_crc32_of_their_text(files, tmp_path) -> None:
    root, documents = files
    manifest = prepare(_config(root, tmp_path, val_fraction=0.3))
    reference = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = reference.token_to_id("<|endoftext|>")
    held = [zlib.crc32(d.encode()) < 0.3 * 2**32 for d in documents]
    assert 10 < sum(held) < len(documents) - 10
    for name, side in (("train.bin", False), ("val.bin", True)):
        expected = [
            i
            for d, h in zip(documents, held, strict=True)
            if h == side
            for i in [*reference.encode(d).ids, eos]
        ]
        assert np.fromfile(tmp_path / name, dtype=np.uint16).tolist() == expected
    assert manifest.val.documents == sum(held)


def test_prepare_with_worker_processes_and_small_shards_writes_the_same(files, tmp_path) -> None:
    root, _ = files
    one = prepare(_config(root, tmp_path / "one", val_fraction=0.2))
    progress: list[tuple[int, int]] = []
    two = prepare(
        _config(root, tmp_path / "two", val_fraction=0.2, processes=2, shard_bytes=1000),
        on_progress=lambda done, total: progress.append((done, total)),
    )
    assert two == one and two.fingerprint == one.fingerprint
    total = sum((root / n).stat().st_size for n in ("docs.jsonl", "docs.parquet"))
    assert len(progress) > 4 + 4 and progress[-1] == (total, total)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)


def test_prepared_folder_loads_as_a_corpus_the_node_trains_on(files, tmp_path) -> None:
    root, _ = files
    manifest = prepare(_config(root, tmp_path, val_fraction=0.2))
    corpus = load_corpus(tmp_path / "manifest.json")
    assert corpus.vocab_size == manifest.tokenizer.vocab_size > 256
    assert corpus.fingerprint == manifest.fingerprint
    assert (
        len(corpus.train) == manifest.train.tokens and len(corpus.held_out) == manifest.val.tokens
    )
    config = LocalConfig(steps=2, batch_size=2, seq_len=16, eval_batches=1, log_every=1000)
    trainer = LocalTrainer(config, corpus)
    assert trainer.model_config.vocab_size == corpus.vocab_size
    assert np.isfinite(trainer.train()["eval_loss"])


def test_prepared_folder_without_val_documents_holds_out_the_last_tokens(files, tmp_path) -> None:
    root, _ = files
    manifest = prepare(_config(root, tmp_path))
    corpus = load_corpus(tmp_path)
    cut = manifest.train.tokens * 19 // 20
    assert len(corpus.train) == cut and len(corpus.held_out) == manifest.train.tokens - cut


def test_prepare_text_files_with_bytes_is_their_bytes(tmp_path) -> None:
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first line\nsecond line\n" * 50)
    (folder / "sub" / "b.md").write_text("# title\nbody ü\n")
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    manifest = prepare(
        PrepareConfig(inputs=[str(folder)], output=str(tmp_path / "out"), shard_bytes=100)
    )
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    expected = (folder / "a.txt").read_bytes() + (folder / "sub" / "b.md").read_bytes()
    assert tokens.tolist() == list(expected)
    assert [i.name for i in manifest.inputs] == ["a.txt", "sub/b.md"]
    assert manifest.tokenizer.kind == "bytes" and manifest.tokenizer.eos_id is None
    assert manifest.train.documents == 2


def test_prepare_names_the_fix_for_bad_inputs(files, tmp_path) -> None:
    root, _ = files
    with pytest.raises(ConfigError, match="no column 'body'"):
        prepare(_config(root, tmp_path, text_field="body", inputs=[str(root / "docs.parquet")]))
    with pytest.raises(ConfigError, match="no text found"):
        prepare(_config(root, tmp_path, text_field="body", inputs=[str(root / "docs.jsonl")]))
    with pytest.raises(ConfigError, match="does not exist"):
        prepare(_config(root, tmp_path, inputs=[str(root / "missing.jsonl")]))
    with pytest.raises(ConfigError, match="unknown format"):
        prepare(_config(root, tmp_path, inputs=[str(root / "tokenizer.json")]))
    with pytest.raises(ConfigError, match="val_fraction"):
        _config(root, tmp_path, val_fraction=1.0)
    with pytest.raises(ConfigError, match="not in"):
        prepare(_config(root, tmp_path, eos_token="<eos>"))


def test_prepare_hf_dataset_streams_records_like_a_jsonl_file(files, tmp_path, monkeypatch) -> None:
    """``datasets`` replaced by a stand-in (no network here): the streamed records give the
    tokens that the same records in a JSONL file give."""
    root, _ = files
    records = [json.loads(line) for line in _good_lines(root / "docs.jsonl")]
    calls = []

    def load_dataset(name, subset, split, streaming):
        calls.append((name, subset, split, streaming))
        return iter(records)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    config = _config(root, tmp_path / "hf", inputs=[], val_fraction=0.2)
    streamed = prepare_hf_dataset(config, "org/corpus", documents_per_shard=7)
    from_file = prepare(
        _config(root, tmp_path / "file", inputs=[str(root / "docs.jsonl")], val_fraction=0.2)
    )
    assert calls == [("org/corpus", None, "train", True)]
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "file" / name).read_bytes()
    assert streamed.train == from_file.train and streamed.skipped_documents == 2
    assert [(i.name, i.format, i.sha256) for i in streamed.inputs] == [
        ("org/corpus/:train", "dataset", None)
    ]


def _good_lines(path) -> list[str]:
    """The JSONL lines that parse as JSON (the stand-in dataset yields parsed records)."""
    lines = []
    for line in path.read_text().splitlines():
        try:
            json.loads(line)
        except ValueError:
            continue
        lines.append(line)
    return lines
