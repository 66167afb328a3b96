"""One set of defaults, strict loading, and what a joiner may take from the swarm."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from diloco.errors import ConfigError
from diloco.node.config import (
    NodeOptions,
    RoundOptions,
    RunConfig,
    config_mismatch,
    from_mapping,
)
from diloco.node.flags import join_mismatch, run_config
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.run_id import make_run_id


def test_defaults_are_what_start_has_always_used() -> None:
    run, node, rounds = RunConfig(), NodeOptions(), RoundOptions()
    assert (run.name, run.preset, run.seq_len, run.steps) == ("diloco", "tiny", 128, 600)
    assert (run.fragment_size, run.pattern, run.embedding_fragment) == (1, "strided", "own")
    assert (run.codec, run.rounding, run.seed, run.dataset) == ("e3m0", "nearest", 0, None)
    assert run.return_codec is None  # the mean goes back in --codec's encoding
    assert run.outer == OuterConfig(
        sync_every=30,
        outer_lr=0.7,
        outer_momentum=0.9,
        fragment_sync_delay=1,
        fragment_update_alpha=None,
    )
    assert (run.inner.lr, run.inner.warmup_steps, run.inner.grad_clip) == (1e-3, 30, 1.0)
    assert (node.batch_size, node.tau, node.device, node.threads) == (8, "auto", "cpu", 0)
    assert (node.data, node.data_seed, node.log_every, node.checkpoint_every) == (
        None,
        None,
        25,
        0,
    )
    assert (rounds.min_group_size, rounds.matchmaking_window, rounds.round_timeout) == (
        2,
        2.0,
        10.0,
    )


def test_name_only_toml_gives_the_run_of_no_config(tmp_path: Path) -> None:
    for name in ("diloco", "demo"):
        toml = tmp_path / f"{name}.toml"
        toml.write_text(f'name = "{name}"\n')
        from_file = run_config(toml, {})
        from_flags = run_config(None, {"name": name})
        assert from_file == from_flags
        assert make_run_id(name, from_file.to_dict()) == make_run_id(name, from_flags.to_dict())
    assert run_config(None, {}) == RunConfig()


def test_typed_flags_override_the_toml_and_tau_sets_the_runs(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('name = "x"\nsteps = 100\n[outer]\nsync_every = 10\nouter_lr = 0.5\n')
    run = run_config(toml, {"steps": 50, "inner_lr": 2e-3}, tau=3)
    assert (run.name, run.steps, run.inner.lr) == ("x", 50, 2e-3)
    assert (run.outer.sync_every, run.outer.outer_lr, run.outer.fragment_sync_delay) == (
        10,
        0.5,
        3,
    )
    assert run.inner.warmup_steps == 30  # left out of the file: the default


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"steps": "abc"}, "steps: expected an integer, got 'abc'"),
        ({"steps": True}, "steps: expected an integer"),
        ({"steps": 2.0}, "steps: expected an integer"),
        ({"steps": -5}, "steps must be >= 1"),
        ({"seq_len": 0}, "seq_len must be >= 2"),
        ({"outer": {"outer_lr": "x"}}, "outer.outer_lr: expected a number"),
        ({"outer": {"outer_lr": float("nan")}}, "expected a finite number"),
        ({"outer": {"fragment_update_alpha": 2.0}}, "alpha must be in"),
        ({"outer": {"sync_every": 4, "fragment_sync_delay": 4}}, "tau must satisfy"),
        ({"outer": 3}, "outer: expected a table"),
        ({"inner": {"betas": [0.9]}}, "inner.betas: expected 2 values"),
        ({"inner": {"optimizer": "lion"}}, "inner.optimizer: expected one of"),
        ({"pattern": "zigzag"}, "pattern: expected one of"),
        ({"codec": "zip"}, "unknown codec 'zip'"),
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"name": "a b"}, "run name 'a b'"),
        ({"evil": 1}, "unknown keys ['evil']"),
        ({"outer": {"evil": 1}}, "unknown keys ['outer.evil']"),
        ({"max_round_tokens": 0}, "max_round_tokens must be >= 1 tokens"),
        ({"clip_factor": 0.5}, "clip_factor must be 0 (off) or >= 1"),
        ({"clip_factor": -1}, "clip_factor must be 0 (off) or >= 1"),
        ({"creator": "abc"}, "creator: peer id abc is not an Ed25519 peer id"),
        ({"creator": 5}, "creator: expected a string"),
        ({"swarm_key_id": "0123456789ABCDEF"}, "is not 16 hex digits"),
        ({"swarm_key_id": "0123"}, "is not 16 hex digits"),
        ({"return_codec": "topk"}, "return_codec: expected one of ['e3m0', 'int8', 'bf16'"),
    ],
)
def test_bad_run_values_are_config_errors(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        from_mapping(RunConfig, data)
    assert message in str(error.value)


def test_weight_cap_defaults_to_32_sequences_per_step_of_a_round() -> None:
    run = from_mapping(RunConfig, {"seq_len": 64, "outer": {"sync_every": 10}})
    assert run.round_token_cap() == 32 * 64 * 10
    assert from_mapping(RunConfig, {"max_round_tokens": 5000}).round_token_cap() == 5000


def test_floats_take_integers_and_lists_become_tuples() -> None:
    run = from_mapping(RunConfig, {"outer": {"outer_lr": 1}, "inner": {"betas": [0.8, 0.9]}})
    assert run.outer.outer_lr == 1.0 and isinstance(run.outer.outer_lr, float)
    assert run.inner.betas == (0.8, 0.9)


def test_a_peers_configuration_must_be_complete() -> None:
    data = RunConfig(steps=99).to_dict()
    assert RunConfig.from_dict(data) == RunConfig(steps=99)
    del data["inner"]["lr"]
    with pytest.raises(ConfigError, match=r"missing keys \['inner.lr'\]"):
        RunConfig.from_dict(data)


LOCAL_CHOICES = sorted(
    {f.name for f in dataclasses.fields(NodeOptions)}
    | {f.name for f in dataclasses.fields(NetworkOptions)}
    | {"metrics_out", "export_path", "config_file", "resume", "wandb_project", "tensorboard_dir"}
)


@pytest.mark.parametrize("key", LOCAL_CHOICES)
def test_a_local_choice_is_never_read_from_a_swarms_run(key: str) -> None:
    """A run configuration from a peer naming a path (or any local choice) is refused."""
    assert key not in {f.name for f in dataclasses.fields(RunConfig)}
    published = RunConfig().to_dict() | {key: "/home/victim/.ssh"}
    with pytest.raises(ConfigError, match=rf"unknown keys \['{key}'\]"):
        RunConfig.from_dict(published)


def test_creator_and_swarm_key_id_are_part_of_the_run() -> None:
    creator = Identity.generate().peer_id
    run = RunConfig(creator=creator, swarm_key_id="0123456789abcdef")
    assert RunConfig.from_dict(run.to_dict()) == run
    assert make_run_id(run.name, run.to_dict()) != make_run_id(run.name, RunConfig().to_dict())


def test_admitted_peers_are_part_of_the_run_and_always_hold_the_creator() -> None:
    creator, a, b = (Identity.generate().peer_id for _ in range(3))
    admitted = tuple(sorted((a, b)))
    run = RunConfig(creator=creator, admitted=admitted)
    assert RunConfig.from_dict(run.to_dict()) == run
    assert make_run_id(run.name, run.to_dict()) != make_run_id(
        run.name, RunConfig(creator=creator).to_dict()
    )
    assert run.admitted_peers() == {creator, a, b}
    assert RunConfig(creator=creator).admitted_peers() is None
    with pytest.raises(ConfigError, match="sorted and each once"):
        RunConfig(admitted=admitted[::-1])
    with pytest.raises(ConfigError, match="'x' is not a peer id"):
        RunConfig.from_dict(run.to_dict() | {"admitted": ["x"]})


def test_return_codec_is_part_of_the_run_and_a_joiner_cannot_change_it() -> None:
    run = RunConfig(return_codec="int8")
    assert RunConfig.from_dict(run.to_dict()) == run
    assert make_run_id(run.name, run.to_dict()) != make_run_id(run.name, RunConfig().to_dict())
    assert join_mismatch(RunConfig(), None, {"return_codec": "bf16"}) == [
        "--return-codec: the run's None, yours 'bf16'"
    ]


def test_return_codec_for_builds_the_named_codec_or_keeps_the_outer_one() -> None:
    from diloco.codecs import get_codec
    from diloco.node.config import return_codec_for

    codec = get_codec("e3m0", rounding="stochastic")
    assert return_codec_for(None, codec, "stochastic") is codec
    assert return_codec_for("bf16", codec, "stochastic").name == "bf16"
    back = return_codec_for("e3m0", get_codec("int8"), "stochastic")
    assert back.name == "e3m0" and back.rounding == "stochastic"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"tau": "-1"}, "tau must be auto or a number of steps >= 0, got '-1'"),
        ({"tau": "soon"}, "tau must be auto or a number of steps >= 0, got 'soon'"),
        ({"threads": -1}, "threads must be >= 0"),
        ({"log_every": 0}, "log_every must be >= 1"),
        ({"checkpoint_every": -1}, "checkpoint_every must be >= 0"),
        ({"data_seed": -1}, "data_seed must be >= 0"),
        ({"device": "nope"}, "unknown device 'nope'"),
        ({"data": "/missing/corpus.txt"}, "data path /missing/corpus.txt does not exist"),
    ],
)
def test_bad_node_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(NodeOptions, options)


def test_checkpoint_dir_must_not_be_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        NodeOptions(checkpoint_dir=str(path))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_group_size": 0}, "min_group_size must be >= 1"),
        ({"matchmaking_window": 0.0}, "matchmaking_window must be > 0"),
        ({"round_timeout": -1.0}, "round_timeout must be > 0"),
        ({"exit_timeout": -1.0}, "exit_timeout must be >= 0"),
        ({"wait_for_peers": -1}, "wait_for_peers must be >= 0 nodes"),
    ],
)
def test_bad_round_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(RoundOptions, options)


def test_inner_config_rejects_out_of_range_values() -> None:
    with pytest.raises(ConfigError, match="betas"):
        InnerConfig(betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        InnerConfig(min_lr_ratio=1.5)


def test_joiner_flags_that_contradict_the_swarm_are_listed(tmp_path: Path) -> None:
    creator = Identity.generate().peer_id
    swarm = RunConfig(
        name="t",
        steps=600,
        outer=OuterConfig(fragment_sync_delay=2),
        creator=creator,
        swarm_key_id="0123456789abcdef",
    )
    assert join_mismatch(swarm, None, {}) == []
    assert join_mismatch(swarm, None, {"steps": 600}) == []
    assert join_mismatch(swarm, None, {"h": 7, "steps": 999}) == [
        "--H: the run's 30, yours 7",
        "--steps: the run's 600, yours 999",
    ]
    toml = tmp_path / "run.toml"
    toml.write_text('name = "t"\n[outer]\nfragment_sync_delay = 5\n')
    assert join_mismatch(swarm, toml, {}) == []  # tau is each node's own
    toml.write_text('name = "u"\n')
    assert join_mismatch(swarm, toml, {}) == ["--name (name): the run's 't', yours 'u'"]
    toml.write_text(f'name = "t"\ncreator = "{Identity.generate().peer_id}"\n')
    assert [d.split(":")[0] for d in join_mismatch(swarm, toml, {})] == ["creator"]  # no flag


def test_config_mismatch_reads_nested_tables() -> None:
    a = RunConfig(inner=InnerConfig(lr=2e-3))
    assert config_mismatch(a, RunConfig()) == ["inner.lr: yours 0.002, swarm's 0.001"]
    assert config_mismatch(a, a) == []


def test_a_toml_table_that_is_not_a_table_is_a_config_error(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("outer = 3\n")
    with pytest.raises(ConfigError, match="outer: expected a table"):
        run_config(toml, {}, tau=2)
    with pytest.raises(ConfigError, match="outer: expected a table"):
        run_config(toml, {})
