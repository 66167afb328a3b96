"""Tokenizers: bytes, or a tokenizer.json; bad choices name the fix."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from diloco.errors import ConfigError
from diloco.node.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer


def test_byte_tokenizer_is_utf8() -> None:
    tokenizer = load_tokenizer("bytes")
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.record.vocab_size == 256
    assert tokenizer.encode_batch(["hé"]) == [[104, 195, 169]]
    assert tokenizer.decode([104, 195, 169]) == "hé"
    with pytest.raises(ConfigError, match="no end-of-text"):
        load_tokenizer(None, eos_token="</s>")


def test_json_tokenizer_finds_its_end_of_text_token(tmp_path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>", "</s>"])
    tokenizer.train_from_iterator(["some text to learn merges from"] * 10, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert isinstance(loaded, JsonTokenizer)
    assert loaded.record.eos_id == tokenizer.token_to_id("</s>") == 1
    assert load_tokenizer(tmp_path, eos_token="<pad>").record.eos_id == 0
    assert loaded.encode_batch(["some text"]) == [tokenizer.encode("some text").ids]


def test_json_tokenizer_rejects_a_bad_file(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")
