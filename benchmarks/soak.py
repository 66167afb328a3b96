"""Soak run: 3 real nodes for a long time; does anything grow after warm-up?

``diloco-node start`` + 2 ``join`` on loopback (tiny preset, embedded data, one torch thread
each, a schedule far longer than the run), sampled every ``--interval`` seconds from /proc:
RSS, open file descriptors and sockets of each node, its DHT process and its p2pd (found as
its descendants by parent PID). After ``--minutes`` the nodes get SIGINT. Per process: the
value at the end of warm-up and at the end, the least-squares slope per hour over the
samples after warm-up and the residual spread around that line; growth counts as "beyond
noise" when the fitted growth over the post-warm-up window is more than 3 residual standard
deviations and more than 2 MB (hivemind issue #264 reports an averager that leaks).

e.g. ``nice -n 10 python benchmarks/soak.py --minutes 30`` (JSON in benchmarks/results/soak.json,
plot benchmarks/figures/soak.png, the markdown table on stdout); ``--minutes 2 --out /tmp/s.json
--fig /tmp/s.png`` checks the script.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco.bench.procs import NodeProcess, sample
from diloco.bench.provenance import provenance

HERE = Path(__file__).parent
NODE_ARGS = ["--seq-len", "32", "--batch-size", "4", "--threads", "1", "--log-every", "100"]
STEPS = 10_000_000  # longer than any soak: the nodes are stopped by SIGINT


def start_swarm(folder: Path) -> list[NodeProcess]:
    a = NodeProcess(
        "a",
        ["start", "--name", "soak", "--steps", str(STEPS), *NODE_ARGS,
         "--listen", "/ip4/127.0.0.2/tcp/0"],
        folder,
    )  # fmt: skip
    address = a.address()
    joiners = [
        NodeProcess(
            name,
            [
                "join",
                "--initial-peers",
                address,
                *NODE_ARGS,
                "--listen",
                f"/ip4/127.0.0.{host}/tcp/0",
            ],
            folder,
        )
        for name, host in (("b", 3), ("c", 4))
    ]
    return [a, *joiners]


def stop(nodes: list[NodeProcess]) -> dict[str, int | None]:
    for node in nodes:
        if node.alive():
            node.process.send_signal(signal.SIGINT)
    codes: dict[str, int | None] = {}
    for node in nodes:
        try:
            codes[node.name] = node.process.wait(90)
        except subprocess.TimeoutExpired:  # recorded, then killed
            codes[node.name] = None
            node.kill_group()
    return codes


def fit(times_h: list[float], values: list[float]) -> tuple[float, float]:
    """Least-squares slope (per hour) and the residual standard deviation."""
    if len(values) < 3:
        return 0.0, 0.0
    mt, mv = statistics.fmean(times_h), statistics.fmean(values)
    var = sum((t - mt) ** 2 for t in times_h)
    slope = sum((t - mt) * (v - mv) for t, v in zip(times_h, values, strict=True)) / var
    residuals = [v - (mv + slope * (t - mt)) for t, v in zip(times_h, values, strict=True)]
    return slope, statistics.pstdev(residuals)


def analyse(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    """One row per (node, role): RSS/fds/sockets at warm-up end and at the end, slope."""
    series: dict[str, list[tuple[float, dict[str, int]]]] = {}
    for s in samples:
        for node, roles in s["nodes"].items():
            for role, used in roles.items():
                series.setdefault(f"{node}/{role}", []).append((s["t"], used))
    rows = []
    for key, points in sorted(series.items()):
        after = [(t, u) for t, u in points if t >= warmup_s]
        if len(after) < 3:
            continue
        hours = [t / 3600 for t, _ in after]
        rss_mb = [u["rss_kb"] / 1024 for _, u in after]
        slope, noise = fit(hours, rss_mb)
        growth = slope * (hours[-1] - hours[0])
        rows.append(
            {
                "process": key,
                "pids": sorted({u["pid"] for _, u in points}),
                "rss_mb_warm": rss_mb[0],
                "rss_mb_end": rss_mb[-1],
                "rss_mb_max": max(rss_mb),
                "rss_slope_mb_per_h": slope,
                "rss_residual_sd_mb": noise,
                "rss_fitted_growth_mb": growth,
                "rss_grows": growth > max(3 * noise, 2.0),
                "fds_warm": after[0][1]["fds"],
                "fds_end": after[-1][1]["fds"],
                "fds_max": max(u["fds"] for _, u in after),
                "sockets_warm": after[0][1]["sockets"],
                "sockets_end": after[-1][1]["sockets"],
                "sockets_max": max(u["sockets"] for _, u in after),
                "fds_slope_per_h": fit(hours, [float(u["fds"]) for _, u in after])[0],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| process | RSS MB at warm-up end | RSS MB at end | slope MB/h | residual sd MB "
        "| grows beyond noise | fds warm/end/max | sockets warm/end/max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['process']} | {r['rss_mb_warm']:.1f} | {r['rss_mb_end']:.1f} "
            f"| {r['rss_slope_mb_per_h']:+.2f} | {r['rss_residual_sd_mb']:.2f} "
            f"| {'yes' if r['rss_grows'] else 'no'} "
            f"| {r['fds_warm']}/{r['fds_end']}/{r['fds_max']} "
            f"| {r['sockets_warm']}/{r['sockets_end']}/{r['sockets_max']} |"
        )
    return "\n".join(lines)


def plot(samples: list[dict[str, Any]], warmup_s: float, path: Path) -> None:
    """RSS, RSS change since the end of warm-up, fds, sockets: colour = role, style = node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    keys = sorted({f"{n}/{r}" for s in samples for n, roles in s["nodes"].items() for r in roles})
    colours = {"node": "C0", "dht": "C1", "p2pd": "C2", "shm_manager": "C7"}
    styles = ["-", "--", ":"]
    nodes = sorted({k.split("/")[0] for k in keys})
    for key in keys:
        node, role = key.split("/")
        points = [(s["t"], s["nodes"][node][role]) for s in samples
                  if role in s["nodes"].get(node, {})]  # fmt: skip
        t = [p[0] / 60 for p in points]
        rss = [p[1]["rss_kb"] / 1024 for p in points]
        warm = next((r for (sec, _), r in zip(points, rss, strict=True) if sec >= warmup_s), rss[0])
        style = {
            "color": colours.get(role.split("#")[0], "C3"),
            "linestyle": styles[nodes.index(node) % 3],
        }
        axes[0].plot(t, rss, label=key, **style)
        axes[1].plot(t, [r - warm for r in rss], label=key, **style)
        axes[2].plot(t, [p[1]["fds"] for p in points], label=key, **style)
        axes[3].plot(t, [p[1]["sockets"] for p in points], label=key, **style)
    labels = ("RSS (MB)", "RSS change since warm-up end (MB)", "open file descriptors", "sockets")
    for ax, label in zip(axes, labels, strict=True):
        ax.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(-30, 30)
    axes[0].legend(fontsize=7, ncol=4)
    axes[0].set_title("Soak: 3 diloco-node processes on loopback (dashed: end of warm-up)")
    axes[3].set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def rounds(node: NodeProcess) -> dict[str, int]:
    records = node.records()
    return {
        "step": node.step(),
        "rounds_applied": sum(r.get("event") == "round" for r in records),
        "rounds_failed": sum(r.get("event") == "round_failed" for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--warmup-minutes", type=float, default=None, help="default: 5, or a quarter of a short run"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    parser.add_argument("--fig", type=Path, default=HERE / "figures" / "soak.png")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and metrics")
    parser.add_argument("--replot", action="store_true", help="redraw --out; run nothing")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.out.read_text())
        plot(saved["samples"], saved["warmup_s"], args.fig)
        print(markdown(saved["rows"]))
        return
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None
                     else min(5.0, args.minutes / 4))  # fmt: skip
    folder = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"logs and metrics in {folder}", flush=True)

    nodes = start_swarm(folder)
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < 60 * args.minutes:
            samples.append({"t": elapsed, "nodes": {n.name: sample(n.pid) for n in nodes}})
            dead = [n.name for n in nodes if not n.alive()]
            if dead:
                print(f"nodes exited early: {dead}", flush=True)
                break
            if len(samples) % 6 == 1:
                total = sum(u["rss_kb"] for r in samples[-1]["nodes"].values() for u in r.values())
                print(f"{elapsed / 60:5.1f} min: total RSS {total / 1024:.0f} MB, steps "
                      f"{[n.step() for n in nodes]}", flush=True)  # fmt: skip
            time.sleep(max(0.0, args.interval - (time.monotonic() - start - elapsed)))
    finally:
        progress = {n.name: rounds(n) for n in nodes}
        exit_codes = stop(nodes)
    rows = analyse(samples, warmup_s)
    result = {
        "minutes": args.minutes,
        "interval_s": args.interval,
        "warmup_s": warmup_s,
        "node_args": NODE_ARGS,
        "progress": progress,
        "exit_codes": exit_codes,
        "rows": rows,
        "samples": samples,
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(samples, warmup_s, args.fig)
    print(json.dumps({"progress": progress, "exit_codes": exit_codes}))
    print(markdown(rows))


if __name__ == "__main__":
    main()
