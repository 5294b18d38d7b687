"""Deterministic, chained hashes of full KV-cache blocks (the keys of prefix caching).

A block's hash covers its parent's hash, its token ids and optional extra keys, so equal hashes
mean equal prefixes, not just equal blocks:

    root ──▶ H(root, tokens[0:16], extra) ──▶ H(h0, tokens[16:32]) ──▶ H(h1, tokens[32:48]) ...

Hashes must agree across processes and machines (a decode engine looks up blocks a prefill
engine wrote), so they are built from bytes only: never Python's salted `hash()`, never pickle.
The hashed message is

    parent_hash | uint32 LE number of tokens | token ids as int32 LE | extra_keys

The parent hash has a fixed length per hash function and the token count is explicit, so the
parts cannot run into each other.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

HashFn = Callable[[bytes], bytes]
HashAlgo = Literal["sha256", "xxhash"]

# The parent of every chain's first block is the hash of this constant (see `root_hash`).
DEFAULT_ROOT_SEED = b"kvserve/prefix-cache/v1"

_TOKEN_DTYPE = np.dtype("<i4")
_MAX_TOKEN_ID = np.iinfo(np.int32).max


def sha256_digest(data: bytes) -> bytes:
    """32-byte SHA-256 digest: the default, collision resistant across tenants."""
    return hashlib.sha256(data).digest()


def get_hash_fn(algo: HashAlgo = "sha256") -> HashFn:
    """The block hash function named by `--prefix-caching-hash-algo`.

    Args:
        algo: "sha256" (hashlib, default) or "xxhash" (xxh3_128: 16 bytes, several times
            faster, not cryptographic; needs the `xxhash` package).
    """
    if algo == "sha256":
        return sha256_digest
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError as exc:
            raise ValueError(
                "prefix_caching_hash_algo='xxhash' needs the xxhash package: "
                "`pip install xxhash`, or use prefix_caching_hash_algo='sha256'"
            ) from exc
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown prefix caching hash algo {algo!r}; use 'sha256' or 'xxhash'")


@functools.lru_cache(maxsize=16)
def root_hash(hash_fn: HashFn, seed: bytes = DEFAULT_ROOT_SEED) -> bytes:
    """The parent hash of a chain's first block, derived from a fixed seed.

    Engines that share a KV store must use the same seed; a different seed gives a disjoint
    cache namespace.
    """
    return hash_fn(seed)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the same on every machine)."""
    array = np.asarray(token_ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > _MAX_TOKEN_ID):
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}] to be hashed")
    return array.astype(_TOKEN_DTYPE).tobytes()


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: bytes | None = None,
) -> bytes:
    """Hash one full block, chained to its parent.

    Args:
        hash_fn: from `get_hash_fn`.
        parent_hash: the previous block's hash; None for a chain's first block (uses
            `root_hash(hash_fn)`).
        token_ids: the block's token ids.
        extra_keys: bytes that must also match for a hit (cache salt, LoRA id, multimodal
            hashes); see `make_extra_keys`.
    """
    if parent_hash is None:
        parent_hash = root_hash(hash_fn)
    message = b"".join(
        (
            parent_hash,
            struct.pack("<I", len(token_ids)),
            pack_token_ids(token_ids),
            extra_keys or b"",
        )
    )
    return hash_fn(message)


def hash_new_full_blocks(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    block_hashes: Sequence[bytes],
    extra_keys: bytes | None = None,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` that `block_hashes` does not cover yet.

    Incremental: pass the hashes computed so far and get only the new ones, so a decoding
    request hashes each block once, when it fills up.

    Args:
        hash_fn: from `get_hash_fn`.
        block_size: tokens per block.
        token_ids: all tokens of the sequence (prompt, then outputs).
        block_hashes: hashes of the first len(block_hashes) blocks, already computed.
        extra_keys: mixed into the first block only; the chain carries it to every later
            block.
        mm_spans: (start, end, content hash) of each image's placeholder tokens: a block
            holding any of them mixes in those images' hashes (the placeholders are equal
            token ids for every image), so only the same image hits.
    """
    num_full_blocks = len(token_ids) // block_size
    parent_hash = block_hashes[-1] if block_hashes else None
    new_hashes = []
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        keys = extra_keys if block_index == 0 else None
        images = [h for lo, hi, h in mm_spans if lo < start + block_size and hi > start]
        if images:
            keys = (keys or b"") + b"".join(b"mm\x00" + h.encode("ascii") for h in images)
        parent_hash = hash_block_tokens(
            hash_fn, parent_hash, token_ids[start : start + block_size], keys
        )
        new_hashes.append(parent_hash)
    return new_hashes


def make_extra_keys(cache_salt: str | None = None, lora_key: bytes = b"") -> bytes | None:
    """Pack a request's extra hash keys into bytes (None when there are none).

    Args:
        cache_salt: a tenant's secret; requests with different salts never share blocks.
        lora_key: the request's adapter (`shared.lora.lora_extra_key`); requests under
            different adapters (or one and the base model) never share blocks.
    """
    # Tags keep the parts from colliding (the LoRA key starts with b"lora\x00").
    salt = b"salt\x00" + cache_salt.encode("utf-8") if cache_salt else b""
    return (lora_key + salt) or None
