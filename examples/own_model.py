"""Streaming DiLoCo around your own ``nn.Module``: the outer loop only needs its blocks.

Two replicas of a small MLP "language model" train in one process; ``model_fragments`` cuts
fragments from the module's ``blocks`` list, ``FragmentSync`` runs the outer loop, and the
``InProcessReducer`` stands in for the swarm (a ``SwarmReducer`` plugs in the same way).

    python examples/own_model.py
"""

from __future__ import annotations

import torch
from torch import nn

from diloco.codecs import get_codec
from diloco.node.model.fragments import model_fragments
from diloco.node.training.outer import FragmentSync
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.core.reducer import InProcessReducer


class MyModel(nn.Module):
    """Any model works if its repeated layers sit in one ordered ``nn.ModuleList``."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    with open(__file__, "rb") as f:
        text = f.read()
    data = torch.tensor(list(text), dtype=torch.long)
    outer = OuterConfig(sync_every=10, outer_lr=0.7, outer_momentum=0.9, fragment_sync_delay=1)
    reducer = InProcessReducer(get_codec("e3m0"))
    replicas = []
    initial = MyModel().state_dict()
    for m in range(2):
        model = MyModel()
        model.load_state_dict(initial)
        fragments = model_fragments(model, model.blocks, fragment_size=1, pattern="strided")
        sync = FragmentSync(fragments, outer, member=f"replica{m}", tau=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        replicas.append((model, sync, optimizer, torch.Generator().manual_seed(m)))
    for step in range(1, 201):
        for model, sync, optimizer, generator in replicas:
            starts = torch.randint(0, len(data) - 33, (8,), generator=generator)
            batch = torch.stack([data[s : s + 33] for s in starts.tolist()])
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.record_tokens(batch.numel())
        due = [sync.contributions_due(step) for _, sync, _, _ in replicas]
        for round_index in range(len(due[0])):
            key = due[0][round_index][0]
            future = reducer.reduce(key, [d[round_index][1] for d in due])
            for (_, sync, _, _), d in zip(replicas, due, strict=True):
                sync.submit(key, future, step, d[round_index][1].weight)
        for _, sync, _, _ in replicas:
            sync.apply_due(step)
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    same = all(
        torch.equal(a.outer, b.outer)
        for a, b in zip(replicas[0][1].states, replicas[1][1].states, strict=True)
    )
    print(f"outer states identical across replicas: {same}")


if __name__ == "__main__":
    main()
