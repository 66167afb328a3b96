"""The GPU check, for one CUDA device (run through ``benchmarks/gpu_check.sh``).

Sections, each timed and each allowed to fail on its own (its error is recorded):

1. ``correctness``: two CUDA replicas (bf16, micro-batches) reduced in process keep
   bit-identical outer states, with the outer state in pinned host memory and on the
   device; and the asynchronous device link gives exactly the outer states of the
   synchronous path (the link switched off), step for step.
2. ``overhead``: ``NodeTrainer`` (group-of-one reducer: codec, outer step, merge) against a
   plain PyTorch loop, same model, batch and fused AdamW (``node_overhead.py inprocess``),
   for fp32 (TF32), bf16, bf16 with the outer state on the device, and bf16 compiled.
3. ``codec``: E3M0 ``encode_blocks``/``decode_blocks`` on the device against the CPU codec
   (same bytes; throughput), and what the host copy of a fragment costs raw vs encoded.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``. ``--dry-run`` runs the same
code on the CPU with tiny sizes (to test the script without a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import node_overhead

from diloco.bench.provenance import provenance
from diloco.codecs import get_codec
from diloco.codecs.e3m0 import E3M0Codec
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import load_corpus
from diloco.node.model.compute import ComputeOptions
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import (
    Contribution,
    InProcessReducer,
    Reducer,
    RoundKey,
    RoundResult,
)


class PairReducer(Reducer):
    """Two trainers' rounds, reduced in process once both have sent them (a CUDA trainer
    sends from its device link's worker thread, hence the lock)."""

    def __init__(self) -> None:
        self.reducer = InProcessReducer(get_codec("e3m0"))
        self.waiting: dict[RoundKey, list[tuple[Contribution, Future[RoundResult]]]] = {}
        self.lock = threading.Lock()

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        future: Future[RoundResult] = Future()
        with self.lock:
            entries = self.waiting.setdefault(key, [])
            entries.append((contributions[0], future))
            complete = len(entries) == 2
        if complete:  # members in name order, whichever thread sent first (the swarm's rule)
            entries.sort(key=lambda entry: entry[0].member)
            result = self.reducer.reduce(key, [c for c, _ in entries]).result()
            for _, waiting in entries:
                waiting.set_result(result)
        return future


