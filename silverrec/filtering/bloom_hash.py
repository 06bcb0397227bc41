"""The stable token hash shared by publish (Bloom signatures) and the predictor (filter programs).

A token is one (feature, value) pair. Its K bit positions in an M-bit signature are K independent
32-bit words of keyed BLAKE2b digests (key = the snapshot's hash seed, salt = block number, 16
positions per 64-byte digest), each reduced mod M:

    position_i = u32le(blake2b(token, key=seed, salt=i // 16)[4 * (i % 16) : 4 * (i % 16) + 4]) mod M

It does not depend on Python's `hash()` (salted per process), the platform or the torch version,
so a filter compiled on any predictor host addresses the bits the publisher set. (Double hashing
h1 + i * h2 mod M was tried first: with M a power of two it has only M^2 / 2 distinct position
sets, and whole tokens collided — measured false-positive rates 10x the estimate.)

The hash is C++ (kernels/csrc/filter_compiler.h token_positions), where the filter compiler reads it;
this module is publish's way to it. The token: the feature name's UTF-8 length (u32 little-endian),
the name, then the value ("a", "bc") and ("ab", "c") cannot collide.
"""

from __future__ import annotations


def token_positions(feature: str, value: str, bits: int, hashes: int, seed: int) -> list[int]:
    """The `hashes` bit positions (in [0, bits)) of token (feature, value); duplicates possible."""
    from silverrec.kernels import library

    return library.host().token_positions(feature, value, int(bits), int(hashes), seed_int64(seed))


def seed_int64(seed: int) -> int:
    """The hash seed (an unsigned 64-bit int) as the int64 that carries it to C++."""
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"the Bloom hash seed must be an unsigned 64-bit int, got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed
