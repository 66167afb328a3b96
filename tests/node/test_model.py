import math

import pytest
import torch

from diloco.node.model import PRESETS, ModelConfig, Transformer, preset


def test_model_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (2, 32))
    logits, loss = model(tokens, tokens)
    assert logits.shape == (2, 32, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.3


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    with torch.no_grad():
        la, _ = model(a)
        lb, _ = model(b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_model_z_loss_adds_logsumexp_penalty() -> None:
    torch.manual_seed(0)
    config = preset("tiny")
    model = Transformer(config)
    tokens = torch.randint(0, 256, (2, 8))
    logits, loss = model(tokens, tokens)
    flat = logits.view(-1, 256)
    ce = torch.nn.functional.cross_entropy(flat, tokens.view(-1))
    expected = ce + 1e-4 * torch.logsumexp(flat, -1).pow(2).mean()
    assert loss is not None and torch.allclose(loss, expected)


def test_presets_match_spec_table() -> None:
    assert (PRESETS["1B"].d_model, PRESETS["1B"].n_layers, PRESETS["1B"].n_heads) == (2048, 24, 32)
    assert PRESETS["35M"].mlp_hidden == 2048 and PRESETS["35M"].vocab_size == 32000
    assert PRESETS["tiny"].vocab_size == 256
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("7B")


def test_model_config_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(d_model=100, n_heads=3)
