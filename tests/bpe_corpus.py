"""A small BPE ``tokenizer.json`` and JSONL corpus made here, for tests of real tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = ["the", "a", "swarm", "of", "nodes", "trains", "model", "café", "東京", "42", "outer"]


def documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))) + f" #{seed}-{i}."
        for i in range(count)
    ]


def write_bpe_corpus(root: Path, count: int = 80, vocab_size: int = 400) -> list[str]:
    """``root/tokenizer.json`` (byte-level BPE with ``<|endoftext|>``, ``vocab_size``
    tokens) and ``root/docs.jsonl`` of ``count`` documents; returns the documents."""
    texts = documents(count, 7)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    lines = [json.dumps({"text": t}) for t in texts]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return texts
