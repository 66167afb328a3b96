"""The device link's future chaining (its copies need CUDA: benchmarks/gpu_check.sh)."""

from concurrent.futures import CancelledError, Future

import pytest
import torch

from diloco.errors import RoundFailed
from diloco.node.model.device_link import DeviceLink, chain


def test_chain_forwards_a_result_and_an_error() -> None:
    source: Future[int] = Future()
    target: Future[int] = Future()
    chain(source, target)
    assert not target.done()
    source.set_result(7)
    assert target.result(0) == 7

    source, target = Future(), Future()
    chain(source, target)
    source.set_exception(RoundFailed(1, 2, "nobody came"))
    with pytest.raises(RoundFailed, match="nobody came"):
        target.result(0)


def test_chain_cancels_the_source_of_a_cancelled_target_and_reports_a_cancelled_source() -> None:
    source: Future[int] = Future()
    target: Future[int] = Future()
    chain(source, target)
    assert target.cancel() and source.cancelled()

    source, target = Future(), Future()
    chain(source, target)
    source.cancel()
    with pytest.raises(CancelledError):
        target.result(0)


def test_device_link_serves_cuda_models_only() -> None:
    with pytest.raises(ValueError, match="CUDA models, not cpu"):
        DeviceLink(torch.device("cpu"), [4])
