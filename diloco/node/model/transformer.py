"""A decoder-only transformer in one readable file (nanoGPT's shape).

Chinchilla-style decoder (Hoffmann et al. 2022) as used by the Streaming DiLoCo paper
(Douillard et al. 2025, section 4): RMSNorm pre-norm (Zhang & Sennrich 2019), QK-norm
(Dehghani et al. 2023), rotary positions (Su et al. 2021), a SwiGLU MLP (Shazeer 2020), an
output head tied to the token embedding (Press & Wolf 2017) and the z-loss of PaLM
(Chowdhery et al. 2022, section 5: ``1e-4 * logsumexp(logits)^2``).
The blocks are an ordered ``nn.ModuleList`` so fragments can be cut from it.

The forward pass is exactly that of ``transformers``' Qwen3 (no biases, RMSNorm eps 1e-6
computed in FP32, per-head QK-norm before a half-split RoPE, SwiGLU, tied head), so
``diloco.node.model.hf_export`` can write weights that ``AutoModelForCausalLM`` loads unchanged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain and no bias.

    Computed in FP32 whatever the autocast dtype: the mean of squares is where bf16 would
    lose the most.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).type_as(x)


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of RoPE, each (T, hs/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel ``i`` with channel ``i + hs/2`` of x (B, nh, T, hs) by its angle.

    The half-split pairing of GPT-NeoX and Llama/Qwen (``rotate_half``), not the interleaved
    one of the RoPE paper: the two are a fixed permutation of q and k apart, and this one
    lets exported weights load into ``transformers`` without permuting them.
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out: torch.Tensor = self.proj(y)
        return out


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020, eq. 6): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture of the decoder; a run's nodes must all use the same one."""

    vocab_size: int = 256
    """Token vocabulary size (256 for the byte-level CPU presets, 32,000 in the paper)."""
    d_model: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks, L."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    mlp_hidden: int = 320
    """SwiGLU hidden width; the presets use ``swiglu_hidden(d_model)``."""
    max_seq_len: int = 1024
    """Longest sequence the rotary tables cover, in tokens."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    z_loss: float = 1e-4
    """Weight of the z-loss term (PaLM section 5)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"n_heads={self.n_heads} must divide d_model={self.d_model} into even head sizes"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{f.name} must be positive, got {value}")


def swiglu_hidden(d_model: int) -> int:
    """``8/3 * d_model`` rounded to a multiple of 64: SwiGLU's three matrices then hold as
    many parameters as a 4 x d_model GELU MLP's two (Shazeer 2020, section 2)."""
    return max(64, 64 * round(8 * d_model / 3 / 64))


def _preset(d_model: int, n_layers: int, n_heads: int, vocab_size: int = 32000) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        mlp_hidden=swiglu_hidden(d_model),
    )


PRESETS: dict[str, ModelConfig] = {
    # CPU and test sizes (byte vocabulary), like torchtitan's debugmodel. micro: the
    # multi-process tests' nodes (a step costs 0.6x tiny's at batch 4 x 32 on one CPU thread).
    "micro": _preset(64, 4, 4, vocab_size=256),
    "tiny": _preset(128, 4, 4, vocab_size=256),
    "small": _preset(256, 6, 8, vocab_size=256),
    # docs/design.md "Model presets" (the paper's Chinchilla-style ladder). Parameters with the tied
    # head: 35.1M, 88.3M, 184.6M, 334.7M, 558.8M, 1.27B, 4.18B (tiny 0.79M, small 4.89M).
    "35M": _preset(512, 6, 8),
    "100M": _preset(768, 9, 12),
    "200M": _preset(1024, 12, 16),
    "300M": _preset(1280, 15, 20),
    "500M": _preset(1536, 18, 24),
    "1B": _preset(2048, 24, 32),
    "4B": _preset(3072, 36, 48),
}


def preset(name: str) -> ModelConfig:
    """A copy of the named preset's configuration."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    return ModelConfig(**{f.name: getattr(base, f.name) for f in fields(base)})


class Transformer(nn.Module):
    """Token embedding, ``blocks`` (an ordered list), final norm, head tied to the embedding.

    The head is the embedding matrix itself (``F.linear`` with ``tok_emb.weight``), not a
    second module sharing it: one parameter, one name, so fragments, outer states and
    safetensors files never meet an alias.
    """

    rope_cos: torch.Tensor  # (max_seq_len, hs / 2), a buffer
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model)
        cos, sin = rotary_tables(
            config.max_seq_len, config.d_model // config.n_heads, config.rope_theta
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 (Radford et al. 2019, section 2.3): scale residual projections by 1/sqrt(2L).
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and, given targets (B, T), cross-entropy plus z-loss."""
        _, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {T} tokens exceeds max_seq_len {self.config.max_seq_len}"
            )
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.norm(x), self.tok_emb.weight)  # (B, T, V)
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.size(-1)).float()  # (B*T, V)
        loss = F.cross_entropy(flat, targets.reshape(-1))
        if self.config.z_loss:
            loss = loss + self.config.z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
        return logits, loss
