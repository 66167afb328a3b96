"""A token folder's manifest: round trip, fingerprint, and files checked against it."""

import json

import numpy as np
import pytest

from diloco.errors import ConfigError
from diloco.node.data.corpus import load_corpus
from diloco.node.data.manifest import (
    InputRecord,
    Manifest,
    SplitRecord,
    TokenizerRecord,
    read_manifest,
    token_dtype,
)

EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def _manifest(tokens: int = 100, vocab: int = 256, train_file: str = "train.bin") -> Manifest:
    return Manifest(
        tokenizer=TokenizerRecord(
            kind="bytes", name="bytes", sha256=None, vocab_size=vocab, eos_id=None
        ),
        inputs=(InputRecord(name="a.txt", format="text", bytes=tokens, sha256="00" * 32),),
        text_field="text",
        val_fraction=0.0,
        dtype=token_dtype(vocab),
        train=SplitRecord(file=train_file, documents=1, tokens=tokens, sha256="11" * 32),
        val=SplitRecord(file="val.bin", documents=0, tokens=0, sha256=EMPTY_SHA),
        skipped_documents=0,
    )


def test_token_dtype_is_the_narrowest_that_fits() -> None:
    assert token_dtype(256) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(151_936) == "uint32"


def test_manifest_round_trips_and_fingerprints_its_content() -> None:
    manifest = _manifest()
    assert Manifest.parse(manifest.serialize()) == manifest
    assert _manifest(tokens=101).fingerprint != manifest.fingerprint
    assert len(manifest.fingerprint) == 64


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d["train"].update(tokens=99), "fingerprint"),
        (lambda d: d.update(version=2), "not a diloco-tokens v1"),
        (lambda d: d.pop("dtype"), "dtype"),
        (lambda d: d.update(dtype="uint32"), "does not fit"),
        (lambda d: d["val"].update(file="../../etc/x.bin"), "not a .bin name"),
    ],
)
def test_manifest_parse_rejects_an_edited_or_broken_file(change, message) -> None:
    data = json.loads(_manifest().serialize())
    change(data)
    with pytest.raises(ConfigError, match=message):
        Manifest.parse(json.dumps(data))


def test_read_manifest_checks_the_token_files(tmp_path) -> None:
    manifest = _manifest(tokens=100)
    (tmp_path / "manifest.json").write_text(manifest.serialize())
    (tmp_path / "val.bin").write_bytes(b"")
    np.arange(99, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match="100 uint16 tokens"):
        load_corpus(tmp_path)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert read_manifest(tmp_path) == manifest  # sizes agree; contents not read
    with pytest.raises(ConfigError, match="sha256"):
        read_manifest(tmp_path, verify=True)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="bad token manifest"):
        load_corpus(tmp_path)
