"""Chained block hashes: the one definition of "same prefix" that replicas and gateways share.

Token ids are cut into blocks of ``block_size`` tokens; only full blocks count. Block i hashes
the previous block's hash (8 bytes, little-endian) followed by its tokens (little-endian uint32):
``h_i = xxh3_64(h_{i-1} || tokens_i)``. ``h_{-1}`` is a seed derived from the model identity, so
two models never share a hash. Equal hash therefore means equal whole prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

PROTOCOL_VERSION = 1
DEFAULT_BLOCK_SIZE = 16

_xxh3 = xxhash.xxh3_64_intdigest


def model_seed(served_model_name: str, tokenizer_fingerprint: str) -> int:
    """h_{-1}: the chain's root, unique per (served model name, tokenizer fingerprint)."""
    identity = f"kvroute/v{PROTOCOL_VERSION}\x00{served_model_name}\x00{tokenizer_fingerprint}"
    return _xxh3(identity.encode())


def chain_hash(parent_hash: int, block_tokens: Sequence[int]) -> int:
    """Hash of one block given its parent's hash (used by the radix cache, one page at a time)."""
    payload = parent_hash.to_bytes(8, "little") + np.asarray(block_tokens, dtype="<u4").tobytes()
    return _xxh3(payload)


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int) -> list[int]:
    """Hashes of every full block of ``token_ids``, chained from ``seed``.

    Packing is vectorised: the tokens become one bytes object, and the loop runs once per block.
    """
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = np.asarray(token_ids[: num_blocks * block_size], dtype="<u4").tobytes()
    stride = block_size * 4
    hashes: list[int] = []
    prev = seed
    for start in range(0, num_blocks * stride, stride):
        prev = _xxh3(prev.to_bytes(8, "little") + packed[start : start + stride])
        hashes.append(prev)
    return hashes
