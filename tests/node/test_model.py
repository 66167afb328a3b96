import math

import pytest
import torch

from diloco.node.model.transformer import PRESETS, ModelConfig, Transformer, preset


def test_model_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (2, 32))
    # Targets unrelated to the inputs: with the head tied, an input token's own logit starts
    # high (0.02 * d_model), so targets equal to the inputs would not see a uniform model.
    logits, loss = model(tokens, torch.randint(0, 256, (2, 32)))
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
    # SwiGLU at 8/3 x 512 (rounded to 64) holds the parameters of docs/design.md "Model presets"'s
    # 2,048-wide GELU MLP.
    assert PRESETS["35M"].mlp_hidden == 1344 and PRESETS["35M"].vocab_size == 32000
    assert PRESETS["tiny"].vocab_size == 256
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("7B")


def test_model_config_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(d_model=100, n_heads=3)


def test_35m_preset_has_35m_parameters_with_the_head_tied() -> None:
    with torch.device("meta"):
        model = Transformer(preset("35M"))
    d, hs, hidden, layers, vocab = 512, 64, 1344, 6, 32000
    per_block = 4 * d * d + 3 * d * hidden + 2 * d + 2 * hs  # attention, SwiGLU, 4 norms
    assert model.num_params() == vocab * d + layers * per_block + d == 35_069_184


def test_model_head_is_the_embedding() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and not any("head" in n for n in names)
    tokens = torch.randint(0, 256, (1, 8))
    logits, _ = model(tokens)
    with torch.no_grad():
        model.tok_emb.weight[7].zero_()
        zeroed, _ = model(tokens)
    assert logits[..., 7].abs().max() > 0 and torch.equal(zeroed[..., 7], torch.zeros(1, 8))
