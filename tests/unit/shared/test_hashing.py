"""Block hashes: chained, deterministic across processes, sensitive to every input."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvserve.shared.hashing import (
    get_hash_fn,
    hash_block_tokens,
    hash_new_full_blocks,
    make_extra_keys,
    root_hash,
)

TOKEN_IDS = list(range(100, 164))  # 4 blocks of 16


def test_sha256_follows_the_documented_packing():
    hash_fn = get_hash_fn("sha256")
    tokens = [1, 2, 70000]
    parent = hashlib.sha256(b"some parent").digest()
    message = parent + struct.pack("<I", 3) + np.array(tokens, dtype="<i4").tobytes() + b"extra"
    assert hash_block_tokens(hash_fn, parent, tokens, b"extra") == hashlib.sha256(message).digest()
    # A first block chains to the root hash of the fixed seed.
    root = hashlib.sha256(b"kvserve/prefix-cache/v1").digest()
    assert root_hash(hash_fn) == root
    assert hash_block_tokens(hash_fn, None, tokens) == hash_block_tokens(hash_fn, root, tokens)


@pytest.mark.parametrize("algo, digest_size", [("sha256", 32), ("xxhash", 16)])
def test_every_input_changes_the_hash(algo, digest_size):
    hash_fn = get_hash_fn(algo)
    base = hash_block_tokens(hash_fn, None, [1, 2, 3])
    assert len(base) == digest_size
    assert hash_block_tokens(hash_fn, None, [1, 2, 3]) == base
    variants = [
        hash_block_tokens(hash_fn, None, [1, 2, 4]),
        hash_block_tokens(hash_fn, None, [3, 2, 1]),
        hash_block_tokens(hash_fn, base, [1, 2, 3]),
        hash_block_tokens(hash_fn, None, [1, 2, 3], make_extra_keys("tenant-a")),
        hash_block_tokens(hash_fn, None, [1, 2, 3], make_extra_keys("tenant-b")),
        hash_block_tokens(hash_fn, root_hash(hash_fn, b"another seed"), [1, 2, 3]),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_token_count_separates_tokens_from_extra_keys():
    hash_fn = get_hash_fn("sha256")
    # Without the explicit count these two would hash the same byte string.
    as_token = hash_block_tokens(hash_fn, None, [1, 0x05040302])
    as_extra = hash_block_tokens(hash_fn, None, [1], bytes([2, 3, 4, 5]))
    assert as_token != as_extra


def test_chain_covers_the_whole_prefix():
    hash_fn = get_hash_fn("sha256")
    hashes = hash_new_full_blocks(hash_fn, 16, TOKEN_IDS, [])
    assert len(hashes) == 4
    changed = list(TOKEN_IDS)
    changed[0] += 1  # only block 0 differs, yet every later hash must change
    changed_hashes = hash_new_full_blocks(hash_fn, 16, changed, [])
    assert all(a != b for a, b in zip(hashes, changed_hashes))


def test_incremental_hashing_equals_one_shot():
    hash_fn = get_hash_fn("xxhash")
    salt = make_extra_keys("s")
    all_token_ids = TOKEN_IDS + [1, 2]
    one_shot = hash_new_full_blocks(hash_fn, 16, all_token_ids, [], salt)
    assert len(one_shot) == 4  # the trailing 2 tokens are not a full block
    incremental: list[bytes] = []
    for num_tokens in range(len(all_token_ids) + 1):  # one token at a time, like decoding
        incremental += hash_new_full_blocks(
            hash_fn, 16, all_token_ids[:num_tokens], incremental, salt
        )
    assert incremental == one_shot


def test_salt_only_in_first_block_still_separates_every_block():
    hash_fn = get_hash_fn("sha256")
    plain = hash_new_full_blocks(hash_fn, 16, TOKEN_IDS, [])
    salted = hash_new_full_blocks(hash_fn, 16, TOKEN_IDS, [], make_extra_keys("x"))
    assert not set(plain) & set(salted)
    assert make_extra_keys(None) is None and make_extra_keys("") is None


def test_hashes_agree_across_processes_with_different_hash_seeds():
    script = textwrap.dedent("""
        from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks, make_extra_keys
        for algo in ("sha256", "xxhash"):
            hashes = hash_new_full_blocks(get_hash_fn(algo), 16, list(range(100, 164)), [],
                                          make_extra_keys("salt"))
            print(",".join(h.hex() for h in hashes))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    outputs = []
    for hash_seed in ("1", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=root)
        result = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(result.stdout)
    expected = "".join(
        ",".join(
            h.hex()
            for h in hash_new_full_blocks(
                get_hash_fn(algo), 16, TOKEN_IDS, [], make_extra_keys("salt")
            )
        )
        + "\n"
        for algo in ("sha256", "xxhash")
    )
    assert outputs == [expected, expected]


def test_bad_inputs_raise_actionable_errors(monkeypatch):
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("md5")
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(get_hash_fn("sha256"), None, [-1])
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(get_hash_fn("sha256"), None, [2**31])
    # Without the xxhash package the error says how to fix it.
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ValueError, match="pip install xxhash"):
        get_hash_fn("xxhash")
