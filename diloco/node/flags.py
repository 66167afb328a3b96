"""Command-line flags of the node's configuration, and how typed flags override a run.

A ``Flag`` names the command-line option of one dataclass field; ``Flags`` groups those of
one dataclass. The CLI derives each option's type, choices and default from the field
(``diloco.cli.options``), so a default is written once, in ``diloco.node.config``. Only
flags typed on the command line override a run's TOML file (``run_config``), and a joiner's
typed flags are compared with the swarm's run, never applied to it (``join_mismatch``).
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from diloco.codecs import CODEC_NAMES
from diloco.node.config import (
    NodeOptions,
    RoundOptions,
    RunConfig,
    from_mapping,
    read_toml,
    set_path,
)
from diloco.node.model.transformer import PRESETS
from diloco.protocol.runtime.network import NetworkOptions

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Flag:
    """A command-line flag that sets one field; type, choices and default come from it."""

    name: str
    """e.g. ``--outer-lr``."""
    path: tuple[str, ...]
    """The field, from the owner of the table, e.g. ``("outer", "outer_lr")``."""
    help: str
    kind: Literal["file", "dir", "existing"] | None = None
    """A path: not a folder, not a file, or one that must exist."""
    hidden: bool = False
    """Left out of ``--help`` (flags for tests and benchmarks)."""

    @property
    def dest(self) -> str:
        """The option's parameter name (``--outer-lr`` -> ``outer_lr``)."""
        return self.name.lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True, slots=True)
class Flags(Generic[T]):
    """The flags of one dataclass ``owner``; its default instance holds their defaults."""

    owner: type[T]
    flags: tuple[Flag, ...]

    def default(self, flag: Flag) -> object:
        value: object = self.owner()
        for key in flag.path:
            value = getattr(value, key)
        return value

    def hint(self, flag: Flag) -> Any:
        """The field's type, e.g. ``float`` or ``Literal['a', 'b']`` or ``str | None``."""
        owner: Any = self.owner
        for key in flag.path:
            hint = typing.get_type_hints(owner)[key]
            owner = hint
        return hint

    def named(self, *names: str) -> tuple[Flag, ...]:
        """These flags, in this order: for a dataclass that shares their fields under the
        same names (``local``'s configuration shares the run's and the node's), so that a
        flag is written once.

        Raises:
            KeyError: a name that is not among these flags.
        """
        by_name = {flag.name: flag for flag in self.flags}
        return tuple(by_name[name] for name in names)

    def build(self, values: Mapping[str, object], base: Mapping[str, Any] | None = None) -> T:
        """``owner`` from ``base`` (plain data) with every flag's value in ``values``."""
        data = copy.deepcopy(dict(base)) if base else {}
        for flag in self.flags:
            if flag.dest in values:
                set_path(data, flag.path, values[flag.dest])
        return from_mapping(self.owner, data)


