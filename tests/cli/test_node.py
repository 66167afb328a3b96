"""``start`` and ``join`` through click's CliRunner, with the node itself replaced.

``_run_node`` (which starts the swarm) is swapped for a recorder, so these tests see
exactly the configuration each command line produces, and that bad ones stop before it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli import node as cli_node
from diloco.node.config import NodeOptions, RoundOptions, RunConfig
from diloco.node.flags import NETWORK_FLAGS, NODE_FLAGS, ROUND_FLAGS, RUN_FLAGS
from diloco.node.model.compute import ComputeOptions
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.trust.identity import Identity, load_identity
from diloco.protocol.trust.swarm_key import load_swarm_key
from diloco.protocol.wire.run_id import make_run_id

ADDR_A = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
ADDR_B = f"/ip4/127.0.0.2/tcp/1/p2p/{Identity.generate().peer_id}"

FLAGS_BEFORE_THE_SPLIT = {
    "--config", "--name", "--preset", "--seq-len", "--steps", "--H", "--fragment-size",
    "--pattern", "--embedding-fragment", "--codec", "--rounding", "--outer-lr",
    "--outer-momentum", "--alpha", "--inner-lr", "--warmup", "--seed", "--data", "--tau",
    "--batch-size", "--device", "--threads", "--checkpoint-dir", "--checkpoint-every",
    "--resume", "--export", "--data-seed", "--log-every", "--metrics-out", "--listen",
    "--announce", "--identity", "--use-relay", "--nat-port-map", "--min-group-size",
    "--matchmaking-window", "--round-timeout",
}  # fmt: skip


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What ``_run_node`` was called with, instead of a node."""
    calls: list[dict[str, Any]] = []

    def record(
        run: RunConfig,
        options: NodeOptions,
        rounds: RoundOptions,
        net: NetworkOptions,
        params: dict[str, Any],
        join: bool,
        joined: tuple[object, object] | None = None,
    ) -> None:
        signed, dht = joined or (None, None)
        calls.append(
            {"run": run, "options": options, "rounds": rounds, "net": net, "dht": dht}
            | {"signed": signed, "params": params}
        )

    monkeypatch.setattr(cli_node, "_run_node", record)
    return calls


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_start_without_config_equals_start_with_a_name_only_toml(
    started: list[dict[str, Any]], tmp_path: Path
) -> None:
    toml = tmp_path / "run.toml"
    for name, flags in (("diloco", []), ("demo", ["--name", "demo"])):
        toml.write_text(f'name = "{name}"\n')
        assert invoke("start", *flags) == (0, "")
        assert invoke("start", "--config", str(toml)) == (0, "")
    runs = [call["run"] for call in started]
    assert runs[0] == runs[1] == RunConfig()
    assert runs[2] == runs[3] == RunConfig(name="demo")
    ids = [make_run_id(run.name, run.to_dict()) for run in runs]
    assert ids[0] == ids[1] and ids[2] == ids[3]


def test_start_flags_reach_every_part(started: list[dict[str, Any]], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    code, output = invoke(
        "start", "--H", "10", "--outer-lr", "0.5", "--tau", "2", "--batch-size", "4",
        "--data", str(corpus), "--min-group-size", "1", "--listen", "/ip4/127.0.0.2/tcp/0",
        "--listen", "/ip4/127.0.0.3/tcp/0", "--nat-port-map",
    )  # fmt: skip
    assert code == 0, output
    (call,) = started
    assert call["run"].outer == OuterConfig(sync_every=10, outer_lr=0.5, fragment_sync_delay=2)
    assert (call["options"].batch_size, call["options"].tau) == (4, "2")
    assert call["options"].data == str(corpus)
    assert call["rounds"].min_group_size == 1
    assert call["net"].host_maddrs == ("/ip4/127.0.0.2/tcp/0", "/ip4/127.0.0.3/tcp/0")
    assert call["net"].nat_port_map and not call["net"].auto_nat and not call["net"].use_relay


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-5"], "steps must be >= 1"),
        (["--steps", "abc"], "'abc' is not a valid integer"),
        (["--seq-len", "0"], "seq_len must be >= 2"),
        (["--log-every", "0"], "log_every must be >= 1"),
        (["--threads", "-1"], "threads must be >= 0"),
        (["--data", "/missing/corpus"], "'/missing/corpus' does not exist"),
        (["--codec", "zip"], "unknown codec 'zip'"),
        (["--listen", "localhost"], "multiaddrs like"),
        (["--round-timeout", "0"], "round_timeout must be > 0"),
        (["--slow-down", "0.5"], "slow_down must be a factor >= 1"),
        (["--pace", "lockstep"], "--pace"),
    ],
)
@pytest.mark.parametrize("command", ["start", "join"])
def test_bad_values_exit_2_before_anything_starts(
    started: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    args: list[str],
    message: str,
) -> None:
    import diloco.node.swarm.pinned_run

    def no_swarm(*args: object) -> None:
        raise AssertionError("the swarm was asked")

    monkeypatch.setattr(diloco.node.swarm.pinned_run, "discover_run", no_swarm)
    peers = ["--initial-peers", ADDR_A] if command == "join" else []
    code, output = invoke(command, *peers, *args)
    assert code == 2, output
    assert message in output
    assert started == []


