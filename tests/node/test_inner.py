"""The inner step: gradient accumulation equals one big batch; bf16 autocast trains."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.node.data.corpus import BatchSampler
from diloco.node.model.transformer import Transformer, preset
from diloco.node.training.inner import InnerConfig, build_inner_optimizer, inner_step


def _text_tokens() -> np.ndarray:
    """Two standard-library sources as bytes: real text, fixed, small, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return np.frombuffer(
        (root / "argparse.py").read_bytes() + (root / "json/decoder.py").read_bytes(), np.uint8
    )


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("micro"))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
@pytest.mark.parametrize("micro_batch_size", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_inner_step_micro_batches_equal_one_batch(
    grad_clip: float, micro_batch_size: int, kind: str
) -> None:
    inner = InnerConfig(optimizer=kind, grad_clip=grad_clip)  # type: ignore[arg-type]
    batch = BatchSampler(_text_tokens(), batch_size=8, seq_len=32, seed=3).next_batch()
    accumulated = _model()
    optimizer = build_inner_optimizer(accumulated.parameters(), inner)
    loss = inner_step(
        accumulated, optimizer, batch, 1e-3, grad_clip, micro_batch_size=micro_batch_size
    )
    # The whole batch in one pass, written out by hand.
    whole = _model()
    reference_optimizer = build_inner_optimizer(whole.parameters(), inner)
    _, reference_loss = whole(*batch)
    reference_loss.backward()
    if grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), grad_clip)
        assert norm > 10 * grad_clip  # the clip really acts
    for group in reference_optimizer.param_groups:
        group["lr"] = 1e-3
    reference_optimizer.step()

    assert loss == pytest.approx(reference_loss.item(), abs=1e-5)
    grads = _flat(p.grad for p in accumulated.parameters())
    reference_grads = _flat(p.grad for p in whole.parameters())
    torch.testing.assert_close(grads, reference_grads, atol=1e-6, rtol=1e-4)
    assert not torch.equal(_flat(accumulated.parameters()), _flat(_model().parameters()))
    if kind == "sgd":  # the update is linear in the gradient
        torch.testing.assert_close(
            _flat(accumulated.parameters()), _flat(whole.parameters()), atol=1e-6, rtol=0
        )
        return
    # AdamW's first update, lr * g / (|g| + eps), turns float noise in a gradient near eps
    # into a visible step, so compare what it was fed: its moment estimates.
    for state in ("exp_avg", "exp_avg_sq"):
        ours = _flat(optimizer.state[p][state] for p in accumulated.parameters())
        theirs = _flat(reference_optimizer.state[p][state] for p in whole.parameters())
        torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-4)


def test_inner_step_bf16_autocast_trains_fp32_weights() -> None:
    model = _model()
    seen: list[torch.dtype] = []
    model.blocks[0].mlp.up.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    optimizer = build_inner_optimizer(model.parameters(), InnerConfig(warmup_steps=0))
    sampler = BatchSampler(_text_tokens(), batch_size=4, seq_len=32, seed=0)
    losses = [
        inner_step(model, optimizer, sampler.next_batch(), 3e-3, 1.0, precision="bf16")
        for _ in range(20)
    ]
    assert set(seen) == {torch.bfloat16}
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    assert np.mean(losses[-10:]) < 0.7 * losses[0]


def test_inner_step_fp32_runs_no_autocast() -> None:
    model = _model()
    seen: list[torch.dtype] = []
    model.blocks[0].mlp.up.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    optimizer = build_inner_optimizer(model.parameters(), InnerConfig())
    batch = BatchSampler(_text_tokens(), batch_size=2, seq_len=16, seed=0).next_batch()
    inner_step(model, optimizer, batch, 1e-3, 1.0)
    assert seen == [torch.float32]


def test_adamw_is_fused_where_torch_has_the_kernel() -> None:
    model = _model()
    adamw = build_inner_optimizer(model.parameters(), InnerConfig())
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    sgd = build_inner_optimizer(model.parameters(), InnerConfig(optimizer="sgd"))
    assert isinstance(sgd, torch.optim.SGD)
