import pytest
import torch
from torch import nn

from diloco.errors import ConfigError
from diloco.node.training.outer import FragmentSync
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.outer_step import merge, nesterov_step
from diloco.protocol.core.reducer import RoundKey


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

    from diloco.protocol.core.reducer import RoundResult

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


def test_fragment_sync_a_result_withdrawn_when_applied_fails_the_round() -> None:
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(4, 4)
    sync = FragmentSync(
        [list(layer.named_parameters())], OuterConfig(sync_every=2, fragment_sync_delay=1), "me", 1
    )
    before = sync.states[0].outer.clone()
    sync.record_tokens(10)
    with torch.no_grad():
        layer.weight.add_(1.0)
    ((key, contribution),) = sync.contributions_due(2)
    asked: list[int] = []
    reasons = iter([None, "taken"])  # still holds when decided; withdrawn when applied

    def withdrawn() -> str | None:
        asked.append(1)
        return next(reasons)

    done: Future[RoundResult] = Future()
    one = torch.ones_like(contribution.delta)
    done.set_result(RoundResult(one, ("me",), 0, 0, 0.0, withdrawn=withdrawn))
    assert withdrawn() is None
    sync.submit(key, done, 2, contribution.weight)
    (applied,) = sync.apply_due(3)
    assert len(asked) == 2  # asked once more, at the apply
    assert not applied.ok and applied.error.endswith("failed: taken"), applied.error
    assert torch.equal(sync.states[0].outer, before) and sync.states[0].version == 0
    assert sync.carried_weight[0] == 10


def test_fragment_sync_a_result_refused_when_applied_fails_the_round() -> None:
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(4, 4)
    sync = FragmentSync(
        [list(layer.named_parameters())], OuterConfig(sync_every=2, fragment_sync_delay=1), "me", 1
    )
    before = sync.states[0].outer.clone()
    asked: list[tuple[str, ...]] = []

    def refuse(result: RoundResult) -> str | None:
        asked.append(result.members)
        return "not without the creator" if "boss" not in result.members else None

    sync.refuse = refuse
    for step, members in ((2, ("me", "j1")), (4, ("boss", "me"))):
        sync.record_tokens(10)
        with torch.no_grad():
            layer.weight.add_(1.0)
        ((key, contribution),) = sync.contributions_due(step)
        done: Future[RoundResult] = Future()
        done.set_result(RoundResult(torch.ones_like(contribution.delta), members, 0, 0, 0.0))
        sync.submit(key, done, step, contribution.weight)
        (applied,) = sync.apply_due(step + 1)
        if step == 2:
            assert not applied.ok and applied.error.endswith("failed: not without the creator")
            assert torch.equal(sync.states[0].outer, before) and sync.states[0].version == 0
            assert sync.carried_weight[0] == 10
    assert applied.ok and sync.states[0].version == 2 and sync.carried_weight[0] == 0
    assert asked == [("me", "j1"), ("boss", "me")]


def _sync_with_rounds_in_flight() -> tuple[nn.Linear, FragmentSync]:
    """Two fragments (weight, bias); H 2, tau 1: both send round 1 at step 2 (offsets 0, 1:
    the bias at step 3). Fragment 0's round succeeded, fragment 1's failed."""
    from concurrent.futures import Future

    from diloco.errors import RoundFailed
    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(3, 2)
    weight, bias = list(layer.named_parameters())
    sync = FragmentSync([[weight], [bias]], OuterConfig(sync_every=2), "me", tau=1)
    sync.states[1].momentum.fill_(0.25)
    sync.states[1].version = 4
    sync.record_tokens(10)
    sync.record_tokens(10)
    ok: Future = Future()
    ok.set_result(RoundResult(torch.arange(6, dtype=torch.float32), ("me", "you"), 11, 12, 0.5))
    failed: Future = Future()
    failed.set_exception(RoundFailed(1, 5, "nobody came"))
    sync.submit(RoundKey(0, 1), ok, 2, 20.0)
    sync.submit(RoundKey(1, 5), failed, 3, 7.0)
    sync.carried_weight[1] = 3.0
    return layer, sync


def test_fragment_sync_state_dict_round_trip_applies_the_same_rounds() -> None:
    layer, sync = _sync_with_rounds_in_flight()
    saved = sync.state_dict()
    twin_layer = nn.Linear(3, 2)
    twin_layer.load_state_dict(layer.state_dict())
    weight, bias = list(twin_layer.named_parameters())
    twin = FragmentSync([[weight], [bias]], OuterConfig(sync_every=2), "twin", tau=1)
    twin.load_state_dict(saved)
    assert twin.tokens_since_send == [20.0, 20.0] and twin.carried_weight == [0.0, 3.0]
    assert twin.states[1].version == 4 and torch.equal(
        twin.states[1].momentum, torch.full((2,), 0.25)
    )
    for step in (3, 4):
        a, b = sync.apply_due(step), twin.apply_due(step)
        assert [(r.key, r.ok, r.members, r.bytes_sent) for r in a] == [
            (r.key, r.ok, r.members, r.bytes_sent) for r in b
        ]
    assert [r.key for r in sync.pending] == [] and twin.failed_rounds == 1
    assert twin.carried_weight == sync.carried_weight == [0.0, 10.0]
    for mine, theirs in zip(sync.states, twin.states, strict=True):
        assert mine.sha256() == theirs.sha256() and mine.version == theirs.version
    assert twin.states[0].version == 1 and torch.equal(layer.weight, twin_layer.weight)