def test_start_tau_auto_leaves_the_runs_tau(started: list[dict[str, Any]]) -> None:
    code, output = invoke("start", "--H", "10", "--tau", "auto")
    assert code == 0, output
    (call,) = started
    assert call["options"].tau == "auto" and call["run"].outer.fragment_sync_delay == 1


def test_start_tau_is_auto_or_a_number(started: list[dict[str, Any]]) -> None:
    code, output = invoke("start", "--tau", "soon")
    assert code == 2 and "tau must be auto or a number of steps >= 0, got 'soon'" in output


def test_start_tau_must_be_below_h(started: list[dict[str, Any]]) -> None:
    code, output = invoke("start", "--H", "4", "--tau", "4")
    assert code == 2 and "tau must satisfy 0 <= tau < H=4" in output
    assert started == []


def test_a_toml_of_the_wrong_type_exits_2(started: list[dict[str, Any]], tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('steps = "abc"\n')
    code, output = invoke("start", "--config", str(toml))
    assert code == 2 and "steps: expected an integer, got 'abc'" in output
    assert started == []


def test_every_option_default_is_the_dataclass_default() -> None:
    tables = (RUN_FLAGS, NODE_FLAGS, ROUND_FLAGS, NETWORK_FLAGS)
    for command in (main.commands["start"], main.commands["join"]):
        params = {p.name: p for p in command.params if isinstance(p, click.Option)}
        assert FLAGS_BEFORE_THE_SPLIT <= {o for p in params.values() for o in p.opts}
        for table in tables:
            for flag in table.flags:
                assert params[flag.dest].default == table.default(flag), flag.name
    start = {p.name: p.default for p in main.commands["start"].params}
    # The values `start` has always had (they were also the demo's and `local`'s).
    assert (start["outer_lr"], start["outer_momentum"], start["inner_lr"]) == (0.7, 0.9, 1e-3)
    assert (start["warmup"], start["seq_len"], start["steps"], start["h"]) == (30, 128, 600, 30)
    assert (start["fragment_size"], start["batch_size"], start["log_every"]) == (1, 8, 25)
    assert start["listen"] == ("/ip4/127.0.0.1/tcp/0",) and start["nat_port_map"] is False


class FakeDHT:
    def __init__(self) -> None:
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


SIGNED = object()
"""Stands for the run's signed configuration, which ``join`` hands to the node unchanged."""


@pytest.fixture
def swarm_run(monkeypatch: pytest.MonkeyPatch) -> tuple[RunConfig, FakeDHT]:
    """A swarm whose run trains 300 steps with H 10, found without a network."""
    import diloco.node.swarm.pinned_run

    run, dht = RunConfig(name="t", steps=300, outer=OuterConfig(sync_every=10)), FakeDHT()

    def discover(net: NetworkOptions, run_id: str | None) -> tuple[RunConfig, object, FakeDHT]:
        assert net.initial_peers == (ADDR_A, ADDR_B)
        assert run_id in (None, "t-0123456789abcdef")
        return run, SIGNED, dht

    monkeypatch.setattr(diloco.node.swarm.pinned_run, "discover_run", discover)
    return run, dht


PEERS = ["--initial-peers", f"{ADDR_A} {ADDR_B}"]


def test_join_trains_the_swarms_run_with_its_own_local_choices(
    started: list[dict[str, Any]], swarm_run: tuple[RunConfig, FakeDHT], tmp_path: Path
) -> None:
    corpus = tmp_path / "mine.txt"
    corpus.write_text("my own data")
    assert invoke("join", *PEERS, "--batch-size", "3")[0] == 0
    assert invoke("join", *PEERS, "--data", str(corpus), "--steps", "300")[0] == 0
    first, second = started
    assert first["run"] == second["run"] == swarm_run[0]
    assert first["dht"] is second["dht"] is swarm_run[1]
    assert first["signed"] is second["signed"] is SIGNED
    assert (first["options"].data, first["options"].batch_size) == (None, 3)
    assert second["options"].data == str(corpus)


def test_join_refuses_flags_that_contradict_the_swarm(
    started: list[dict[str, Any]], swarm_run: tuple[RunConfig, FakeDHT]
) -> None:
    code, output = invoke("join", *PEERS, "--H", "7", "--steps", "999")
    assert code == 1
    assert "differs from the swarm" in output
    assert "--H: the run's 10, yours 7" in output and "--steps: the run's 300, yours 999" in output
    assert started == [] and swarm_run[1].stopped


def test_join_tau_must_be_below_the_swarms_h(
    started: list[dict[str, Any]], swarm_run: tuple[RunConfig, FakeDHT]
) -> None:
    code, output = invoke("join", *PEERS, "--tau", "10")
    assert code == 2 and "tau must satisfy 0 <= tau < H=10" in output
    assert started == [] and swarm_run[1].stopped


def test_start_with_a_swarm_key_makes_a_closed_run_of_its_own(
    started: list[dict[str, Any]], tmp_path: Path
) -> None:
    key = tmp_path / "swarm.key"
    code, output = invoke("keygen", "--swarm-key", str(key))
    assert code == 0 and f"wrote a swarm key to {key}" in output
    assert invoke("keygen", "--swarm-key", str(key))[0] == 2  # never overwrites a key
    assert invoke("start", "--swarm-key", str(key)) == (0, "")
    assert invoke("start") == (0, "")
    closed, open_ = (call["run"] for call in started)
    assert closed.swarm_key_id == load_swarm_key(key).key_id and open_.swarm_key_id is None
    assert started[0]["net"].swarm_key_path == str(key)
    assert make_run_id("diloco", closed.to_dict()) != make_run_id("diloco", open_.to_dict())
    assert key.read_bytes().hex() not in repr(closed.to_dict())


def test_start_admits_the_peers_of_a_file_and_keygen_prints_a_peer_id(
    started: list[dict[str, Any]], tmp_path: Path
) -> None:
    ids = []
    for name in ("b.key", "a.key"):
        code, output = invoke("keygen", "--identity", str(tmp_path / name))
        assert code == 0
        ids.append(output.strip())
        assert load_identity(tmp_path / name).peer_id == ids[-1]  # printed again, unchanged
        assert invoke("keygen", "--identity", str(tmp_path / name)) == (0, output)
    admit = tmp_path / "admit"
    admit.write_text(f"# members\n{ids[0]}\n\n{ids[1]}  # alice\n")
    assert invoke("start", "--admit", str(admit)) == (0, "")
    assert started[0]["run"].admitted == tuple(sorted(ids))
    admit.write_text("someone\n")
    code, output = invoke("start", "--admit", str(admit))
    assert code == 2 and "line 1: 'someone' is not a peer id" in output
    assert invoke("keygen")[0] == 2 and len(started) == 1


def test_start_with_a_short_key_file_exits_2(started: list[dict[str, Any]], tmp_path: Path) -> None:
    key = tmp_path / "short.key"
    key.write_bytes(b"x" * 16)
    code, output = invoke("start", "--swarm-key", str(key))
    assert code == 2 and "not 16" in output
    assert started == []


def test_join_keeps_its_identity_in_its_checkpoint_dir(
    started: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A joiner that resumes comes back as the peer it was: its peers count the vouches of
    the peers they saw work, by peer id (a restarted joiner with a new one left the run's
    creator one counting partner, and it never healed after a freeze: the chaos run)."""
    import diloco.node.swarm.pinned_run

    asked: list[NetworkOptions] = []

    def discover(net: NetworkOptions, run_id: str | None) -> tuple[RunConfig, object, FakeDHT]:
        asked.append(net)
        return RunConfig(name="t"), SIGNED, FakeDHT()

    monkeypatch.setattr(diloco.node.swarm.pinned_run, "discover_run", discover)
    ckpt, own = tmp_path / "ckpt", tmp_path / "own.key"
    assert invoke("join", *PEERS, "--checkpoint-dir", str(ckpt))[0] == 0
    assert invoke("join", *PEERS)[0] == 0
    assert invoke("join", *PEERS, "--checkpoint-dir", str(ckpt), "--identity", str(own))[0] == 0
    kept, fresh, chosen = (net.identity_path for net in asked)
    assert (kept, fresh, chosen) == (str(ckpt / "identity.key"), None, str(own))
    assert [call["net"] for call in started] == asked


def test_join_pins_the_run_id_it_is_given(
    started: list[dict[str, Any]], swarm_run: tuple[RunConfig, FakeDHT]
) -> None:
    assert invoke("join", *PEERS, "--run-id", "t-0123456789abcdef")[0] == 0
    code, output = invoke("join", *PEERS, "--run-id", "t")
    assert code == 2 and "is not of the form NAME-<16 hex digits>" in output
    assert len(started) == 1


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """A folder prepared with a small BPE tokenizer: path, vocabulary, fingerprint."""
    from bpe_corpus import write_bpe_corpus

    from diloco.node.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("bpe")
    write_bpe_corpus(root)
    config = PrepareConfig(
        inputs=[str(root / "docs.jsonl")],
        output=str(root / "tokens"),
        tokenizer=str(root / "tokenizer.json"),
        processes=1,
    )
    manifest = prepare(config)
    return root / "tokens", manifest.tokenizer.vocab_size, manifest.fingerprint


def test_start_takes_the_vocabulary_of_a_prepared_corpus(
    started: list[dict[str, Any]], prepared: tuple[Path, int, str]
) -> None:
    folder, vocab, fingerprint = prepared
    assert invoke("start", "--data", str(folder))[0] == 0
    assert invoke("start", "--data", str(folder), "--dataset-fingerprint", fingerprint)[0] == 0
    assert invoke("start", "--data", str(folder), "--preset", "35M")[0] == 0
    first, pinned, large = (call["run"] for call in started)
    assert first.vocab_size == vocab > 256 and first.model_config().vocab_size == vocab
    assert pinned.dataset_fingerprint == fingerprint
    assert large.vocab_size is None and large.model_config().vocab_size == 32000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vocab-size", "300"], "has a vocabulary of {vocab} tokens but the model only 300"),
        (["--dataset-fingerprint", "a" * 64], "the run trains on the prepared corpus aaaa"),
    ],
)
def test_start_refuses_data_the_run_cannot_train_on(
    started: list[dict[str, Any]], prepared: tuple[Path, int, str], args: list[str], message: str
) -> None:
    folder, vocab, _ = prepared
    code, output = invoke("start", "--data", str(folder), *args)
    assert code == 2 and message.format(vocab=vocab) in output
    assert started == []


def test_join_refuses_data_beyond_the_swarms_vocabulary(
    started: list[dict[str, Any]],
    swarm_run: tuple[RunConfig, FakeDHT],
    prepared: tuple[Path, int, str],
) -> None:
    folder, vocab, _ = prepared
    code, output = invoke("join", *PEERS, "--data", str(folder))
    assert code == 2 and f"the run needs --vocab-size {vocab}" in output
    assert started == [] and swarm_run[1].stopped


def test_compute_flags_reach_the_node_options(started: list[dict[str, Any]]) -> None:
    code, output = invoke(
        "start", "--precision", "bf16", "--micro-batch-size", "2", "--compile", "--no-tf32",
        "--outer-device", "device",
    )  # fmt: skip
    assert code == 0, output
    options = started[0]["options"]
    assert options.compute == ComputeOptions(
        precision="bf16", micro_batch_size=2, compile=True, tf32=False
    )
    assert options.outer_device == "device"
    code, output = invoke("start", "--batch-size", "4", "--micro-batch-size", "5")
    assert code == 2 and "micro_batch_size 5 exceeds batch_size 4" in output


def test_pace_and_hidden_slow_down_reach_the_node_options(started: list[dict[str, Any]]) -> None:
    code, output = invoke("start", "--pace", "fixed", "--slow-down", "3")
    assert code == 0, output
    options = started[0]["options"]
    assert (options.pace, options.slow_down) == ("fixed", 3.0)
    assert NodeOptions().pace == "adaptive"
    code, output = invoke("start", "--help")
    assert "--pace" in output and "--slow-down" not in output


def test_start_names_the_tokenizer_of_its_data(
    started: list[dict[str, Any]], prepared: tuple[Path, int, str], tmp_path: Path
) -> None:
    folder, _, _ = prepared
    text = tmp_path / "notes.txt"
    text.write_text("plain text, read as bytes")
    for data in ([], ["--data", str(folder)], ["--data", str(text)]):
        assert invoke("start", *data)[0] == 0
    sha = hashlib.sha256((folder.parent / "tokenizer.json").read_bytes()).hexdigest()
    assert [call["run"].tokenizer for call in started] == ["bytes", sha, "bytes"]
    assert started[0]["run"] == RunConfig()  # a bytes run is named as before


@pytest.fixture
def bpe_swarm_run(monkeypatch: pytest.MonkeyPatch, prepared: tuple[Path, int, str]) -> FakeDHT:
    """A swarm whose run trains on the tokens of ``prepared``'s tokenizer."""
    import diloco.node.swarm.pinned_run

    folder, vocab, _ = prepared
    sha = hashlib.sha256((folder.parent / "tokenizer.json").read_bytes()).hexdigest()
    run, dht = RunConfig(name="t", vocab_size=vocab, tokenizer=sha), FakeDHT()
    monkeypatch.setattr(diloco.node.swarm.pinned_run, "discover_run", lambda *_: (run, SIGNED, dht))
    return dht


def test_a_joiner_of_a_bpe_run_needs_data_of_the_runs_tokenizer(
    started: list[dict[str, Any]],
    bpe_swarm_run: FakeDHT,
    prepared: tuple[Path, int, str],
    tmp_path: Path,
) -> None:
    from diloco.node.data.prepare import PrepareConfig, prepare

    folder, _, _ = prepared
    raw = folder.parent  # docs.jsonl and the tokenizer.json, as a user has them
    as_bytes = tmp_path / "bytes"
    prepare(PrepareConfig(inputs=[str(raw / "docs.jsonl")], output=str(as_bytes), processes=1))
    refused = {
        "no --data": ([], "the embedded corpus holds raw bytes"),
        "raw records": (["--data", str(raw)], "holds files of records (docs.jsonl)"),
        "another tokenizer": (["--data", str(as_bytes)], f"--data {as_bytes} holds raw bytes"),
        "a tokenizer": (["--data", str(raw / "tokenizer.json")], "is a tokenizer, not data"),
    }
    for why, (data, message) in refused.items():
        code, output = invoke("join", *PEERS, *data)
        assert code == 2 and message in output, why
        (error,) = [line for line in output.splitlines() if line.startswith("Error:")]
        assert message in error and "prepare-data" in error, why
    assert started == [] and bpe_swarm_run.stopped
    friend = tmp_path / "friend"  # another corpus, the run's tokenizer: welcome
    (tmp_path / "mine.jsonl").write_text('{"text": "my own words, my own documents"}\n' * 50)
    inputs = [str(tmp_path / "mine.jsonl")]
    prepare(
        PrepareConfig(
            inputs=inputs, output=str(friend), tokenizer=str(raw / "tokenizer.json"), processes=1
        )
    )
    assert invoke("join", *PEERS, "--data", str(friend))[0] == 0
    assert started[0]["options"].data == str(friend)