RUN_FLAGS = Flags(
    RunConfig,
    (
        Flag("--name", ("name",), "Human name of the run."),
        Flag("--preset", ("preset",), f"Model preset: {', '.join(PRESETS)}."),
        Flag("--seq-len", ("seq_len",), "Tokens per sequence."),
        Flag("--steps", ("steps",), "T: inner steps of the whole run."),
        Flag("--H", ("outer", "sync_every"), "H: inner steps between two syncs of a fragment."),
        Flag("--fragment-size", ("fragment_size",), "Transformer blocks per fragment."),
        Flag("--pattern", ("pattern",), "Which blocks form a fragment."),
        Flag(
            "--embedding-fragment",
            ("embedding_fragment",),
            "Embedding, final norm and head: a fragment of their own, or in fragment 0.",
        ),
        Flag("--codec", ("codec",), f"Outer-gradient codec: {', '.join(CODEC_NAMES)}."),
        Flag("--rounding", ("rounding",), "E3M0 rounding."),
        Flag(
            "--return-codec",
            ("return_codec",),
            "Codec of the averaged outer gradient the reducers send back [default: --codec's].",
        ),
        Flag("--outer-lr", ("outer", "outer_lr"), "Outer Nesterov learning rate."),
        Flag("--outer-momentum", ("outer", "outer_momentum"), "mu: outer Nesterov momentum."),
        Flag(
            "--alpha",
            ("outer", "fragment_update_alpha"),
            "Merge factor alpha: share of local weights kept [default: 0.5 if tau > 0 else 0].",
        ),
        Flag("--inner-lr", ("inner", "lr"), "Peak AdamW learning rate."),
        Flag("--warmup", ("inner", "warmup_steps"), "Learning-rate warm-up, in inner steps."),
        Flag("--seed", ("seed",), "Seed of the initial weights."),
        Flag("--dataset", ("dataset",), "Name of the corpus, for people (never a path)."),
        Flag(
            "--max-round-tokens",
            ("max_round_tokens",),
            "Cap on a member's weight in one round, in tokens, e.g. 491520 [default: 32 "
            "sequences x seq-len x H].",
        ),
        Flag(
            "--clip-factor",
            ("clip_factor",),
            "C: per chunk, clip contributions to C x the lower median norm (0: plain mean).",
        ),
        Flag(
            "--max-group-size",
            ("max_group_size",),
            "Most members of one all-reduce group; larger rounds run in stages on a grid "
            "[default: one flat group].",
        ),
        Flag(
            "--vocab-size",
            ("vocab_size",),
            "Model vocabulary in tokens, e.g. 32000 [default: the preset's, or the tokenizer's "
            "of a prepared --data when larger].",
        ),
        Flag(
            "--dataset-fingerprint",
            ("dataset_fingerprint",),
            "Train only on a prepared corpus with this manifest fingerprint (prepare-data "
            "prints it).",
        ),
    ),
)
COMPUTE_FLAGS = (
    Flag(
        "--precision",
        ("compute", "precision"),
        "Inner-step precision: bf16 autocast (FP32 weights, optimizer and outer state) or fp32.",
    ),
    Flag(
        "--micro-batch-size",
        ("compute", "micro_batch_size"),
        "Sequences per forward/backward pass; a step accumulates gradients over "
        "batch-size / micro-batch-size of them, e.g. 4 (0: the whole batch at once).",
    ),
    Flag("--compile", ("compute", "compile"), "Compile the model with torch.compile."),
    Flag("--tf32", ("compute", "tf32"), "Let FP32 matmuls use TF32 tensor cores (CUDA)."),
)
NODE_FLAGS = Flags(
    NodeOptions,
    (
        Flag(
            "--tau",
            ("tau",),
            "This node's overlap tau: auto (from its round latency and step time, "
            "starting at the run's tau) or a number of steps [default: auto].",
        ),
        Flag("--batch-size", ("batch_size",), "Sequences per inner step."),
        Flag(
            "--pace",
            ("pace",),
            "adaptive: when slower per step than the swarm's pace (the upper median of the "
            "counted full-batch step times), train fewer sequences per step so the others do "
            "not wait; fixed: always the full --batch-size.",
        ),
        Flag(
            "--slow-down",
            ("slow_down",),
            "Every inner step takes this many times its compute, e.g. 3 (tests: a slow node).",
            hidden=True,
        ),
        Flag("--device", ("device",), "torch device, e.g. cuda:0."),
        Flag(
            "--threads",
            ("threads",),
            "torch CPU threads (0: torch's default; use 1 per node when several nodes share "
            "a machine).",
        ),
        Flag(
            "--data",
            ("data",),
            "This node's corpus: a folder from prepare-data, a text file or folder, or nanoGPT "
            ".bin tokens [default: the embedded Python sources].",
            kind="existing",
        ),
        Flag("--data-seed", ("data_seed",), "Seed of this node's data stream [default: random]."),
        Flag(
            "--checkpoint-dir",
            ("checkpoint_dir",),
            "Save checkpoints here (every N steps and on Ctrl-C).",
            kind="dir",
        ),
        Flag("--checkpoint-every", ("checkpoint_every",), "Checkpoint every N steps (0: on exit)."),
        Flag("--log-every", ("log_every",), "A progress line every N steps."),
        Flag("--eval-every", ("eval_every",), "Evaluate the outer weights every N steps."),
        *COMPUTE_FLAGS,
        Flag(
            "--outer-device",
            ("outer_device",),
            "Where a GPU node keeps the outer parameters and momentum: pinned host memory "
            "(deterministic FP32 update, as on every CPU node) or the device.",
        ),
    ),
)
ROUND_FLAGS = Flags(
    RoundOptions,
    (
        Flag("--min-group-size", ("min_group_size",), "Fewest members for a round."),
        Flag(
            "--matchmaking-window",
            ("matchmaking_window",),
            "Seconds to wait for peers at a round's send step.",
        ),
        Flag("--round-timeout", ("round_timeout",), "Seconds to wait for parts."),
        Flag(
            "--wait-for-peers",
            ("wait_for_peers",),
            "Before the first step, wait until this many other nodes are in the run (give "
            "the creator and the first joiners the same number: they start together).",
        ),
    ),
)
NETWORK_FLAGS = Flags(
    NetworkOptions,
    (
        Flag(
            "--listen",
            ("host_maddrs",),
            "Multiaddr to listen on (repeatable); /ip4/0.0.0.0/tcp/31337 accepts peers from "
            "other machines.",
        ),
        Flag("--announce", ("announce_maddrs",), "Public multiaddr to announce (repeatable)."),
        Flag(
            "--identity",
            ("identity_path",),
            "Private key file for a stable peer id (created if missing) [default: "
            "CHECKPOINT_DIR/identity.key, so a resumed node keeps its peer id, and a resumed "
            "run its creator].",
            kind="file",
        ),
        Flag(
            "--swarm-key",
            ("swarm_key_path",),
            "Closed swarm: file with the run's shared key (make one with `diloco-node keygen "
            "--swarm-key FILE`); only holders of the key take part. A key can leak: `start "
            "--admit FILE` also names the peer ids that may take part.",
            kind="existing",
        ),
        Flag("--use-relay", ("use_relay",), "Reach and be reached through relays (behind NAT)."),
        Flag("--nat-port-map", ("nat_port_map",), "Ask the router for a port mapping (UPnP)."),
        Flag(
            "--client-mode",
            ("client_mode",),
            "Nobody can dial this node (behind NAT): train without reducing any part "
            "[default: ask the initial peers to dial back, and be a client if none can].",
        ),
    ),
)

