"""The application writing the source table: puts, updates, deletes, bursts of
changes to one item within one second, hot keys, and now and then an item the
mapping cannot take (a dead letter). It keeps the table as it is after every
change: the oracle's "final table"."""
from __future__ import annotations

import random
from dataclasses import dataclass

from ddb2bt.pipeline.testing.sim.aws import SimStream

__all__ = ["WriterMix", "Writers"]


@dataclass(frozen=True)
class WriterMix:
    per_second: float = 5.0  # changes per simulated second, on average
    keys: int = 400  # distinct items
    hot_keys: int = 5  # ... of which these take ``hot_share`` of the changes
    hot_share: float = 0.3
    delete_share: float = 0.15
    burst_share: float = 0.02  # of the seconds, those with a burst of changes to one item
    burst_size: int = 20
    unmappable_share: float = 0.002  # new items the mapping refuses (each a dead letter)


class Writers:
    """Writes to ``stream`` as ``mix`` says; ``table`` is the source table now."""

    def __init__(self, stream: SimStream, rng: random.Random, mix: WriterMix) -> None:
        self.stream, self.rng, self.mix = stream, rng, mix
        self.table: dict = {}  # key text -> item (boto3 form)
        self.unmappable: set = set()  # key texts of items the mapping refuses
        self.changes = self.deletes = self.bursts = 0
        self._n = 0

    @staticmethod
    def _keys(key_text: str) -> dict:
        pk, sk = key_text.split("#", 1)
        return {"pk": {"S": pk}, "sk": {"S": sk}}

    def _key(self) -> str:
        mix, rng = self.mix, self.rng
        n = rng.randrange(mix.hot_keys) if rng.random() < mix.hot_share else rng.randrange(mix.keys)
        return f"c{n % 7}#p{n}"

    def change(self, key_text: str) -> None:
        """One put, update or delete of ``key_text``."""
        rng, keys = self.rng, self._keys(key_text)
        old = self.table.get(key_text)
        self._n += 1
        self.changes += 1
        if old is not None and rng.random() < self.mix.delete_share:
            del self.table[key_text]
            self.deletes += 1
            self.stream.write(key_text, "REMOVE", keys, None, old)
            return
        new = dict(keys)
        new["Price"] = {"N": str(rng.randrange(1, 10_000))}
        if rng.random() < 0.8:
            new["Description"] = {"S": f"item {key_text} v{self._n}"}
        if rng.random() < 0.3:  # an attribute that comes and goes (a column deleted by an update)
            new["Color"] = {"S": rng.choice(("red", "green", "blue"))}
        self.table[key_text] = new
        self.stream.write(key_text, "MODIFY" if old is not None else "INSERT", keys, new, old)

    def unmappable_insert(self) -> None:
        """A new item whose Price the mapping cannot encode (int64): dead-lettered."""
        self._n += 1
        key_text = f"bad#u{self._n}"
        keys = self._keys(key_text)
        new = dict(keys, Price={"S": "not a number"})
        self.unmappable.add(key_text)
        self.changes += 1
        self.stream.write(key_text, "INSERT", keys, new, None)

    def second(self) -> None:
        """This simulated second's changes."""
        mix, rng = self.mix, self.rng
        count = int(mix.per_second) + (1 if rng.random() < mix.per_second % 1 else 0)
        for _ in range(count):
            if rng.random() < mix.unmappable_share:
                self.unmappable_insert()
            else:
                self.change(self._key())
        if rng.random() < mix.burst_share:
            self.bursts += 1
            key_text = self._key()
            for _ in range(mix.burst_size):
                self.change(key_text)
