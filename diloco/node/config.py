"""The node's configuration: what a run shares and what each volunteer chooses.

``RunConfig`` is what every node of a run shares; its hash is part of the run id (docs/design.md
"The round"). ``NodeOptions`` and ``RoundOptions`` are each volunteer's own choices, and so is
``diloco.protocol.runtime.network.NetworkOptions``: none of them is ever taken from the swarm
(docs/design.md "Threat model"), so the data path lives in
``NodeOptions``, never in the run configuration.

Every default is written once, in these dataclasses (and in ``OuterConfig`` /
``InnerConfig`` for the optimisers). ``diloco.node.flags`` names the command-line flag of
a field and the CLI derives each option's type, choices and default from the field, so
``diloco-node start``, ``start --config run.toml`` and the library agree by construction.

Values from files and peers are built with ``from_mapping``: unknown keys, wrong types and
non-finite numbers are ``ConfigError``s naming the key; ranges and cross-field rules are
checked in each dataclass's ``__post_init__``, whose message names the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from diloco.codecs import CODEC_NAMES, Codec, get_codec
from diloco.errors import ConfigError, ProtocolError
from diloco.node.data.corpus import BYTES, check_tokenizer, check_tokenizer_identity
from diloco.node.model.compute import ComputeOptions
from diloco.node.model.fragments import EmbeddingPlacement, Pattern
from diloco.node.model.transformer import PRESETS, ModelConfig, preset
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer import OuterDevice
from diloco.node.training.outer_config import OuterConfig, round_token_cap
from diloco.node.training.pace import PaceMode
from diloco.protocol.core.aggregation import CLIP_FACTOR, check_clip_factor
from diloco.protocol.wire.run_id import RUN_NAME_PATTERN

if typing.TYPE_CHECKING:
    from diloco.protocol.core.group import RoundTimeouts

T = TypeVar("T")
KEY_ID_PATTERN = re.compile(r"[0-9a-f]{16}")
ReturnCodec = Literal["e3m0", "int8", "bf16", "none"]
"""Codecs a reducer may send the averaged outer gradient back in (``RunConfig.return_codec``)."""


def return_codec_for(name: str | None, codec: Codec, rounding: str) -> Codec:
    """The codec of the averaged outer gradient a reducer sends back (docs/design.md "The round":
    encoded once): ``name``'s, with the run's E3M0 ``rounding``, or the outer-gradient ``codec``
    itself when ``name`` is None."""
    if name is None:
        return codec
    return get_codec(name, **({"rounding": rounding} if name == "e3m0" else {}))


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What every node of a run shares; its hash is part of the run id (docs/design.md "The
    round")."""

    name: str = "diloco"
    """Human name of the run, ``[A-Za-z0-9_-]{1,64}``; the first part of the run id."""
    preset: str = "tiny"
    """Model preset (docs/design.md "Model presets", ``diloco.node.model.transformer.PRESETS``)."""
    seq_len: int = 128
    """Tokens per sequence."""
    steps: int = 600
    """T: inner steps of the whole run (the learning-rate schedule spans them)."""
    fragment_size: int = 1
    """Transformer blocks per fragment (docs/design.md "Algorithm and schedule")."""
    pattern: Pattern = "strided"
    """Which blocks form a fragment: ``strided`` (p, p+P, ...) or ``sequential``."""
    embedding_fragment: EmbeddingPlacement = "own"
    """Embedding, final norm and head: a fragment of their ``own``, or in the ``first``."""
    codec: str = "e3m0"
    """Outer-gradient codec on the wire (docs/design.md "Codecs")."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """E3M0 rounding (docs/design.md "Codecs")."""
    return_codec: ReturnCodec | None = None
    """Codec of the averaged outer gradient each reducer encodes once and sends back (the
    second quantisation, docs/design.md "The round"); None: ``codec``'s. E3M0 there costs 4.25 bits
    per value and about 0.27 relative error against the exact mean (0.19 from the first encoding
    alone); benchmarks/RESULTS.md ("Return codec") measures loss and bytes of each."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    seed: int = 0
    """Seed of the initial weights (every node starts from the same ones)."""
    dataset: str | None = None
    """Name of the corpus the run trains on, for people (e.g. ``fineweb-edu``); never read
    as a path: each node chooses its own data (``NodeOptions.data``)."""
    max_round_tokens: int | None = None
    """Cap on a member's weight in one round, in tokens (its weight is the tokens it
    processed since its last sync of the fragment plus those carried from failed rounds,
    docs/design.md "Algorithm and schedule" step 3); a member counts at most this much, so no peer
    owns a mean by claiming a huge weight (``diloco.protocol.core.aggregation``). None:
    ``outer_config.CAP_SEQUENCES`` x ``seq_len`` x H, the tokens of four rounds of a node with
    the default batch of 8 sequences; raise it for runs whose nodes take bigger batches."""
    clip_factor: float = CLIP_FACTOR
    """C of the reducers' norm clipping: per chunk, a contribution whose norm exceeds C
    times the lower median of the members' norms is scaled down to it, and weights are
    capped at their lower median (0: plain weighted mean). The default, 1, is what keeps
    one member from reversing the mean (docs/design.md "Aggregation bounds")."""
    max_group_size: int | None = None
    """Most members of one all-reduce group: a fragment round with more runs in stages on a
    grid of groups of at most this many (``diloco.protocol.staged.runner``), every
    node following the same plan. None: one flat group, whatever its size."""
    creator: str | None = None
    """Peer id (base58) of the node that started the run; its key signs this configuration
    (docs/design.md "Threat model"), so another configuration with the same name has another run id.
    ``start``
    sets it from its identity."""
    swarm_key_id: str | None = None
    """Closed swarms: ``SwarmKey.key_id`` of the run's key (a hash, never the key); None:
    an open swarm. ``start --swarm-key FILE`` sets it."""
    admitted: tuple[str, ...] | None = None
    """Peer ids (sorted, distinct) that may take part besides the creator: every node ignores
    the records and refuses the streams of other peers, even holders of the swarm key
    (``diloco.protocol.trust.admission``); None: anyone (with the key, in a closed swarm).
    ``start --admit FILE`` sets it."""
    vocab_size: int | None = None
    """Token vocabulary of the model; None: the preset's. ``start`` sets it from a prepared
    corpus whose tokenizer needs more (``resolve_vocab``); every node's corpus must fit it."""
    dataset_fingerprint: str | None = None
    """sha256 fingerprint of a prepared corpus's manifest (``prepare-data`` prints it): when
    set, a node trains only on a corpus with this fingerprint. Never a path."""
    tokenizer: str = BYTES
    """What made the run's tokens, which every node's corpus must share (docs/design.md "Data
    and exports"): ``bytes`` (the embedded corpus, text files), the sha256 of the
    ``tokenizer.json`` its data was prepared with (``prepare-data`` records it in the
    manifest), or ``unrecorded`` (token files without a manifest). ``start`` sets it from
    its ``--data``; each node keeps its own corpus."""

    def __post_init__(self) -> None:
        if not RUN_NAME_PATTERN.match(self.name):
            raise ConfigError(f"run name {self.name!r} must match {RUN_NAME_PATTERN.pattern}")
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        _at_least("seq_len", self.seq_len, 2, "tokens per sequence")
        _at_least("steps", self.steps, 1, "inner steps")
        _at_least("fragment_size", self.fragment_size, 1, "blocks per fragment")
        _at_least("seed", self.seed, 0, "")
        if self.codec not in CODEC_NAMES:
            raise ConfigError(
                f"unknown codec {self.codec!r}; choose one of {', '.join(CODEC_NAMES)}"
            )
        if self.dataset is not None and not (0 < len(self.dataset) <= 100):
            raise ConfigError("dataset must be a name of 1 to 100 characters")
        if self.creator is not None:
            # Imported here: identity reads libp2p's key format through hivemind, which the
            # trainers (and a GPU machine without hivemind) must not need to import.
            from diloco.protocol.trust.identity import public_key_of

            try:
                public_key_of(self.creator)
            except ProtocolError as error:
                raise ConfigError(f"creator: {error}") from error
        if self.swarm_key_id is not None and not KEY_ID_PATTERN.fullmatch(self.swarm_key_id):
            raise ConfigError(f"swarm_key_id {self.swarm_key_id!r} is not 16 hex digits")
        if self.admitted is not None:
            from diloco.protocol.trust.admission import check_peer_ids  # hivemind, as above

            check_peer_ids(self.admitted)
            if list(self.admitted) != sorted(set(self.admitted)) or not self.admitted:
                raise ConfigError("admitted must list peer ids sorted and each once (--admit)")
        if self.max_round_tokens is not None:
            _at_least("max_round_tokens", self.max_round_tokens, 1, "tokens")
        try:
            check_clip_factor(self.clip_factor)
        except ValueError as error:
            raise ConfigError(f"{error}, e.g. 3") from error
        if self.max_group_size is not None:
            _at_least("max_group_size", self.max_group_size, 2, "members")
        if self.vocab_size is not None:
            _at_least("vocab_size", self.vocab_size, 2, "tokens")
        check_tokenizer_identity(self.tokenizer)
        fingerprint = self.dataset_fingerprint
        if fingerprint is not None and not _SHA256_HEX.fullmatch(fingerprint):
            raise ConfigError(
                f"dataset_fingerprint must be 64 lowercase hex digits (a manifest's "
                f"fingerprint), got {fingerprint!r}"
            )

    def admitted_peers(self) -> frozenset[str] | None:
        """Who may take part: the admitted peer ids and the creator; None: anyone."""
        if self.admitted is None:
            return None
        return frozenset(self.admitted) | ({self.creator} if self.creator else set())

    def round_token_cap(self) -> int:
        """A member's largest weight in one round, in tokens (``max_round_tokens``)."""
        return round_token_cap(self.max_round_tokens, self.seq_len, self.outer.sync_every)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """Strict inverse of ``to_dict`` (for configurations read from peers): unknown,
        missing or mistyped keys are errors."""
        return from_mapping(cls, data, complete=True)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """A run configuration file: keys of ``to_dict``, ``[outer]`` and ``[inner]`` as
        tables; keys left out take their defaults."""
        return from_mapping(cls, read_toml(path))

    def model_config(self) -> ModelConfig:
        config = preset(self.preset)
        config.max_seq_len = max(config.max_seq_len, self.seq_len)
        if self.vocab_size is not None:
            config.vocab_size = self.vocab_size
        return config

    def check_corpus(
        self, vocab_size: int, fingerprint: str | None, what: str, *, tokenizer: str
    ) -> None:
        """Refuse a corpus (``what``) that this run's model cannot train on, or whose tokens
        were made by another tokenizer than the run's (``tokenizer``, ``CorpusInfo``).

        Raises:
            ConfigError: token ids past the model's vocabulary, another tokenizer, or the run
                pins a dataset fingerprint that the corpus does not have; one line naming
                the fix.
        """
        check_corpus_fits(self.model_config().vocab_size, vocab_size, what)
        check_tokenizer(self.tokenizer, tokenizer, what)
        if self.dataset_fingerprint is not None and fingerprint != self.dataset_fingerprint:
            raise ConfigError(
                f"the run trains on the prepared corpus {self.dataset_fingerprint[:12]}..., "
                f"but {what} is "
                + (f"{fingerprint[:12]}..." if fingerprint else "not a prepared corpus")
                + "; point --data at a folder prepared like the run's (prepare-data prints its"
                " fingerprint)"
            )


