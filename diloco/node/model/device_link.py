"""Fragments between an accelerator and the host without stalling it (docs/design.md "Algorithm and
schedule", 2.5).

A CUDA node's outer loop moves each fragment twice per round: its live weights (or, with
the outer state on the device, its outer gradient) to the host at the send step ``s``, and
the new outer parameters back at the receive step ``s + tau``. ``DeviceLink`` makes both
asynchronous: copies go through pinned host buffers with ``non_blocking=True`` on the
training stream (so they see the weights of the step just queued, and the next step's
kernels queue behind them without waiting for the host), and the work that needs a copy
to be complete (the outer gradient on the host, handing it to the reducer) runs on one
worker thread that waits for the copy's CUDA event. The training thread never waits for a
download; it waits for an upload only before it changes that host vector again.

CPU models need none of this: their outer loop runs as it always did (``FragmentSync``
without a link), bit for bit.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")

NamedParams = list[tuple[str, nn.Parameter]]


class DeviceLink:
    """Pinned host buffers, copy events and one worker thread for a CUDA model's fragments.

    ``numels`` are the fragments' lengths (FP32 values). One download buffer per fragment
    is enough: fragment ``p``'s next send is ``H`` steps after the last, and the last round
    of ``p`` was applied (``tau < H``) only after the worker had finished with the buffer.
    """

    def __init__(self, device: torch.device, numels: list[int]) -> None:
        if device.type != "cuda":
            raise ValueError(f"a DeviceLink serves CUDA models, not {device}")
        self.device = device
        self.buffers = [torch.empty(n, dtype=torch.float32, pin_memory=True) for n in numels]
        self.uploads: dict[int, torch.cuda.Event] = {}
        self.worker = concurrent.futures.ThreadPoolExecutor(1, "diloco-outer-copies")
        self.jobs: list[Future[None]] = []

    def send(
        self,
        fragment: int,
        outer: torch.Tensor,
        params: NamedParams,
        start: Callable[[torch.Tensor], Future[T]],
    ) -> Future[T]:
        """Bring the outer gradient ``outer - theta`` of ``fragment`` to the host and call
        ``start`` with it (on the worker, once the copy is complete); returns a future of
        the result of the future ``start`` returns.

        With ``outer`` on the host, theta is copied and subtracted there (the arithmetic of
        a CPU node); with ``outer`` on the device, the difference is made there and copied.
        """
        buffer = self.buffers[fragment]
        flat = [p.detach().reshape(-1) for _, p in params]
        if outer.is_cuda:
            buffer.copy_(outer - torch.cat(flat), non_blocking=True)
        else:
            offset = 0
            for x in flat:
                buffer[offset : offset + x.numel()].copy_(x, non_blocking=True)
                offset += x.numel()
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()
        result: Future[T] = Future()

        def job() -> None:
            try:
                copied.synchronize()
                # a copy: the reducer may hold the delta while this buffer is reused
                delta = buffer.clone() if outer.is_cuda else outer - buffer
                chain(start(delta), result)
            except BaseException as error:
                if result.set_running_or_notify_cancel():
                    result.set_exception(error)

        self.jobs = [j for j in self.jobs if not j.done()]
        self.jobs.append(self.worker.submit(job))
        return result

    def merge(self, fragment: int, outer: torch.Tensor, params: NamedParams, alpha: float) -> None:
        """``theta = alpha * theta + (1 - alpha) * outer`` on the device (docs/design.md "Algorithm
        and schedule" step 5), with the float operations of
        ``diloco.node.training.outer_step.merge``; a host ``outer`` is uploaded asynchronously first
        and must not change until ``wait_upload``."""
        if alpha == 1:
            return
        new_outer = outer
        if not outer.is_cuda:
            new_outer = outer.to(self.device, non_blocking=True)
            uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
            uploaded.record()
            self.uploads[fragment] = uploaded
        offset = 0
        with torch.no_grad():
            for _, param in params:
                new = new_outer[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                param.copy_(new if alpha == 0 else param * alpha + new * (1 - alpha))

    def wait_upload(self, fragment: int) -> None:
        """Block until the last upload from the fragment's host vector is complete."""
        event = self.uploads.pop(fragment, None)
        if event is not None:
            event.synchronize()

    def settle(self) -> None:
        """Wait for every queued send and upload (before the host state is read whole,
        replaced or saved)."""
        for job in self.jobs:
            job.result()  # job() never raises: errors go to the round's future
        self.jobs = []
        for fragment in list(self.uploads):
            self.wait_upload(fragment)


def chain(source: Future[T], target: Future[T]) -> None:
    """Resolve ``target`` as ``source`` resolves (result or exception); a ``target``
    cancelled meanwhile (a stopping node gave the round up) cancels ``source`` too."""

    def forward(done: Future[T]) -> None:
        if not target.set_running_or_notify_cancel():
            return
        if done.cancelled():
            target.set_exception(concurrent.futures.CancelledError())
        elif (error := done.exception()) is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    target.add_done_callback(lambda t: source.cancel() if t.cancelled() else None)
    source.add_done_callback(forward)
