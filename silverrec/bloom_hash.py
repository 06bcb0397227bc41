"""The stable token hash shared by publish (Bloom signatures) and the predictor (filter programs).

A token is one (feature, value) pair. Its K bit positions in an M-bit signature come from one
keyed BLAKE2b digest (key = the snapshot's hash seed) by double hashing (Kirsch-Mitzenmacher):

    h1, h2 = digest[0:8], digest[8:16] (little-endian), h2 |= 1
    position_i = (h1 + i * h2) mod M,   i = 0..K-1

It does not depend on Python's `hash()` (salted per process), the platform or the torch version,
so a filter compiled on any predictor host addresses the bits the publisher set.
"""

from __future__ import annotations

import hashlib

SEPARATOR = "\x1f"  # unit separator: cannot collide "a=b|c" with "a|b=c"


def token_key(feature: str, value: str) -> bytes:
    return f"{feature}{SEPARATOR}{value}".encode("utf-8")


def token_positions(feature: str, value: str, bits: int, hashes: int, seed: int) -> list[int]:
    """The `hashes` bit positions (in [0, bits)) of token (feature, value); duplicates possible."""
    if bits <= 0 or hashes <= 0:
        raise ValueError(f"Bloom bits and hashes must be positive, got M={bits}, K={hashes}")
    digest = hashlib.blake2b(
        token_key(feature, value), digest_size=16, key=int(seed).to_bytes(8, "little", signed=False)
    ).digest()
    h1 = int.from_bytes(digest[:8], "little")
    h2 = int.from_bytes(digest[8:], "little") | 1
    return [(h1 + i * h2) % bits for i in range(hashes)]
