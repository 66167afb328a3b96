"""Per-node compute choices: bf16 leaves the outer sync bit-identical; compile in place."""

import pytest
import torch

from diloco.errors import ConfigError
from diloco.node.data.corpus import load_corpus
from diloco.node.model.compute import ComputeOptions, autocast, compile_model, configure_backends
from diloco.node.model.transformer import Transformer, preset
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer_config import OuterConfig


class Bf16Trainer(LocalTrainer):
    """The in-process trainer checking after every step that replicas at the same version
    hold the same outer state."""

    checked_steps = 0

    def _streaming_step(self, step: int, lr: float) -> float:
        loss = super()._streaming_step(step, lr)
        assert self.outer_states_identical()
        self.checked_steps += 1
        return loss


def test_bf16_replicas_keep_bit_identical_fp32_outer_states() -> None:
    config = LocalConfig(
        replicas=3,
        taus=[0, 1, 2],
        steps=9,
        batch_size=2,
        seq_len=16,
        eval_batches=1,
        log_every=1000,
        outer=OuterConfig(sync_every=3),
        compute=ComputeOptions(precision="bf16", micro_batch_size=1),  # 2 micro-batches
    )
    trainer = Bf16Trainer(config, load_corpus(None))
    summary = trainer.train()
    assert trainer.checked_steps == 9 and summary["outer_states_identical"]
    outer_digests: dict[tuple[int, int], set[str]] = {}
    for _, applied in trainer.round_log:
        assert applied.ok
        key = (applied.key.fragment, applied.key.round)
        outer_digests.setdefault(key, set()).add(applied.outer_sha256)
    assert len(outer_digests) >= 4 and all(len(d) == 1 for d in outer_digests.values())
    for replica in trainer.replicas:
        assert replica.sync is not None
        assert all(s.outer.dtype == torch.float32 for s in replica.sync.states)
        assert all(p.dtype == torch.float32 for p in replica.model.parameters())


def test_compute_options_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="fp32 or bf16"):
        ComputeOptions(precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="micro_batch_size"):
        ComputeOptions(micro_batch_size=-1)
    assert ComputeOptions().precision == "fp32"


def test_autocast_only_for_bf16() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with autocast("cpu", "bf16"):
        assert layer(x).dtype == torch.bfloat16
    with autocast("cpu", "fp32"):
        assert layer(x).dtype == torch.float32


def test_configure_backends_leaves_cpu_matmuls_alone() -> None:
    before = torch.get_float32_matmul_precision()
    configure_backends(torch.device("cpu"), tf32=True)
    assert torch.get_float32_matmul_precision() == before


def test_compile_model_in_place_keeps_names_and_logits() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).eval()
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        eager, _ = model(tokens)
    compile_model(model, backend="eager")  # tracing only: no C++ toolchain, few seconds
    with torch.no_grad():
        compiled, _ = model(tokens)
    assert model._compiled_call_impl is not None
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == [*names]
    torch.testing.assert_close(compiled, eager)