def resolve_vocab(preset_vocab: int, fixed: int | None, corpus_vocab: int) -> int:
    """The model vocabulary of a run being defined (``start``, ``local``): ``fixed`` if
    given, else the preset's raised to the corpus's when the corpus needs more."""
    return fixed if fixed is not None else max(preset_vocab, corpus_vocab)


def check_corpus_fits(model_vocab: int, corpus_vocab: int, what: str) -> None:
    """Raise ConfigError when token ids of a corpus can reach past the model's vocabulary."""
    if corpus_vocab > model_vocab:
        raise ConfigError(
            f"{what} has a vocabulary of {corpus_vocab:,} tokens but the model only "
            f"{model_vocab:,}; the run needs --vocab-size {corpus_vocab} (set when it starts), "
            "or use data prepared with the run's tokenizer"
        )


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    """What each volunteer chooses for their own node (never part of the run id)."""

    batch_size: int = 8
    """Sequences per inner step on this node (its share of a round's mean is its tokens)."""
    tau: str | None = "auto"
    """tau: this node's steps between sending a fragment and applying its round (docs/design.md
    "Algorithm and schedule"): ``auto`` (the default), which starts from the run's tau and
    follows this node's round latency over its step time (``diloco.node.training.tau``;
    docs/design.md "Across the internet"); a number of steps; None takes the run's
    ``outer.fragment_sync_delay``."""
    pace: PaceMode = "adaptive"
    """``adaptive``: when this node is slower per step than the swarm's pace (the upper
    median of the counted full-batch step seconds), it trains fewer sequences per inner step
    so the others do not wait for it (``diloco.node.training.pace``; docs/design.md "Pace");
    ``fixed``: always the
    full ``batch_size`` (the swarm then moves at its slowest node's pace)."""
    slow_down: float = 1.0
    """Every inner step takes this many times its compute (it sleeps the rest): tests and
    benchmarks make a node slower on purpose, by a factor that holds whatever the load."""
    device: str = "cpu"
    """torch device, e.g. ``cuda:0``."""
    threads: int = 0
    """torch CPU threads (0: torch's default). Several nodes on one machine want 1 each:
    OpenMP threads spinning on oversubscribed cores slow every step many times over."""
    data: str | None = None
    """Corpus path on this machine (see ``diloco.node.data.corpus``); None: the embedded corpus."""
    data_seed: int | None = None
    """Seed of this node's data stream; None draws one at random (nodes should differ)."""
    checkpoint_dir: str | None = None
    """Folder for checkpoints (every ``checkpoint_every`` steps and on exit); None: none."""
    checkpoint_every: int = 0
    """Inner steps between two checkpoints (0: only on exit)."""
    log_every: int = 25
    """Inner steps between two progress lines."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    eval_every: int = 0
    """Inner steps between two held-out evaluations of the outer weights, published for
    dashboards (0: only at the end)."""
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    """How this node computes its inner steps (precision, micro-batches, compile)."""
    outer_device: OuterDevice = "cpu"
    """Where the outer parameters and momentum live: ``cpu`` (pinned host memory on a GPU
    node; the outer update is deterministic FP32 there, docs/design.md "Algorithm and schedule") or
    ``device`` (next to the
    model: no copies, but the update's rounding may differ from CPU nodes')."""

    def __post_init__(self) -> None:
        _at_least("batch_size", self.batch_size, 1, "sequences")
        if self.compute.micro_batch_size > self.batch_size:
            raise ConfigError(
                f"micro_batch_size {self.compute.micro_batch_size} exceeds batch_size "
                f"{self.batch_size}; lower --micro-batch-size (0: the whole batch)"
            )
        if self.tau is not None and self.tau != "auto" and not self.tau.isdigit():
            raise ConfigError(f"tau must be auto or a number of steps >= 0, got {self.tau!r}")
        if not (math.isfinite(self.slow_down) and self.slow_down >= 1):
            raise ConfigError(f"slow_down must be a factor >= 1, got {self.slow_down}")
        _at_least("threads", self.threads, 0, "(0: torch's default)")
        _at_least("checkpoint_every", self.checkpoint_every, 0, "steps (0: only on exit)")
        _at_least("log_every", self.log_every, 1, "steps")
        _at_least("eval_batches", self.eval_batches, 1, "batches")
        _at_least("eval_every", self.eval_every, 0, "steps (0: only at the end)")
        if self.data_seed is not None:
            _at_least("data_seed", self.data_seed, 0, "")
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ConfigError(f"unknown device {self.device!r}, e.g. cpu or cuda:0") from error
        if self.data is not None and not Path(self.data).exists():
            raise ConfigError(f"data path {self.data} does not exist; check --data")
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).is_file():
            raise ConfigError(f"checkpoint dir {self.checkpoint_dir} is a file; name a folder")

    @property
    def fixed_tau(self) -> int | None:
        """The tau this node was given as a number; None for ``auto`` and the run's."""
        return None if self.tau is None or self.tau == "auto" else int(self.tau)


