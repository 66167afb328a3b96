"""RUN_INFO: a joiner learns the run of the peer it was given, checked, never by name."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from memory_p2p import MemoryNetwork, make_peer_id

from diloco.errors import ConfigError
from diloco.protocol.records.run_configs import SignedRunConfig
from diloco.protocol.records.run_info import (
    RUN_INFO_HANDLER,
    ask_peers,
    choose_run,
    fetch_run_info,
    peer_id_in,
    serve_run_info,
)
from diloco.protocol.runtime import streams
from diloco.protocol.trust.envelopes import pack_payload
from diloco.protocol.trust.identity import Identity, signing_input
from diloco.protocol.wire.frames import Kind
from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.clocked

HONEST, HOSTILE = Identity.generate(), Identity.generate()


def _signed(creator: Identity, name: str = "run", **extra: object) -> SignedRunConfig:
    config = {"name": name, "steps": 10, "creator": creator.peer_id, **extra}
    return SignedRunConfig.sign(creator, make_run_id(name, config), config)


RUN, SAME_NAME = _signed(HONEST), _signed(HOSTILE, data="/home/you/secrets")


def test_peer_id_taken_from_the_last_p2p_part() -> None:
    a, b = HONEST.peer_id, HOSTILE.peer_id
    assert peer_id_in(f"/ip4/1.2.3.4/tcp/31337/p2p/{a}") == a
    assert peer_id_in(f"/ip4/1.2.3.4/tcp/1/p2p/{b}/p2p-circuit/p2p/{a}") == a
    with pytest.raises(ConfigError, match="names no peer"):
        peer_id_in("/ip4/1.2.3.4/tcp/31337")
    with pytest.raises(ConfigError, match="not an Ed25519 peer id"):
        peer_id_in("/ip4/1.2.3.4/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")


def test_choose_run_takes_the_run_the_peers_agree_on() -> None:
    assert choose_run({"a": RUN, "b": RUN}, None) is RUN
    assert choose_run({"a": RUN, "b": "no answer: timeout"}, None) is RUN


def test_choose_run_refuses_peers_that_disagree_unless_pinned() -> None:
    answers: dict[str, SignedRunConfig | str] = {"a": RUN, "b": SAME_NAME}
    with pytest.raises(ConfigError, match=r"train different runs .* --run-id") as error:
        choose_run(answers, None)
    assert RUN.run_id in str(error.value) and SAME_NAME.run_id in str(error.value)
    assert choose_run(answers, RUN.run_id) is RUN
    assert choose_run(answers, SAME_NAME.run_id) is SAME_NAME


def test_choose_run_pinned_run_not_trained_is_an_error() -> None:
    with pytest.raises(ConfigError, match=f"no initial peer trains run {SAME_NAME.run_id}"):
        choose_run({"a": RUN}, SAME_NAME.run_id)
    with pytest.raises(ConfigError, match="no initial peer told which run"):
        choose_run({"a": "no answer: refused"}, None)


def test_same_name_other_creator_is_another_run() -> None:
    plain = _signed(HOSTILE)
    assert plain.config | {"creator": None} == RUN.config | {"creator": None}
    assert plain.run_id != RUN.run_id and plain.run_id.startswith("run-")


async def _ask(served: object) -> dict[str, SignedRunConfig | str]:
    """Ask one in-memory peer that answers RUN_INFO with ``served`` (a signed config, or raw
    payload bytes of a hostile peer)."""
    network = MemoryNetwork()
    peer, joiner = network.join(make_peer_id(1)), network.join(make_peer_id(2))
    if isinstance(served, SignedRunConfig):
        await serve_run_info(peer, served)
    else:

        async def hostile(info: StreamInfo, reader: Any, writer: Any) -> None:
            await streams.write_frame(writer, Kind.RUN_INFO, served)  # type: ignore[arg-type]
            writer.close()

        await peer.add_binary_stream_handler(RUN_INFO_HANDLER, hostile)
    try:
        return await ask_peers(joiner, [peer.peer_id.to_base58()], attempts=1)
    finally:
        network.close()


def test_run_info_answers_the_signed_run() -> None:
    (answer,) = asyncio.run(_ask(RUN)).values()
    assert answer == RUN and isinstance(answer, SignedRunConfig)
    assert answer.config == RUN.config


def _forged(text: str, run_id: str, by: Identity) -> bytes:
    signature = by.sign(signing_input("diloco-run-config/1", run_id, text))
    return pack_payload([run_id, text, signature])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (_forged(RUN.text, RUN.run_id, HOSTILE), "bad signature"),
        (_forged(RUN.text, SAME_NAME.run_id, HONEST), "does not hash"),
        (pack_payload([RUN.run_id, "[" * 40_000, bytes(64)]), "nested deeper"),
        (b"\x91" * 5000 + b"\xc0", "invalid msgpack"),
    ],
    ids=["creator's config signed by another", "other run id", "depth bomb", "garbage"],
)
def test_run_info_from_a_hostile_peer_is_refused_not_a_crash(payload: bytes, reason: str) -> None:
    (answer,) = asyncio.run(_ask(payload)).values()
    assert isinstance(answer, str) and answer.startswith("invalid answer") and reason in answer


def test_fetch_from_a_peer_without_the_handler_is_a_transport_error() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        peer, joiner = network.join(make_peer_id(1)), network.join(make_peer_id(2))
        with pytest.raises(streams.TRANSPORT_ERRORS):
            await fetch_run_info(joiner, peer.peer_id)
        answers = await ask_peers(joiner, [peer.peer_id.to_base58()], attempts=2, pause=0.01)
        (answer,) = answers.values()
        assert isinstance(answer, str) and answer.startswith("no answer")

    asyncio.run(main())
