"""A swarm across a simulated wide-area network: N real nodes on loopback, every connection
through a delay proxy (``diloco.bench.wan_proxy``), at one or more round-trip times.

Node X listens on ``127.0.0.1:PX`` and ``--announce``-s ``/ip4/127.0.0.1/tcp/QX``, where a
proxy in this process listens on ``QX`` and forwards to ``PX`` after ``RTT / 2`` each way;
joiners bootstrap from the creator's announced (proxied) address. Peers dial what a node
announces, so each connection crosses the proxy of the node that accepted it, once: every
pair of nodes is ``RTT`` apart whichever way its connection was dialled. The script checks
that by comparing, every few seconds, the connections each node accepted (``/proc/net/tcp``)
with those its proxy holds open (``bypass`` in the results: connections that did not cross
a proxy, e.g. the brief plain-TCP dial-back checks).

``--up-mbit U --down-mbit D`` (root) puts each node in a network namespace of its own
(``diloco.bench.netns``: a veth to a shared bridge, ``tc tbf`` at U Mbit/s on what the node
sends and D on what it receives, an asymmetric home line); node X then listens on
``10.77.0.X:4001`` and its proxy, run in the same namespace, on ``10.77.0.X:4002``, so every
byte between two nodes crosses the sender's upload, the receiver's download and one proxy's
delay. ``--jitter-ms`` adds a uniform delay per chunk (in order) on top of ``RTT / 2``.

Per node, over the steady state (from the first step by which every node has been in a
round with all N, plus ``--warmup-steps``; the rounds a joiner's slow first steps make the
creator fail alone come before it, and ``startup_failed`` counts them), from its
``--metrics-out`` records: CU (compute / (compute + blocked), as the trainer counts it:
blocked on rounds and on sends held for a heal), round seconds (median), failed / attempted
rounds, heals, the round trips on each round's critical path (median, and the median
seconds of each kind of exchange on it), and the eval loss of the outer weights at the end
(node X reads data stream X, ``--data-seed X``, in every run, so losses at two RTTs differ
by the network alone); in the JSON also where the training thread's time went
(``thread_seconds``: compute, blocked on rounds, held for a heal, the rest of each step,
between steps) and ``cu_wall``, compute over all of it.
By default every node waits for all the others before its first step
(``--start together``, the nodes' ``--wait-for-peers``): the joiners take the state of step 0
and all nodes train the same steps, so the losses at two RTTs compare at equal steps; with
``--start staggered`` a joiner starts wherever the creator is when it comes in, which takes
more round trips at a longer RTT.
Writes a JSON with the git commit and prints a table. ``docs/design.md "Across the
internet"`` has the figures.

    flock /tmp/diloco-heavy.lock python benchmarks/wan.py --rtt-ms 0 100 200 --steps 250
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.bench import netns
from diloco.bench.procs import NodeProcess
from diloco.bench.wan_proxy import LOOPBACK, DelayProxy
from diloco.sim.protocol_sim import LinkModel, SwarmSpec, summarise
from diloco.sim.round_costs import predict_cu

HERE = Path(__file__).resolve().parent
NODE_PORT, PROXY_PORT = 4001, 4002
"""Ports in a node's own namespace (``--up-mbit``), where nothing else listens."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


class Proxies:
    """One delay proxy per node, each on an event loop in a thread of this process; under
    ``--up-mbit`` the thread first enters its node's namespace, so the proxy listens and dials
    there, beside its node."""

    def __init__(
        self,
        targets: list[int],
        one_way: float,
        jitter: float,
        hosts: list[str],
        namespaces: list[str | None],
        port: int = 0,
    ) -> None:
        self.loops = [asyncio.new_event_loop() for _ in targets]
        self.threads = [
            threading.Thread(target=self._run, args=(loop, ns), daemon=True)
            for loop, ns in zip(self.loops, namespaces, strict=True)
        ]
        for thread in self.threads:
            thread.start()
        self.proxies = [
            DelayProxy(t, one_way, jitter=jitter, seed=i, host=h, port=port)
            for i, (t, h) in enumerate(zip(targets, hosts, strict=True))
        ]
        self.ports = [self._call(i, p.start()) for i, p in enumerate(self.proxies)]

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, namespace: str | None) -> None:
        if namespace is not None:
            netns.enter(namespace)  # this thread only: its sockets live there
        loop.run_forever()

    def _call(self, i: int, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loops[i]).result(30)

    def close(self) -> None:
        for i, proxy in enumerate(self.proxies):
            self._call(i, proxy.close())
            self.loops[i].call_soon_threadsafe(self.loops[i].stop)
        for thread in self.threads:
            thread.join(10)


