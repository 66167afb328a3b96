"""An in-memory stand-in for the DHT of ``SigningDHT``: the two calls ``signed_records`` makes,
on a dict that every peer of a test shares (no process, no daemon)."""

from __future__ import annotations

from typing import Any

from hivemind.utils import DHTExpiration, ValueWithExpiration
from hivemind.utils.serializer import MSGPackSerializer

from diloco.protocol.trust.envelopes import SigningDHT
from diloco.protocol.trust.identity import Identity

Table = dict[str, dict[Any, tuple[bytes, float]]]


class MemoryDHT(SigningDHT):
    """The two calls ``signed_records`` makes of a DHT, on a dict shared by every peer; the
    values go through msgpack as over the wire, and a subkey keeps the value with the
    latest expiration, as hivemind's storage does."""

    def __init__(self, identity: Identity, table: Table) -> None:
        self.identity, self.table = identity, table

    def __del__(self) -> None:  # no process to stop
        pass

    async def store(
        self, key: str, value: Any, expiration: DHTExpiration, subkey: Any, return_future: bool
    ) -> bool:
        held = self.table.setdefault(key, {})
        if subkey in held and held[subkey][1] >= expiration:
            return False  # hivemind's rule: the value with the later expiration stays
        held[subkey] = (MSGPackSerializer.dumps(value), expiration)
        return True

    async def get(self, key: str, latest: bool, return_future: bool) -> Any:
        items = self.table.get(key)
        if not items:
            return None
        value = {
            sub: ValueWithExpiration(MSGPackSerializer.loads(data), expiration)
            for sub, (data, expiration) in items.items()
        }
        return ValueWithExpiration(value, max(e for _, e in items.values()))