def test_fragment_sync_finish_applies_every_round_in_flight_in_receive_order() -> None:
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(3, 2)
    weight, bias = list(layer.named_parameters())
    sync = FragmentSync([[weight], [bias]], OuterConfig(sync_every=4), "me", tau=3)
    start = bias[1].detach().clone()
    late: Future = Future()
    late.set_result(RoundResult(torch.ones(2), ("me", "you"), 1, 1, 0.0))
    early: Future = Future()
    early.set_result(RoundResult(torch.ones(6), ("me", "you"), 1, 1, 0.0))
    sync.submit(RoundKey(1, 2), late, 10, 1.0)  # received at 13
    sync.submit(RoundKey(0, 2), early, 8, 1.0)  # received at 11
    assert sync.apply_due(10) == []  # the run ends at step 10, both still in flight
    applied = sync.finish()
    assert [r.key for r in applied] == [RoundKey(0, 2), RoundKey(1, 2)]
    assert all(r.ok for r in applied) and sync.pending == []
    assert [s.version for s in sync.states] == [2, 2]
    # mom = d = 1; outer = start - lr * (d + mu * mom) = start - 0.7 * 1.9; theta (unchanged
    # meanwhile) = 0.5 * start + 0.5 * outer (alpha 0.5 with tau > 0)
    assert sync.states[1].momentum.tolist() == [1.0, 1.0]
    assert torch.allclose(sync.states[1].outer, start - 1.33)
    assert torch.allclose(bias[1].detach(), start - 0.665)


def test_fragment_sync_finish_of_a_stopping_node_gives_its_rounds_up() -> None:
    from concurrent.futures import Future

    layer = nn.Linear(2, 2)
    sync = FragmentSync([list(layer.named_parameters())], OuterConfig(sync_every=2), "me", 1)
    sync.should_abandon = lambda _: True
    never: Future = Future()
    sync.submit(RoundKey(0, 1), never, 2, 5.0)
    (applied,) = sync.finish()
    assert not applied.ok and "abandoned" in applied.error and never.cancelled()
    assert sync.states[0].version == 0 and sync.carried_weight == [5.0]


def test_fragment_sync_a_stopping_node_applies_a_round_its_group_waits_for() -> None:
    """Stopping, a round in its all-reduce is waited for (its group needs this node), and
    one still in matchmaking is given up."""
    import threading
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(2, 2)
    sync = FragmentSync([list(layer.named_parameters())], OuterConfig(sync_every=2), "me", 1)
    in_group, matching = RoundKey(0, 1), RoundKey(0, 2)
    sync.should_abandon = lambda key: key != in_group
    grouped: Future[RoundResult] = Future()
    result = RoundResult(torch.zeros(sync.states[0].outer.numel()), ("me", "you"), 0, 0, 0.0)
    threading.Timer(0.3, grouped.set_result, [result]).start()  # three abandon polls later
    never: Future[RoundResult] = Future()
    sync.submit(in_group, grouped, 2, 1.0)
    sync.submit(matching, never, 4, 1.0)
    first, second = sync.finish()
    assert first.ok and first.members == ("me", "you") and sync.states[0].version == 1
    assert not second.ok and "abandoned" in (second.error or "") and never.cancelled()


def test_fragment_sync_wait_kept_waits_for_the_kept_rounds_and_applies_nothing() -> None:
    import threading
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult

    layer = nn.Linear(2, 2)
    sync = FragmentSync([list(layer.named_parameters())], OuterConfig(sync_every=2), "me", 1)
    kept_key, given_up_key = RoundKey(0, 1), RoundKey(0, 2)
    sync.should_abandon = lambda key: key == given_up_key
    kept: Future[RoundResult] = Future()
    result = RoundResult(torch.zeros(sync.states[0].outer.numel()), ("me", "you"), 0, 0, 0.0)
    threading.Timer(0.3, kept.set_result, [result]).start()
    never: Future[RoundResult] = Future()
    sync.submit(kept_key, kept, 2, 1.0)
    sync.submit(given_up_key, never, 4, 1.0)
    sync.wait_kept()
    assert kept.done() and not never.done()
    # nothing applied: the results stay for their receive steps (or a checkpoint)
    assert len(sync.pending) == 2 and sync.states[0].version == 0


def test_fragment_sync_state_dict_gives_up_on_a_round_still_in_flight() -> None:
    from concurrent.futures import Future

    layer = nn.Linear(2, 2)
    sync = FragmentSync([list(layer.named_parameters())], OuterConfig(sync_every=2), "me", 1)
    never: Future = Future()
    sync.submit(RoundKey(0, 1), never, 2, 1.0)
    (saved,) = sync.state_dict(timeout=0.0)["pending"]
    assert "abandoned" in saved["failed"] and never.cancelled()