def direct_connections(pid: int, port: int, proxy_ports: set[int]) -> int:
    """Established TCP connections on a node's listening ``port`` that are not its dials to
    a proxy: those accepted there (from its proxy, or around it), as the node process
    ``pid`` sees them (its namespace's table). p2pd dials from its listening port too (port
    reuse), hence the exclusion."""
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = (int(fields[k].rsplit(":", 1)[1], 16) for k in (1, 2))
            if fields[3] == "01" and local == port and remote not in proxy_ports:  # ESTABLISHED
                count += 1
    return count


@contextlib.contextmanager
def links(args: argparse.Namespace) -> Iterator[list[str | None]]:
    """Each node's network namespace, throttled (``--up-mbit``), or None each: loopback."""
    if args.up_mbit is None:
        yield [None] * args.nodes
        return
    shaping = netns.Shaping(
        f"{args.up_mbit:g}mbit", download_rate=f"{args.down_mbit or args.up_mbit:g}mbit"
    )
    with netns.hosts(f"w{os.getpid() % 100000}", args.nodes, shaping) as names:
        yield list(names)


def run_point(args: argparse.Namespace, rtt_ms: float, folder: Path) -> dict[str, Any]:
    """One swarm at ``rtt_ms``; returns its per-node figures."""
    with links(args) as namespaces:
        return run_swarm(args, rtt_ms, folder, namespaces)


def run_swarm(
    args: argparse.Namespace, rtt_ms: float, folder: Path, namespaces: list[str | None]
) -> dict[str, Any]:
    """One swarm at ``rtt_ms``, node ``i`` in ``namespaces[i]`` (None: loopback)."""
    n = args.nodes
    if namespaces[0] is None:
        hosts = [LOOPBACK] * n
        listen = [free_port() for _ in range(n)]
        proxies = Proxies(listen, rtt_ms / 2000, args.jitter_ms / 1000, hosts, namespaces)
    else:  # a namespace each: every port is free there
        hosts = [netns.address(i) for i in range(n)]
        listen = [NODE_PORT] * n
        proxies = Proxies(
            listen, rtt_ms / 2000, args.jitter_ms / 1000, hosts, namespaces, PROXY_PORT
        )
    common = ["--tau", str(args.tau), "--threads", "1", "--log-every", "50"]
    if args.start == "together":
        common += ["--wait-for-peers", str(n - 1)]
    nodes: list[NodeProcess] = []
    bypass_max = [0] * n
    start = time.monotonic()
    try:

        def addresses(i: int) -> list[str]:
            own = f"/ip4/{hosts[i]}/tcp/{listen[i]}"
            shown = f"/ip4/{hosts[i]}/tcp/{proxies.ports[i]}"
            ckpt = str(folder / f"ckpt{i}")
            # Node i reads data stream i in every run: eval losses at two RTTs compare the
            # network's effect, not two draws of the data.
            seed = ["--data-seed", str(i)]
            return ["--listen", own, "--announce", shown, "--checkpoint-dir", ckpt, *seed]

        verbose = ["-v"] if args.verbose else []  # timestamped matchmaking lines in the logs
        creator = ["start", "--name", "wan", "--preset", args.preset, "--steps", str(args.steps)]
        first = [*verbose, *creator, *common, *addresses(0), *args.node_args]
        nodes.append(NodeProcess("node0", first, folder, namespaces[0]))
        address = nodes[0].address()
        for i in range(1, n):
            join = [*verbose, "join", "--initial-peers", address, *common, *addresses(i)]
            nodes.append(NodeProcess(f"node{i}", join, folder, namespaces[i]))
        deadline = start + args.timeout
        while any(node.alive() for node in nodes) and time.monotonic() < deadline:
            for i, (node, proxy) in enumerate(zip(nodes, proxies.proxies, strict=True)):
                direct = direct_connections(node.pid, listen[i], set(proxies.ports))
                bypass_max[i] = max(bypass_max[i], direct - proxy.open_connections)
            time.sleep(2.0)
        timed_out = any(node.alive() for node in nodes)
    finally:
        for node in nodes:
            if node.alive():
                node.process.send_signal(2)
        for node in nodes:
            try:
                node.process.wait(60)
            except subprocess.TimeoutExpired:
                node.kill_group()
        forwarded = [p.bytes_forwarded for p in proxies.proxies]
        connections = [p.connections for p in proxies.proxies]
        proxies.close()
    return {
        "rtt_ms": rtt_ms,
        "up_mbit": args.up_mbit,
        "down_mbit": args.down_mbit,
        "wall_seconds": time.monotonic() - start,
        "timed_out": timed_out,
        "proxy_connections": connections,
        "proxy_bytes_forwarded": forwarded,
        "bypass_max": bypass_max,
        "folder": str(folder),
        **figures([node.records() for node in nodes], args.warmup_steps),
    }