TAU_PATH = ("outer", "fragment_sync_delay")


def run_config(
    toml: str | Path | None, given: Mapping[str, object], tau: int | None = None
) -> RunConfig:
    """The run a ``start`` describes: ``--config`` (else the defaults), then the run flags
    typed on the command line (``given``, by parameter name); a starter's ``--tau`` is also
    the run's default tau (what joiners take unless they choose their own).
    """
    base = read_toml(toml) if toml is not None else {}
    if tau is not None:
        set_path(base, TAU_PATH, tau)
    return RUN_FLAGS.build(given, base)


def join_mismatch(
    swarm: RunConfig, toml: str | Path | None, given: Mapping[str, object]
) -> list[str]:
    """What a joiner's ``--config`` and typed run flags contradict in the swarm's run.

    Without ``--config`` the swarm's configuration is the base, so only typed flags can
    differ; each difference is named by the flag that sets it (``--H: the run's 30, yours
    10``), and by its key too under ``--config``. tau is each node's own choice and never
    compared; the creator, the swarm key id
    and the admitted peers come from the swarm unless the file names them (the starter's
    file does not), and so does a vocabulary the file leaves out (``start`` may have set it
    from its corpus).
    """
    base = read_toml(toml) if toml is not None else swarm.to_dict()
    set_path(base, TAU_PATH, swarm.outer.fragment_sync_delay)
    base.setdefault("creator", swarm.creator)
    base.setdefault("swarm_key_id", swarm.swarm_key_id)
    base.setdefault("admitted", None if swarm.admitted is None else list(swarm.admitted))
    base.setdefault("vocab_size", swarm.vocab_size)
    mine, theirs = _leaves(RUN_FLAGS.build(given, base).to_dict()), _leaves(swarm.to_dict())
    names = {flag.path: flag.name for flag in RUN_FLAGS.flags}
    diffs = []
    for path in sorted(mine.keys() | theirs.keys()):
        if mine.get(path) != theirs.get(path):
            key = ".".join(path)
            # Named as the person typed it: the flag, with the file's key under --config.
            name = (
                names.get(path, key)
                if toml is None or path not in names
                else f"{names[path]} ({key})"
            )
            diffs.append(f"{name}: the run's {theirs.get(path)!r}, yours {mine.get(path)!r}")
    return diffs


def _leaves(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every value of nested tables ``data`` by its path, e.g. ``("outer", "sync_every")``."""
    leaves: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            leaves.update(_leaves(value, (*prefix, key)))
        else:
            leaves[(*prefix, key)] = value
    return leaves