def _pair(device: str, outer_device: str, steps: int, linked: bool = True) -> list[list[str]]:
    """Outer state hashes of two replicas after every step (replica a's, then b's)."""
    corpus = load_corpus(None)
    run = RunConfig(steps=steps, seq_len=64, outer=OuterConfig(sync_every=6, fragment_sync_delay=2))
    compute = ComputeOptions(precision="bf16", micro_batch_size=2)
    pair = PairReducer()
    trainers = []
    for seed in (1, 2):
        options = NodeOptions(
            batch_size=4, device=device, data_seed=seed, compute=compute, outer_device=outer_device
        )  # type: ignore[arg-type]
        trainer = NodeTrainer(run, options, pair, f"r{seed}", corpus)
        if not linked:
            trainer.sync.link = None  # the synchronous path of a CPU model, on the GPU
        trainers.append(trainer)
    hashes = []
    for _ in range(steps):
        for trainer in trainers:
            trainer.train_step()
        for trainer in trainers:
            trainer.sync.settle()
        hashes.append([s.sha256() for t in trainers for s in t.sync.states])
    return hashes


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    """Deterministic kernels here (CUDA's embedding backward adds atomically otherwise), so
    that two runs of one configuration can be compared bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _correctness(args)
    finally:
        torch.use_deterministic_algorithms(False)


def _correctness(args: argparse.Namespace) -> dict[str, Any]:
    steps = 8 if args.dry_run else 30
    result: dict[str, Any] = {}
    runs = {where: _pair(args.device, where, steps) for where in ("cpu", "device")}
    for where, hashes in runs.items():
        half = len(hashes[-1]) // 2
        result[f"replicas_identical_outer_{where}"] = all(h[:half] == h[half:] for h in hashes)
    result["async_link_equals_sync_path"] = runs["cpu"] == _pair(args.device, "cpu", steps, False)
    result["ok"] = all(result.values())
    # Not required (the option's docs say it may differ): does the update on the device
    # round like the host's?
    result["outer_on_device_equals_host_update"] = runs["device"] == runs["cpu"]
    return result


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    configs = [
        ("fp32 (tf32)", {"precision": "fp32"}),
        ("bf16", {"precision": "bf16"}),
        ("bf16, outer on device", {"precision": "bf16", "outer_device": "device"}),
        ("bf16, compiled", {"precision": "bf16", "compile": True, "repeats": 1}),
    ]
    base = {
        "preset": "tiny" if args.dry_run else "100M",
        "batch_size": 4 if args.dry_run else 16,
        "seq_len": 64 if args.dry_run else 1024,
        "steps": 12 if args.dry_run else 150,
        "warmup": 2 if args.dry_run else 10,
        "H": 6 if args.dry_run else 30,
        "codec": "e3m0",
        "device": args.device,
        "precision": "fp32",
        "compile": False,
        "outer_device": "cpu",
        "repeats": 1 if args.dry_run else 2,
        "data": None,
    }
    rows = {}
    for name, changes in configs:
        settings = argparse.Namespace(**{**base, **changes})
        rows[name] = _section(lambda s=settings: _summary(node_overhead.inprocess(s)), args)
    return rows


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    plain = [b["tokens_per_s"] for b in result["plain"]]
    node = [b["tokens_per_s"] for b in result["node"]]
    return {
        "plain_tokens_per_s": plain,
        "node_tokens_per_s": node,
        "ratios": result["ratios"],
        "sync_ms_per_step": [b["sync_ms_per_step"] for b in result["node"]],
        "rounds": [b["rounds"] for b in result["node"]],
    }


def _time(device: torch.device, fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def codec(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    numel = 2**20 if args.dry_run else 64 * 2**20
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    on_device = x.to(device)
    e3m0 = E3M0Codec("nearest")
    scales, packed = e3m0.encode_blocks(on_device)
    same_bytes = (
        scales.cpu().numpy().tobytes() + packed.cpu().numpy().tobytes() == (e3m0.encode(x)[5:])
    )
    decoded = e3m0.decode_blocks(scales, packed, numel)
    same_values = torch.equal(decoded.cpu(), e3m0.decode(e3m0.encode(x)))
    pinned = torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")
    seconds = {
        "encode_device": _time(device, lambda: e3m0.encode_blocks(on_device)),
        "decode_device": _time(device, lambda: e3m0.decode_blocks(scales, packed, numel)),
        "encode_cpu": _time(torch.device("cpu"), lambda: e3m0.encode(x), repeats=2),
        "copy_fp32_to_pinned_host": _time(device, lambda: pinned.copy_(on_device)),
        "copy_e3m0_to_host": _time(device, lambda: (scales.cpu(), packed.cpu())),
    }
    return {
        "numel": numel,
        "same_bytes_as_cpu_codec": same_bytes,
        "same_values_as_cpu_codec": same_values,
        "gvalues_per_s": {k: numel / v / 1e9 for k, v in seconds.items()},
        "ms": {k: 1000 * v for k, v in seconds.items()},
    }


def _section(fn: Callable[[], dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    if time.perf_counter() - args.started > args.budget_s:
        return {"skipped": f"over the {args.budget_s:.0f} s budget"}
    try:
        result = fn()
    except Exception as error:  # one failed section must not lose the others' results
        result = {"error": repr(error), "traceback": traceback.format_exc()[-2000:]}
    result["seconds"] = time.perf_counter() - start
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# GPU check: {report['environment']['device_name']}",
        "",
        f"torch {report['environment']['torch']}, python {report['environment']['python']}",
        "",
        "## Correctness",
        "",
        "```",
        json.dumps(report["correctness"], indent=1),
        "```",
        "",
        "## Node against a plain loop (tokens/s; node/plain per repeat)",
        "",
        "| config | plain | node | node/plain | outer loop ms/step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in report["overhead"].items():
        if "ratios" not in row:
            lines.append(f"| {name} | {row.get('error') or row.get('skipped')} | | | |")
            continue
        lines.append(
            f"| {name} | {', '.join(f'{v:,.0f}' for v in row['plain_tokens_per_s'])} | "
            f"{', '.join(f'{v:,.0f}' for v in row['node_tokens_per_s'])} | "
            f"{', '.join(f'{v:.3f}' for v in row['ratios'])} | "
            f"{', '.join(f'{v:.2f}' for v in row['sync_ms_per_step'])} |"
        )
    lines += ["", "## E3M0", "", "```", json.dumps(report["codec"], indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes.")
    parser.add_argument("--budget-s", type=float, default=420.0)
    args = parser.parse_args()
    args.started = time.perf_counter()
    args.device = "cpu" if args.dry_run else "cuda:0"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; use --dry-run to test on a CPU")
    if args.dry_run:
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(0) if not args.dry_run else f"CPU ({platform.processor()})"
    report: dict[str, Any] = {
        "environment": {
            "device_name": name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "dry_run": args.dry_run,
            "hivemind": importlib.util.find_spec("hivemind") is not None,
        }
    }
    report["correctness"] = _section(lambda: correctness(args), args)
    report["codec"] = _section(lambda: codec(args), args)
    report["overhead"] = overhead(args)
    report["seconds"] = time.perf_counter() - args.started
    report["provenance"] = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