def figures(records: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """The steady state's start and every node's figures (see the module docstring)."""
    n = len(records)
    joined = [next((r["step"] for r in rs if r["event"] == "joined"), 0) for rs in records]
    full = [
        next((r["step"] for r in rs if r["event"] == "round" and r["members"] == n), None)
        for rs in records
    ]
    steady_from = max([*joined, *(s for s in full if s is not None)]) + warmup
    return {
        "joined_at_step": joined,
        "first_full_round_step": full,
        "steady_from_step": steady_from,
        "nodes": [node_figures(rs, steady_from) for rs in records],
    }


def node_figures(records: list[dict[str, Any]], steady_from: int) -> dict[str, Any]:
    """One node's steady-state figures from its metrics records."""
    steps = [r for r in records if r["event"] == "step" and r["step"] > steady_from]
    # The rounds the run's end waits for before their receive steps (``final``) are the
    # end's, not the steady state's: reported apart.
    kinds = ("round", "round_failed")
    late = [r for r in records if r["event"] in kinds and r["step"] > steady_from]
    final = [r for r in late if r.get("final")]
    rounds = [r for r in late if r["event"] == "round" and not r.get("final")]
    failed = [r for r in late if r["event"] == "round_failed" and not r.get("final")]
    compute = sum(r["step_seconds"] for r in steps)
    # A send held for a heal (``send_held``, between two steps) waits on the network too.
    held = sum(
        r["seconds"] for r in records if r["event"] == "send_held" and r["step"] >= steady_from
    )
    blocked = sum(r["blocked_seconds"] for r in rounds + failed) + held
    trips = [r["round_trips"] for r in rounds if "round_trips" in r]
    taus = [r["tau"] for r in steps if "tau" in r]
    # Where the training thread's wall time went: compute (the steps, sends included),
    # blocked on rounds, the rest of each step (outer steps, merges, announcing) and the
    # time between steps (records, eval, healing, checkpoints).
    wall = sum(r.get("wall_seconds", 0.0) for r in steps)
    between = sum(r.get("between_seconds", 0.0) for r in steps)
    per_kind: dict[str, list[float]] = collections.defaultdict(list)
    paths = collections.Counter[str]()
    for r in rounds:
        path = r.get("critical_path", [])
        paths[" ".join(kind for kind, _ in path)] += 1
        for kind, seconds in path:
            per_kind[kind].append(seconds)
    summary = next((r for r in records if r["event"] == "summary"), {})
    early = [r for r in records if r["event"] == "round_failed" and r["step"] <= steady_from]
    errors = collections.Counter(r["error"] for r in failed)
    return {
        "steady_steps": len(steps),
        "cu": compute / (compute + blocked) if compute + blocked else None,
        "cu_wall": compute / (wall + between) if wall + between else None,
        "final_blocked_seconds": sum(r["blocked_seconds"] for r in final),
        "thread_seconds": {
            "compute": compute,
            "blocked": blocked,
            "held_for_heal": held,
            "apply_and_announce": wall - compute - (blocked - held),
            "between_steps": between - held,
        },
        "step_seconds_median": statistics.median(r["step_seconds"] for r in steps)
        if steps
        else None,
        "round_seconds_median": statistics.median(r["seconds"] for r in rounds) if rounds else None,
        "matchmaking_seconds_median": (
            statistics.median(r["matchmaking_seconds"] for r in rounds) if rounds else None
        ),
        "rounds_ok": len(rounds),
        "rounds_failed": len(failed),
        "failure_reasons": dict(errors.most_common(5)),
        "startup_failed": len(early),
        "heals": sum(1 for r in records if r["event"] == "healed" and r["step"] > steady_from),
        "heals_whole_run": sum(1 for r in records if r["event"] == "healed"),
        "round_trips_median": statistics.median(trips) if trips else None,
        "round_trips_range": [min(trips), max(trips)] if trips else None,
        "critical_paths": dict(paths.most_common(6)),
        "exchange_seconds_median": {k: statistics.median(v) for k, v in sorted(per_kind.items())},
        "eval_loss": summary.get("eval_loss"),
        # the whole run's rows (sequences): a joiner that starts later trains fewer, and the
        # loss at a given step follows the tokens the swarm trained
        "rows_trained": sum(r["rows"] for r in records if r["event"] == "step"),
        "summary_cu": summary.get("cu"),
        "tau_range": summary.get("tau_range"),
        "tau_median": statistics.median_low(taus) if taus else None,
        "final_step": summary.get("step"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _taus(span: list[int] | None) -> str:
    """A node's tau range (``--tau auto``), or its one tau."""
    if not span:
        return "-"
    return str(span[0]) if span[0] == span[1] else f"{span[0]}-{span[1]}"


def table(points: list[dict[str, Any]]) -> str:
    head = (
        "| RTT ms | node | CU | round s (median) | failed/attempted | heals | "
        "round trips (median, range) | eval loss | tau |"
    )
    lines = [head, "|" + " --- |" * 9]
    for point in points:
        for i, node in enumerate(point["nodes"]):
            attempted = node["rounds_ok"] + node["rounds_failed"]
            span = node["round_trips_range"]
            trips = (
                f"{_fmt(node['round_trips_median'], 'g')} ({span[0]}-{span[1]})" if span else "-"
            )
            lines.append(
                f"| {point['rtt_ms']:g} | {i} | {_fmt(node['cu'], '.2f')} | "
                f"{_fmt(node['round_seconds_median'], '.2f')} | "
                f"{node['rounds_failed']}/{attempted} | {node['heals']} | {trips} | "
                f"{_fmt(node['eval_loss'], '.3f')} | {_taus(node.get('tau_range'))} |"
            )
    return "\n".join(lines)


def read_records(path: Path) -> list[dict[str, Any]]:
    """A finished node's metrics records."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def reread(out: Path, warmup: int) -> None:
    """Recompute the figures of a results file from the metrics its runs left in their
    folders (after a change to what is computed); the runs' own facts stay."""
    result = json.loads(out.read_text())
    for point in result["points"]:
        folder = Path(point["folder"])
        nodes = sorted(folder.glob("node*.jsonl"), key=lambda p: int(p.stem[4:]))
        point.update(figures([read_records(p) for p in nodes], warmup))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["points"]))


def predictions(
    points: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None
) -> list[str]:
    """Each point at an RTT above 0 against what the simulators predict for it: the CU
    predictor (``diloco.sim.round_costs``) from the same swarm's run at RTT 0 with the round
    trips added, at the tau each node used most in the point's steady state, and the
    protocol simulator's (``diloco.sim.protocol_sim``) matchmaking and
    all-reduce seconds for N peers RTT apart on fast links. Stored in the points too."""
    lines = [
        "| RTT ms | CU measured | CU predicted from RTT 0 | round s measured (median) | "
        "protocol sim: matchmaking + all-reduce s |",
        "|" + " --- |" * 5,
    ]
    base = next((p for p in [*points, *(baseline or [])] if p["rtt_ms"] == 0), None)
    for point in points:
        if point["rtt_ms"] == 0:
            continue
        rtt = point["rtt_ms"] / 1000
        one_way = point["rtt_ms"] / 4  # each peer's latency to the core: RTT / 2 between two
        links = LinkModel(up_mbps=1e4, down_mbps=1e4, sigma=0.0, latency_ms=(one_way, one_way))
        spec = SwarmSpec(num_peers=len(point["nodes"]), links=links, matchmaking_window_s=0.0)
        sim = summarise(spec, 5)
        point["protocol_sim_seconds"] = [sim.matchmaking_seconds, sim.median_seconds]
        if base is not None:
            predicted = []
            for i in range(len(point["nodes"])):
                metrics = (Path(base["folder"]) / f"node{i}.jsonl").read_text().splitlines()
                tau = point["nodes"][i].get("tau_median")
                predicted.append(predict_cu(metrics, rtt_seconds=rtt, tau=tau).steady)
            point["predicted_cu_from_rtt0"] = predicted
        measured = [node["cu"] for node in point["nodes"]]
        rounds = [node["round_seconds_median"] for node in point["nodes"]]
        lines.append(
            f"| {point['rtt_ms']:g} | {_span(measured, '.2f')} | "
            f"{_span(point.get('predicted_cu_from_rtt0', []), '.2f')} | {_span(rounds, '.2f')} | "
            f"{sim.matchmaking_seconds:.2f} + {sim.median_seconds:.2f} |"
        )
    return lines


def _span(values: list[float | None], spec: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return f"{min(known):{spec}}-{max(known):{spec}}"


def baseline(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The points of ``--baseline`` (a results file with a run at RTT 0), if given."""
    if args.baseline is None:
        return None
    points: list[dict[str, Any]] = json.loads(args.baseline.read_text())["points"]
    return points


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "diloco"], capture_output=True, text=True, cwd=HERE
    )
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, choices=range(2, 7), metavar="{2..6}")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 100.0, 200.0])
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="per direction, uniform")
    parser.add_argument(
        "--up-mbit",
        type=float,
        default=None,
        help="each node in a network namespace, its upload throttled to this (tc tbf; root)",
    )
    parser.add_argument(
        "--down-mbit", type=float, default=None, help="its download [default: --up-mbit]"
    )
    parser.add_argument("--tau", default="auto", help="every node's --tau: auto or steps")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument(
        "--start",
        choices=("together", "staggered"),
        default="together",
        help="together: every node waits for the others before its first step "
        "(--wait-for-peers), so runs at two RTTs compare at equal steps; staggered: each "
        "joiner starts at the step the others reached when it came in",
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--warmup-steps", type=int, default=0, help="after all met in a round")
    parser.add_argument(
        "--reread", action="store_true", help="recompute --out's figures from its kept metrics"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per RTT")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "wan.json")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and metrics here")
    parser.add_argument("--verbose", action="store_true", help="every node with -v (info logs)")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a results file whose RTT 0 run the predictions start from (its metrics kept)",
    )
    parser.add_argument(
        "node_args", nargs="*", help="more flags for the creator's start (after --)"
    )
    args = parser.parse_args()
    if args.reread:
        reread(args.out, args.warmup_steps)
        result = json.loads(args.out.read_text())
        print("\n".join(predictions(result["points"], baseline(args))))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    commit = git_commit()  # before the runs: the code they ran
    base = args.workdir or Path(tempfile.mkdtemp(prefix="diloco-wan-"))
    points = []
    for rtt in args.rtt_ms:
        for repeat in range(args.repeats):
            folder = base / f"rtt{rtt:g}-{repeat}"
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            point = run_point(args, rtt, folder)
            point["repeat"] = repeat
            points.append(point)
            print(table([point]), flush=True)
    result = {
        "commit": commit,
        "machine": f"{os.cpu_count()} cores (shared), loopback + delay proxies in one process",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "points": points,
    }
    compared = predictions(points, baseline(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(points))
    print("\n".join(compared))
    print(f"written to {args.out}; logs and metrics in {base}")


if __name__ == "__main__":
    main()
