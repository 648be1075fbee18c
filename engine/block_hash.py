"""The block hash: one definition for the prefix caches, the Redis directory and routing.

A full block of `block_size` tokens is named by a chained hash::

    h[0] = H(seed, ROOT,   tokens[0:B],   extra)      extra: e.g. a cache salt (first block only)
    h[i] = H(seed, h[i-1], tokens[iB:(i+1)B])

so a block's hash names the whole prefix up to its end: equal hashes mean equal prefixes (up to a
64-bit collision, which the caches rule out by comparing token ids on a hit), and changing any
earlier token changes every later hash. H is keyed BLAKE2b with an 8-byte digest over
little-endian bytes, so every process on every host computes the same numbers for the same seed;
Python's hash() is never used. Only full blocks have hashes.

Standard library only: the gateway imports this module without torch.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from dataclasses import dataclass
from typing import Sequence

ROOT = 0
STORED, EVICTED = "stored", "evicted"      # prefix cache events (engine.block_pool -> directory)
_U32 = struct.Struct("<I")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    if a.itemsize != 4:                        # pragma: no cover - every platform we run on
        raise RuntimeError("array('I') is not 32-bit here")
    if array("I", [1]).tobytes() != _U32.pack(1):
        a.byteswap()                           # big-endian host: hash the same bytes anyway
    return a.tobytes()


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full blocks of `block_size` tokens with a deployment-wide `seed`."""

    block_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"hash seed must be in [0, 2**64), got {self.seed}")

    def hash_block(self, parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks have hashes: {len(tokens)} tokens, block size "
                             f"{self.block_size}")
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(parent.to_bytes(8, "little"))
        h.update(_U32.pack(len(extra)))
        h.update(extra)
        h.update(_token_bytes(tokens))
        return int.from_bytes(h.digest(), "little")

    def extend(self, hashes: list[int], tokens: Sequence[int], extra: bytes = b"") -> list[int]:
        """Append the hashes of the full blocks of `tokens` not yet in `hashes` (in place).

        `hashes` must be the hashes of the first len(hashes) blocks of the same tokens.
        """
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else ROOT
            hashes.append(self.hash_block(parent, tokens[i * bs:(i + 1) * bs],
                                          extra if i == 0 else b""))
        return hashes

    def hashes(self, tokens: Sequence[int], extra: bytes = b"") -> list[int]:
        return self.extend([], tokens, extra)


def salt_bytes(cache_salt: str) -> bytes:
    """The extra key of a request's first block: its cache salt, if any."""
    return cache_salt.encode("utf-8")


__all__ = ["BlockHasher", "ROOT", "STORED", "EVICTED", "salt_bytes"]
