"""Node overhead: tokens/s of the node's compute against a plain PyTorch loop.

Subcommands (results as JSON with ``--json``; commands and numbers in RESULTS.md):

- ``swarm``: a swarm of 2 ``diloco-node`` processes on loopback (``start`` + ``join``, rounds
  included, E3M0, metrics written) and, at the same time, 2 plain-loop processes: same
  model, batch, optimizer (fused AdamW, clipping, the same schedule) and data sampler, one
  torch thread per process. Running both sides at once makes them share whatever else
  loads the machine (on a shared machine that load changes by tens of percent between
  minutes, more than the overhead measured). The window: from 20 steps after the joiner
  is in to the nodes' last progress line but one; the nodes' tokens/s over it come from
  their progress lines, the plain loops' from their step end times inside it (the plain
  loops run until the nodes end; the length of their schedule changes no step's cost).
- ``inprocess``: in one process, ``NodeTrainer`` with a group-of-one reducer (each round's
  outer gradient through the codec, the outer step, the merge; no network) against the
  plain loop, in interleaved blocks; also what the outer loop costs a step (time in
  ``send_due`` + ``apply_due``). Runs on any device; the GPU check uses it.
- ``plain``: the plain loop alone (what ``swarm`` spawns).

e.g. ``python benchmarks/node_overhead.py swarm --steps 300 --repeats 2 --json r.json``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diloco.bench.provenance import provenance
from diloco.codecs import get_codec
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import BatchSampler, Corpus, load_corpus
from diloco.node.model.compute import ComputeOptions, compile_model, configure_backends
from diloco.node.model.transformer import Transformer
from diloco.node.training.inner import InnerConfig, lr_at
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import InProcessReducer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens_per_s(args: argparse.Namespace, times: list[float]) -> float:
    measured = times[args.warmup :]
    return args.batch_size * args.seq_len * len(measured) / sum(measured)


def plain_loop(args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    """nanoGPT's loop: the node's model, fused AdamW with decay on matrices, clipping, the
    same learning-rate schedule, one batch per step, no synchronisation of any kind."""
    device = torch.device(args.device)
    configure_backends(device, tf32=True)
    run = RunConfig(preset=args.preset, seq_len=args.seq_len, steps=args.steps)
    torch.manual_seed(0)
    model = Transformer(run.model_config()).to(device)
    if args.compile:
        compile_model(model)
    inner = InnerConfig()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=inner.lr, betas=inner.betas, fused=True)
    sampler = BatchSampler(corpus.train, args.batch_size, args.seq_len, seed=1)
    bf16 = args.precision == "bf16"
    times, stamps = [], []
    stop = Path(args.stop_file) if getattr(args, "stop_file", None) else None
    for step in range(1, args.steps + 1):
        if stop is not None and stop.exists():
            break
        start = time.perf_counter()
        inputs, targets = (t.to(device) for t in sampler.next_batch())
        optimizer.zero_grad(set_to_none=True)
        context = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
        with context:
            _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, inner)
        optimizer.step()
        loss.item()  # the node reads its loss every step too
        times.append(time.perf_counter() - start)
        stamps.append(time.time())
    _sync(device)
    return {
        "tokens_per_s": _tokens_per_s(args, times),
        "last_loss": float(loss.item()),
        "step_end_times": stamps,
    }


def node_loop(args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    """``NodeTrainer.train_step`` with a group-of-one in-process reducer: every round runs
    the codec, the outer step and the merge, without a network."""
    run = RunConfig(
        preset=args.preset,
        seq_len=args.seq_len,
        steps=args.steps,
        codec=args.codec,
        outer=OuterConfig(sync_every=args.H),
    )
    compute = ComputeOptions(precision=args.precision, compile=args.compile)
    options = NodeOptions(
        batch_size=args.batch_size,
        device=args.device,
        data_seed=1,
        compute=compute,
        outer_device=args.outer_device,
    )
    trainer = NodeTrainer(run, options, InProcessReducer(get_codec(args.codec)), "solo", corpus)
    sync_seconds = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                sync_seconds[0] += time.perf_counter() - start

        return wrapper

    trainer.sync.send_due = timed(trainer.sync.send_due)  # type: ignore[method-assign]
    trainer.sync.apply_due = timed(trainer.sync.apply_due)  # type: ignore[method-assign]
    times, rounds = [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        loss, applied = trainer.train_step()
        times.append(time.perf_counter() - start)
        rounds += sum(r.ok for r in applied)
    trainer.sync.settle()
    _sync(trainer.device)
    return {
        "tokens_per_s": _tokens_per_s(args, times),
        "sync_ms_per_step": 1000 * sync_seconds[0] / args.steps,
        "rounds": rounds,
        "last_loss": loss,
    }


def inprocess(args: argparse.Namespace) -> dict[str, Any]:
    corpus = load_corpus(args.data)
    blocks: dict[str, list[dict[str, Any]]] = {"plain": [], "node": []}
    for repeat in range(args.repeats):
        order = ("plain", "node") if repeat % 2 == 0 else ("node", "plain")
        for side in order:
            run = plain_loop if side == "plain" else node_loop
            blocks[side].append(run(args, corpus))
    ratios = [
        n["tokens_per_s"] / p["tokens_per_s"]
        for n, p in zip(blocks["node"], blocks["plain"], strict=True)
    ]
    return {"mode": "inprocess", "settings": vars(args), **blocks, "ratios": ratios}


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def _wait(process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    if process.wait(timeout) != 0:
        raise RuntimeError(f"{process.args} failed:\n{log.read_text()[-3000:]}")


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--preset", args.preset, "--seq-len", str(args.seq_len), "--batch-size",
        str(args.batch_size), "--steps", str(args.steps),
    ]  # fmt: skip


def swarm_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """2 plain loops and 2 nodes (start + join) at once; each side's tokens/s over the
    window where the nodes both train, the plain loops' from their step times in it."""
    plain = [sys.executable, __file__, "plain", *_common(args), "--warmup", "0"]
    stop = folder / "stop"
    loops = [
        _spawn(
            [*plain, "--steps", "100000", "--stop-file", str(stop), "--json",
             str(folder / f"plain{i}.json")],
            folder / f"plain{i}.log",
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        seen = _run_nodes(args, folder)
    finally:
        stop.touch()
    for i, loop in enumerate(loops):
        _wait(loop, folder / f"plain{i}.log", 600)
    records = {name: _records(folder / f"{name}.jsonl") for name in ("a", "b")}
    tokens_per_step = args.batch_size * args.seq_len
    clocks = {name: _clock(rs, tokens_per_step) for name, rs in records.items()}
    joined = next(r["step"] for r in records["b"] if r["event"] == "joined")
    common = sorted(set(clocks["a"]) & set(clocks["b"]) & set(seen["a"]) & set(seen["b"]))
    first = next(s for s in common if s >= joined + 20)  # both nodes train from here on
    last = common[-2]
    result: dict[str, Any] = {"window_steps": [first, last], "joined_at": joined}
    for name, clock in clocks.items():
        summary = next(r for r in records[name] if r["event"] == "summary")
        rounds = [r for r in records[name] if r["event"] == "round" and first < r["step"] <= last]
        result[name] = {
            "tokens_per_s": (last - first) * tokens_per_step / (clock[last] - clock[first]),
            "rounds_in_window": len(rounds),
            "two_member_rounds": sum(r["members"] == 2 for r in rounds),
            "cu_whole_run": summary["cu"],
            "failed_rounds_whole_run": summary["failed_rounds"],
        }
    begin = min(seen[n][first] for n in ("a", "b"))
    end = max(seen[n][last] for n in ("a", "b"))
    result["window_seconds"] = end - begin
    for i in range(2):
        stamps = json.loads((folder / f"plain{i}.json").read_text())["step_end_times"]
        steps = sum(begin < t <= end for t in stamps)
        result[f"plain{i}"] = {"tokens_per_s": steps * tokens_per_step / (end - begin)}
    return result


def _run_nodes(args: argparse.Namespace, folder: Path) -> dict[str, dict[int, float]]:
    """Start a node, join a second to it, wait for both to finish; returns the wall time
    (``time.time()``) at which each progress line of each node was seen (polled 20 Hz)."""
    node = [sys.executable, "-m", "diloco"]
    flags = [*_common(args), "--threads", "1", "--log-every", "10", "--H", str(args.H)]
    a = _spawn(
        [*node, "start", "--name", "bench", *flags, "--listen", "/ip4/127.0.0.2/tcp/0",
         "--metrics-out", str(folder / "a.jsonl")],
        folder / "a.log",
    )  # fmt: skip
    processes = [a]
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None:
            if time.monotonic() > deadline or a.poll() is not None:
                raise RuntimeError(f"no address:\n{(folder / 'a.log').read_text()}")
            lines = (folder / "a.log").read_text().splitlines()
            address = next((x.strip() for x in lines if x.startswith("/ip4/127.")), None)
            time.sleep(0.2)
        processes.append(
            _spawn(
                [*node, "join", "--initial-peers", address, "--threads", "1", "--batch-size",
                 str(args.batch_size), "--log-every", "10", "--listen", "/ip4/127.0.0.3/tcp/0",
                 "--metrics-out", str(folder / "b.jsonl")],
                folder / "b.log",
            )
        )  # fmt: skip
        seen: dict[str, dict[int, float]] = {"a": {}, "b": {}}
        read = {"a": 0, "b": 0}  # bytes of each metrics file already looked at
        deadline = time.monotonic() + 1800
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            for name in seen:
                path = folder / f"{name}.jsonl"
                with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
                    f.seek(read[name])
                    lines = f.read().split(b"\n")
                    read[name] += sum(len(line) + 1 for line in lines[:-1])
                    for line in lines[:-1]:
                        if b'"event": "progress"' in line:
                            step = json.loads(line)["step"]
                            seen[name].setdefault(step, time.time())
            time.sleep(0.05)
        for name, process in zip(("a", "b"), processes, strict=True):
            _wait(process, folder / f"{name}.log", 60)
        return seen
    finally:
        for process in processes:
            process.kill()


def _clock(records: list[dict[str, Any]], tokens_per_step: int) -> dict[int, float]:
    """Seconds since the node's loop began, at each progress line's step: its tokens/s is
    counted from the loop's first step (``start_step``), so elapsed = tokens / rate."""
    start = next(r["start_step"] for r in records if r["event"] == "config")
    return {
        r["step"]: (r["step"] - start) * tokens_per_step / r["tokens_per_s"]
        for r in records
        if r["event"] == "progress"
    }


def swarm(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="diloco-overhead-") as tmp:
            folder = Path(tmp)
            record = swarm_run(args, folder)
            plain = statistics.mean(record[f"plain{i}"]["tokens_per_s"] for i in range(2))
            nodes = statistics.mean(record[n]["tokens_per_s"] for n in ("a", "b"))
            record["ratio"] = nodes / plain
            runs.append(record)
            print(json.dumps(record), flush=True)
    return {"mode": "swarm", "settings": vars(args), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["swarm", "inprocess", "plain"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the timing.")
    parser.add_argument("--H", type=int, default=30)
    parser.add_argument("--codec", default="e3m0")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--outer-device", choices=["cpu", "device"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data", default=None, help="Corpus path [default: embedded].")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--stop-file", default=None, help="plain: stop once it exists.")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "plain":
        result = plain_loop(args, load_corpus(args.data))
    elif args.mode == "inprocess":
        result = inprocess(args)
    else:
        result = swarm(args)
    text = json.dumps(result | {"provenance": provenance()}, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