@dataclass(kw_only=True, slots=True)
class RoundOptions:
    """How long this node waits for others in a round (local choices, docs/design.md "The
    round")."""

    min_group_size: int = 2
    """A round needs this many members, else it fails (1: a lone node averages alone)."""
    matchmaking_window: float = 2.0
    """Seconds a node waits for others to declare themselves for a round."""
    round_timeout: float = 10.0
    """Seconds a reducer waits for parts (and a member for averaged parts)."""
    exit_timeout: float = 5.0
    """On Ctrl-C, seconds to let rounds in flight finish before abandoning them."""
    wait_for_peers: int = 0
    """Other live nodes this node waits for before its first step (0: none). A run's
    creator and its first joiners given the same number start together, at step 0,
    instead of each joiner at the step the others had reached when it came in
    (docs/design.md "The node and its CLI")."""

    def __post_init__(self) -> None:
        _at_least("min_group_size", self.min_group_size, 1, "members")
        for name in ("matchmaking_window", "round_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.exit_timeout >= 0:
            raise ConfigError(f"exit_timeout must be >= 0 seconds, got {self.exit_timeout}")
        _at_least("wait_for_peers", self.wait_for_peers, 0, "nodes (0: none)")

    def timeouts(self) -> RoundTimeouts:
        from diloco.protocol.core.group import RoundTimeouts  # hivemind: only a swarm node needs it

        return RoundTimeouts(
            matchmaking_window=self.matchmaking_window,
            join_timeout=max(1.0, self.matchmaking_window),
            sender_timeout=self.round_timeout,
            reducer_timeout=self.round_timeout,
            connect_timeout=min(5.0, self.round_timeout),
        )


def _at_least(name: str, value: int, low: int, unit: str) -> None:
    if value < low:
        raise ConfigError(f"{name} must be >= {low} {unit}".rstrip() + f", got {value}")


# -- building from plain data (TOML files, peers' JSON, flags) ---------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file, as plain data."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read run configuration {path}: {error}") from error


def from_mapping(cls: type[T], data: object, complete: bool = False, where: str = "") -> T:
    """The dataclass ``cls`` built from plain data, strictly (nested dataclasses too).

    Keys must be fields; values must have the field's type (an int for a float is taken;
    a bool is never a number; floats must be finite). With ``complete`` every field must
    be given, as in a peer's copy of ``to_dict``; else missing fields take their defaults.

    Raises:
        ConfigError: naming the key, for any of the above or a failed ``__post_init__``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where[:-1] or 'configuration'}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown keys {[where + str(k) for k in unknown]}; known: {names}")
    missing = sorted(set(names) - set(data)) if complete else []
    if missing:
        raise ConfigError(f"missing keys {[where + k for k in missing]}")
    values = {k: _typed(hints[k], v, f"{where}{k}", complete) for k, v in data.items()}
    try:
        return cls(**values)
    except ConfigError as error:
        raise ConfigError(f"{where[:-1]}: {error}" if where else str(error)) from error


def _typed(hint: Any, value: object, key: str, complete: bool) -> object:
    """``value`` as a ``hint``, or a ConfigError that names ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_mapping(typing.cast(type[Any], hint), value, complete, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(inner, value, key, complete)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple and isinstance(value, list | tuple):
        items = args[:1] * len(value) if args[-1:] == (...,) else args
        if len(items) != len(value):
            raise ConfigError(f"{key}: expected {len(items)} values, got {value!r}")
        return tuple(_typed(t, v, key, complete) for t, v in zip(items, value, strict=True))
    if origin is list and isinstance(value, list):
        return [_typed(args[0], v, key, complete) for v in value]
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    raise ConfigError(f"{key}: expected {expected.get(hint, hint)}, got {value!r}")


def set_path(data: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    """``data[path[0]]...[path[-1]] = value``, making the tables on the way."""
    for key in path[:-1]:
        data = data.setdefault(key, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{key}: expected a table, got {data!r}")
    data[path[-1]] = value


def config_mismatch(mine: RunConfig, theirs: RunConfig) -> list[str]:
    """Human-readable differences between two run configurations (empty if equal)."""
    a, b = mine.to_dict(), theirs.to_dict()
    diffs = []
    for key in sorted(set(a) | set(b)):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            for sub in sorted(set(a[key]) | set(b[key])):
                if a[key].get(sub) != b[key].get(sub):
                    diffs.append(
                        f"{key}.{sub}: yours {a[key].get(sub)!r}, swarm's {b[key].get(sub)!r}"
                    )
        elif a.get(key) != b.get(key):
            diffs.append(f"{key}: yours {a.get(key)!r}, swarm's {b.get(key)!r}")
    return diffs
