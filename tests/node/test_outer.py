import torch
from torch import nn

from diloco.node.outer import FragmentSync, OuterConfig, merge, nesterov_step


def test_nesterov_step_matches_formula() -> None:
    outer = torch.tensor([1.0, -2.0, 3.0])
    mom = torch.tensor([0.5, 0.0, -1.0])
    delta = torch.tensor([0.1, 0.2, -0.3])
    expected_mom = 0.9 * mom + delta
    expected_outer = outer - 0.7 * (delta + 0.9 * expected_mom)
    nesterov_step(outer, mom, delta, lr=0.7, mu=0.9)
    assert torch.allclose(mom, expected_mom) and torch.allclose(outer, expected_outer)


def test_merge_exact_at_ends() -> None:
    live, new = torch.randn(5), torch.randn(5)
    assert torch.equal(merge(live, new, 0.0), new)
    assert torch.equal(merge(live, new, 1.0), live)
    assert torch.allclose(merge(live, new, 0.25), 0.25 * live + 0.75 * new)


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
