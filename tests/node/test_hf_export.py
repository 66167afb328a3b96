"""An exported model loads in ``transformers`` and computes our logits (no hub access)."""

import hashlib
import json
import os
from dataclasses import asdict

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it: never touch the network

import numpy as np
import pytest
import torch
from bpe_corpus import documents, write_bpe_corpus
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from diloco.cli import main
from diloco.codecs import get_codec
from diloco.errors import ConfigError
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.model.hf_export import export_hf, export_hf_from_file
from diloco.node.model.transformer import ModelConfig, Transformer
from diloco.node.training.checkpoint import export_weights
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import InProcessReducer

CONFIG = ModelConfig(
    vocab_size=97, d_model=64, n_layers=3, n_heads=4, mlp_hidden=160, max_seq_len=48
)


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    with torch.no_grad():  # gains away from 1, so a norm mapped to the wrong place shows
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model


def _logits_in_transformers(folder) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 40))
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.dtype == torch.float32
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        return tokens, hf(tokens).logits


def test_exported_logits_in_transformers_equal_ours(tmp_path) -> None:
    model = _model()
    export_hf(model.state_dict(), CONFIG, tmp_path)
    tokens, theirs = _logits_in_transformers(tmp_path)
    with torch.no_grad():
        ours, _ = model(tokens)
    assert ours.abs().max() > 1.0  # not a degenerate model whose logits all agree
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_export_from_an_outer_weights_file(tmp_path) -> None:
    model = _model()
    weights = tmp_path / "outer.safetensors"
    export_weights(
        model.state_dict(), weights, metadata={"model_config": json.dumps(asdict(CONFIG))}
    )
    (tmp_path / "tok.json").write_text("{}")
    folder = export_hf_from_file(weights, tmp_path / "hf", tokenizer_file=tmp_path / "tok.json")
    assert (folder / "tokenizer.json").read_text() == "{}"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.2.self_attn.v_proj.weight" in names and "lm_head.weight" not in names
    tokens, theirs = _logits_in_transformers(folder)
    with torch.no_grad():
        ours, _ = model(tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_export_rejects_weights_of_another_depth(tmp_path) -> None:
    state = _model().state_dict()
    deeper = ModelConfig(**{**asdict(CONFIG), "n_layers": 4})
    with pytest.raises(ConfigError, match="4-layer"):
        export_hf(state, deeper, tmp_path)
    plain = tmp_path / "plain.safetensors"
    export_weights(state, plain)
    with pytest.raises(ConfigError, match="model_config"):
        export_hf_from_file(plain, tmp_path / "hf")


def _node_export(tmp_path, data, run: RunConfig):
    node = NodeTrainer(
        run, NodeOptions(batch_size=2, data=str(data)), InProcessReducer(get_codec("none")), "x"
    )
    return node, node.export_hf(tmp_path / "hf")


def test_a_bytes_run_exports_a_tokenizer_of_its_byte_ids(tmp_path) -> None:
    text = "def café(x):\n\treturn x  # 東京, 42 💥\n"
    corpus = tmp_path / "notes.txt"
    corpus.write_text(text * 40)
    node, folder = _node_export(tmp_path, corpus, RunConfig(seq_len=16))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.encode(text)
    assert ids == list(text.encode()) == node.corpus.train[: len(ids)].tolist()
    assert tokenizer.decode(ids) == text


def test_a_bpe_run_exports_a_tokenizer_of_its_training_ids(tmp_path) -> None:
    text = " ".join(documents(30, 11))  # text the tokenizer never saw
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    write_bpe_corpus(tmp_path)
    tokens = tmp_path / "tokens"
    args = [str(tmp_path / "doc.jsonl"), "-o", str(tokens), "--val-fraction", "0"]
    tokenizer_json = tmp_path / "tokenizer.json"
    result = CliRunner().invoke(main, ["prepare-data", *args, "--tokenizer", str(tokenizer_json)])
    assert result.exit_code == 0, result.output
    trained = np.fromfile(tokens / "train.bin", dtype=np.uint16).tolist()  # the ids trained on
    vocab = json.loads((tokens / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    sha = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    _, folder = _node_export(
        tmp_path, tokens, RunConfig(seq_len=16, vocab_size=vocab, tokenizer=sha)
    )
    ids = AutoTokenizer.from_pretrained(folder).encode(text)
    assert len(ids) > 20 and trained in (ids, [*ids, trained[-1]])  # + the end-of-text id
