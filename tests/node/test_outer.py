import torch
from torch import nn

from diloco.node.outer import FragmentSync, OuterConfig, merge, nesterov_step


def test_nesterov_step_equals_torch_sgd_nesterov_over_several_rounds() -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=generator)
    deltas = [torch.randn(1000, generator=generator) for _ in range(4)]
    outer, momentum = start.clone(), torch.zeros_like(start)
    reference = nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for delta in deltas:
        nesterov_step(outer, momentum, delta, lr=0.7, mu=0.9)
        reference.grad = delta.clone()
        sgd.step()
        assert torch.equal(outer, reference.detach())
        assert torch.equal(momentum, sgd.state[reference]["momentum_buffer"])


def test_nesterov_step_mu0_is_plain_sgd_by_hand() -> None:
    outer, momentum = torch.tensor([1.0, -2.0]), torch.zeros(2)
    nesterov_step(outer, momentum, torch.tensor([0.5, 0.25]), lr=2.0, mu=0.0)
    assert outer.tolist() == [0.0, -2.5] and momentum.tolist() == [0.5, 0.25]


def test_merge_by_hand() -> None:
    live, new = torch.tensor([4.0, 8.0, -1.0]), torch.tensor([0.0, -4.0, 3.0])
    assert merge(live, new, 0.25).tolist() == [1.0, -1.0, 2.0]
    assert merge(live, new, 0.0).tolist() == [0.0, -4.0, 3.0]
    assert merge(live, new, 1.0).tolist() == [4.0, 8.0, -1.0]


def test_fragment_sync_applies_outer_step_and_merge_by_hand() -> None:
    from concurrent.futures import Future

    from diloco.protocol.reducer import RoundResult

    weight = nn.Parameter(torch.tensor([1.0, 2.0]))
    config = OuterConfig(
        sync_every=2,
        fragment_sync_delay=1,
        outer_lr=0.5,
        outer_momentum=0.5,
        fragment_update_alpha=0.25,
    )
    sync = FragmentSync([[("w", weight)]], config, "me", tau=1)
    with torch.no_grad():
        weight.copy_(torch.tensor([0.5, 3.0]))  # two inner steps
    ((key, contribution),) = sync.contributions_due(2)
    assert (key.fragment, key.round) == (0, 1)
    assert contribution.delta.tolist() == [0.5, -1.0]  # outer - theta
    done: Future[RoundResult] = Future()
    done.set_result(RoundResult(torch.tensor([0.25, -0.5]), ("me", "you"), 0, 0, 0.0))
    sync.submit(key, done, 2, contribution.weight)
    with torch.no_grad():
        weight.copy_(torch.tensor([0.25, 3.5]))  # the tau = 1 step trained meanwhile
    (applied,) = sync.apply_due(3)
    assert applied.ok and applied.members == ("me", "you")
    state = sync.states[0]
    # mom = 0.5 * 0 + d = [0.25, -0.5]; outer = [1, 2] - 0.5 * (d + 0.5 * mom)
    assert state.momentum.tolist() == [0.25, -0.5]
    assert state.outer.tolist() == [0.8125, 2.375]
    # theta = 0.25 * [0.25, 3.5] + 0.75 * [0.8125, 2.375]
    assert weight.detach().tolist() == [0.671875, 2.65625]
    assert state.version == 1


def test_fragment_sync_failed_round_keeps_state_and_carries_weight() -> None:
    from concurrent.futures import Future

    from diloco.errors import RoundFailed

    layer = nn.Linear(4, 4)
    params = list(layer.named_parameters())
    sync = FragmentSync([params], OuterConfig(sync_every=2, fragment_sync_delay=1), "me", tau=1)
    before = sync.states[0].outer.clone()
    sync.record_tokens(10)
    sync.record_tokens(10)
    with torch.no_grad():
        layer.weight.add_(1.0)
    ((key, contribution),) = sync.contributions_due(2)
    assert contribution.weight == 20
    failed: Future = Future()
    failed.set_exception(RoundFailed(0, 1, "nobody came"))
    sync.submit(key, failed, 2, contribution.weight)
    assert sync.apply_due(2) == []  # received at step 3 = 2 + tau
    (applied,) = sync.apply_due(3)
    assert not applied.ok and sync.failed_rounds == 1
    assert torch.equal(sync.states[0].outer, before)
    sync.record_tokens(10)
    ((_, nxt),) = sync.contributions_due(4)
    assert nxt.weight == 30  # the failed round's tokens are carried into the next one
