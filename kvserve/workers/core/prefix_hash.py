"""Content hashes of full KV blocks, for prefix caching.

A block's hash chains its parent's: sha256(parent || salt || token ids), so equal hashes mean
equal whole prefixes. sha256, not Python's `hash()`, because hashes must agree across processes
(the cache manager indexes them cluster-wide). The per-tenant `cache_salt` is part of every
hash, so two tenants never share blocks and cannot probe each other's prompts by timing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int], salt: str) -> bytes:
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(salt.encode())
    digest.update(b"\0")
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str
) -> None:
    """Append the hashes of full blocks len(hashes)..num_blocks-1 of `token_ids`, in place."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
