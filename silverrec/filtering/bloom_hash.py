"""The stable token hash shared by publish (Bloom signatures) and the predictor (filter programs).

A token is one (feature, value) pair. Its K bit positions in an M-bit signature are K independent
32-bit words of keyed BLAKE2b digests (key = the snapshot's hash seed, salt = block number, 16
positions per 64-byte digest), each reduced mod M:

    position_i = u32le(blake2b(token, key=seed, salt=i // 16)[4 * (i % 16) : 4 * (i % 16) + 4]) mod M

It does not depend on Python's `hash()` (salted per process), the platform or the torch version,
so a filter compiled on any predictor host addresses the bits the publisher set. (Double hashing
h1 + i * h2 mod M was tried first: with M a power of two it has only M^2 / 2 distinct position
sets, and whole tokens collided — measured false-positive rates 10x the estimate.)
"""

from __future__ import annotations

import hashlib

_PER_BLOCK = 16


def token_key(feature: str, value: str) -> bytes:
    """Length-prefixed feature name, then the value: ("a", "bc") and ("ab", "c") cannot collide."""
    name = feature.encode("utf-8")
    return len(name).to_bytes(4, "little") + name + value.encode("utf-8")


def token_positions(feature: str, value: str, bits: int, hashes: int, seed: int) -> list[int]:
    """The `hashes` bit positions (in [0, bits)) of token (feature, value); duplicates possible."""
    if bits <= 0 or hashes <= 0:
        raise ValueError(f"Bloom bits and hashes must be positive, got M={bits}, K={hashes}")
    data = token_key(feature, value)
    key = int(seed).to_bytes(8, "little", signed=False)
    out: list[int] = []
    block = 0
    while len(out) < hashes:
        digest = hashlib.blake2b(data, digest_size=64, key=key, salt=block.to_bytes(16, "little")).digest()
        for j in range(min(_PER_BLOCK, hashes - len(out))):
            out.append(int.from_bytes(digest[4 * j : 4 * j + 4], "little") % bits)
        block += 1
    return out