def test_fragment_sync_trains_on_after_a_checkpoint_gave_a_round_up() -> None:
    """The chaos run's crash: a checkpoint cancelled a round in flight, and applying it at
    its receive step raised CancelledError out of the training loop."""
    from concurrent.futures import Future

    layer = nn.Linear(2, 2)
    sync = FragmentSync([list(layer.named_parameters())], OuterConfig(sync_every=2), "me", 1)
    never: Future = Future()
    sync.submit(RoundKey(0, 1), never, 2, 1.0)
    sync.state_dict(timeout=0.0)
    (applied,) = sync.apply_due(3)  # sent at step 2, tau 1
    assert not applied.ok and "abandoned when saved" in applied.error
    assert sync.states[0].version == 0 and sync.carried_weight == [1.0] and not sync.pending


def test_fragment_sync_load_state_dict_refuses_another_shape_and_changes_nothing() -> None:
    _, sync = _sync_with_rounds_in_flight()
    saved = sync.state_dict()
    other = nn.Linear(3, 3)
    weight, bias = list(other.named_parameters())
    target = FragmentSync([[weight], [bias]], OuterConfig(sync_every=2), "x", tau=1)
    before = [s.sha256() for s in target.states]
    with pytest.raises(ValueError, match="shape"):
        target.load_state_dict(saved)
    broken = dict(saved)
    del broken["carried_weight"]
    with pytest.raises(ValueError, match="malformed"):
        sync.load_state_dict(broken)
    assert [s.sha256() for s in target.states] == before and target.pending == []
    assert sync.carried_weight == [0.0, 3.0]


def test_fragment_sync_adopt_loads_outer_into_theta_and_drops_carried_weight() -> None:
    from diloco.protocol.state.fragment import FragmentState

    layer, sync = _sync_with_rounds_in_flight()
    peer = FragmentState(torch.tensor([9.0, 8.0]), torch.tensor([1.0, 2.0]), 7)
    sync.adopt(1, peer)
    assert torch.equal(layer.bias.detach(), peer.outer) and sync.states[1].version == 7
    assert torch.equal(sync.states[1].momentum, peer.momentum) and sync.carried_weight[1] == 0.0
    peer.outer.add_(1.0)  # the adopted state is a copy
    assert torch.equal(sync.states[1].outer, torch.tensor([9.0, 8.0]))
    with pytest.raises(ConfigError, match="shape"):
        sync.adopt(0, peer)


def test_state_hash_follows_every_change_of_the_outer_state() -> None:
    from concurrent.futures import Future

    from diloco.protocol.core.reducer import RoundResult
    from diloco.protocol.state.fragment import FragmentState

    weight = nn.Parameter(torch.tensor([1.0, 2.0]))
    sync = FragmentSync([[("w", weight)]], OuterConfig(sync_every=2), "me", tau=1)
    before = sync.state_hash(0)
    assert before == sync.states[0].sha256()
    ((key, contribution),) = sync.contributions_due(2)
    done: Future[RoundResult] = Future()
    done.set_result(RoundResult(torch.tensor([0.5, 0.5]), ("me",), 0, 0, 0.0))
    sync.submit(key, done, 2, contribution.weight)
    (applied,) = sync.apply_due(3)
    assert sync.state_hash(0) == applied.outer_sha256 == sync.states[0].sha256() != before
    theirs = FragmentState(torch.tensor([7.0, 8.0]), torch.tensor([0.0, 1.0]), version=1)
    sync.adopt(0, theirs)  # same version, another state: a heal
    assert sync.state_hash(0) == theirs.sha256()
    sync.load_state_dict({**sync.state_dict(), "fragments": [
        {"outer": torch.tensor([1.0, 1.0]), "momentum": torch.zeros(2), "version": 1}
    ]})  # fmt: skip
    assert sync.state_hash(0) == FragmentState(torch.ones(2), torch.zeros(2), 1).sha256()


def test_fragment_sync_round_failed_already_no_longer_blocks_healing() -> None:
    """A round that failed before its receive step cannot change the state any more: it is
    not in flight for healing, a divergence it reports is listed, and once a peer's state
    is adopted its tokens are not carried (the adopted state holds that round)."""
    from concurrent.futures import Future

    from diloco.errors import PriorDiverged
    from diloco.protocol.state.fragment import FragmentState

    _, sync = _sync_with_rounds_in_flight()
    assert sync.in_flight() == {0}  # fragment 0's round succeeded: it is still to apply
    assert sync.diverged() == {}  # fragment 1's failed, not for a diverged prior
    diverged: Future = Future()
    diverged.set_exception(PriorDiverged(1, 5, "no partner", "ab" * 8))
    sync.pending[1].future = diverged
    assert sync.diverged() == {RoundKey(1, 5): "ab" * 8} and sync.in_flight() == {0}
    sync.adopt(1, FragmentState(torch.tensor([9.0, 8.0]), torch.zeros(2), 5))
    start = sync.states[0].sha256()
    ok, failed = sync.apply_due(4)
    assert ok.ok and ok.prior_sha256 == start != ok.outer_sha256
    assert not failed.ok and sync.carried_weight[1] == 0.0
