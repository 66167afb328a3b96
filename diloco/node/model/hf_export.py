"""Weights others can load: a Hugging Face ``transformers`` Qwen3 folder.

Our decoder computes exactly what ``Qwen3ForCausalLM`` computes (see
``diloco.node.model.transformer``), so an export is a renaming plus one split (our fused ``qkv``
into ``q_proj``, ``k_proj``, ``v_proj``), written as ``config.json`` and ``model.safetensors``. The
z-loss is a training term only and leaves the logits alone. ``transformers`` is not needed to
export.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.errors import ConfigError
from diloco.node.data.corpus import BYTES
from diloco.node.model.transformer import ModelConfig

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
"""Our parameter name inside block ``i`` -> the name under ``model.layers.{i}.``."""


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the Qwen3 model equal to ours.

    ``rope_theta`` is written twice: ``rope_parameters`` for ``transformers`` 5, the top-level
    key for 4.x.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "head_dim": config.d_model // config.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``Transformer.state_dict()`` under Qwen3's names (no ``lm_head``: it is tied)."""
    expected = 2 + len(_BLOCK_NAMES) * config.n_layers + config.n_layers  # + one qkv each
    if len(state) != expected:
        raise ConfigError(
            f"weights hold {len(state)} tensors, a {config.n_layers}-layer model has {expected}"
        )
    d = config.d_model
    out = {
        "model.embed_tokens.weight": state["tok_emb.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    for i in range(config.n_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _BLOCK_NAMES.items():
            out[prefix + theirs] = state[f"blocks.{i}.{ours}"]
        qkv = state[f"blocks.{i}.attn.qkv.weight"]  # (3C, C): rows of q, then k, then v
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}self_attn.{name}.weight"] = qkv[j * d : (j + 1) * d]
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def byte_tokenizer() -> dict[str, Any]:
    """A ``tokenizer.json`` whose ids are the bytes of the UTF-8 text, as a bytes run trains
    on them: GPT-2's byte-level alphabet (each byte one printable character), a BPE model
    without merges whose vocabulary maps each byte's character to the byte's value."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level | {"use_regex": False},
        "post_processor": None,
        "decoder": byte_level | {"use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }


def tokenizer_config(config: ModelConfig) -> dict[str, Any]:
    """``tokenizer_config.json``: the plain fast tokenizer of ``tokenizer.json``. Without it
    ``AutoTokenizer`` picks the class of the model type (Qwen2's), whose own pre-tokenizer
    and special tokens give other ids than those the model was trained on."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }


def export_hf(
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    folder: str | Path,
    tokenizer_file: str | Path | None = None,
) -> Path:
    """Write ``folder/config.json`` and ``folder/model.safetensors`` (FP32); returns folder.

    ``AutoModelForCausalLM.from_pretrained(folder)`` then loads the model. The tokens it was
    trained on come with it (docs/design.md "Data and exports"): a ``tokenizer.json`` given
    in ``tokenizer_file`` is copied beside it, ``BYTES`` writes the byte tokenizer, and
    either way a ``tokenizer_config.json`` makes ``AutoTokenizer`` give the training ids;
    None writes no tokenizer (token files of unknown origin).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        hf_state_dict(state, config),
        str(folder / "model.safetensors"),
        metadata={"format": "pt", "diloco_model_config": json.dumps(asdict(config))},
    )
    (folder / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    if tokenizer_file is not None:
        if str(tokenizer_file) == BYTES:
            (folder / "tokenizer.json").write_text(json.dumps(byte_tokenizer()) + "\n")
        else:
            shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(config), indent=2) + "\n"
        )
    return folder


def export_hf_from_file(
    weights: str | Path, folder: str | Path, tokenizer_file: str | Path | None = None
) -> Path:
    """Convert a file written by ``NodeTrainer.export_outer`` (its metadata holds the model
    config) into a ``transformers`` folder."""
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata() or {}
        if "model_config" not in metadata:
            raise ConfigError(
                f"{weights} has no model_config metadata; export it with export_outer"
            )
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    config = ModelConfig(**json.loads(metadata["model_config"]))
    return export_hf(state, config, folder, tokenizer_file)
