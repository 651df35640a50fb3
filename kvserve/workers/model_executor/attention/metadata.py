"""What every attention backend needs to know about one step's batch, and how it gets built.

The flat token batch is ordered decodes first (one token each), then prefill chunks.

Why one builder: on a GPU, every small tensor made from host lists is its own host->device copy,
and a step needs about eight of them (slots, tables, lengths, cu_seqlens...). `build`
packs every integer of the step (and whatever the caller adds: token ids, positions, logits rows)
into one host buffer, copies it to the device once, and hands out views of it. The lengths a
kernel call needs as Python ints (`max_*`) are kept from the host lists, so reading them never
waits for the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PrefillSegment:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int  # tokens computed in this chunk
    context_len: int  # tokens in the cache once the chunk is written (prior context + q_len)
    block_table: torch.Tensor  # [blocks] int32: a row of `prefill_block_tables` (a view)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] long: cache slot of every token of the batch
    num_decodes: int
    decode_block_tables: torch.Tensor  # [decodes, max_blocks] int32: block_tables[:decodes]
    decode_context_lens: torch.Tensor  # [decodes] int32: seq_lens[:decodes]
    prefills: list[PrefillSegment]
    # varlen layout of the prefill chunks, for the flash kernels
    cu_seqlens_q: torch.Tensor  # [prefills + 1] int32
    cu_seqlens_k: torch.Tensor  # [prefills + 1] int32
    prefill_block_tables: torch.Tensor  # [prefills, max_blocks] int32: block_tables[decodes:]
    # every sequence of the step at once (decodes, one row each, then prefill chunks), for the
    # kernels that take them in one launch (triton); the views above are rows of these
    block_tables: torch.Tensor | None = None  # [decodes + prefills, max_blocks] int32, 0-padded
    seq_lens: torch.Tensor | None = None  # [decodes + prefills] int32: keys each attends to
    query_start_loc: torch.Tensor | None = None  # [decodes + prefills + 1] int32: first rows
    # host-side facts, so that no backend syncs with the device to learn a length
    max_decode_context: int = 0
    decode_lens_equal: bool = True  # every decode has the same context: no padding to mask
    max_prefill_q: int = 0
    max_prefill_k: int = 0

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[decodes, 1, 1, max_context] bool, True where a key is within the sequence; None when
        all lengths are equal. Built on the device on first use, once per step: only the torch
        backend's SDPA asks for it, the flash and CPU kernels take the lengths themselves."""
        if self.decode_lens_equal:
            return None
        lens = self.decode_context_lens
        keys = torch.arange(self.max_decode_context, device=lens.device)
        return (keys[None, :] < lens[:, None])[:, None, None, :]

    def decode_window_mask(self, window: int) -> torch.Tensor | None:
        """`decode_mask` for a sliding-window layer: True where a key is within the sequence
        and among its last `window` keys (one per window size, built on first use)."""
        if not window or window >= self.max_decode_context:
            return self.decode_mask
        masks = self.__dict__.setdefault("_window_masks", {})
        if window not in masks:
            lens = self.decode_context_lens
            keys = torch.arange(self.max_decode_context, device=lens.device)[None, :]
            seen = (keys < lens[:, None]) & (keys >= lens[:, None] - window)
            masks[window] = seen[:, None, None, :]
        return masks[window]


def build(
    device: torch.device,
    slot_mapping: Sequence[int],
    decodes: Sequence[tuple[Sequence[int], int]],
    prefills: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
    extra: Sequence[Sequence[int]] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """The step's metadata, and `extra` as long tensors, from one host->device copy.

    decodes: (block table, context length) per decode; prefills: (block table, q_len,
    context_len) per chunk; tables may be longer than the context needs (they are cut)."""
    decode_lens = [n for _, n in decodes]
    q_lens = [q for _, q, _ in prefills]
    k_lens = [k for _, _, k in prefills]
    nd, seqs = len(decodes), len(decodes) + len(prefills)
    tables = _padded([t for t, _ in decodes] + [t for t, _, _ in prefills],
                     decode_lens + k_lens, block_size)
    longs = [list(slot_mapping), *map(list, extra)]
    ints = [_flat(tables), decode_lens + k_lens, _cumsum([1] * nd + q_lens), _cumsum(q_lens),
            _cumsum(k_lens)]
    long_part, int_part = _to_device([*longs, *ints], device, split=len(longs))
    slots, *extras = long_part
    all_tables, all_lens, query_start, cu_q, cu_k = int_part
    all_tables = all_tables.view(seqs, -1 if seqs else 0)
    p_tables = all_tables[nd:]
    segments, q_start = [], len(decodes)
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        segments.append(PrefillSegment(q_start, q_len, k_len, p_tables[i]))
        q_start += q_len
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=nd, decode_block_tables=all_tables[:nd],
        decode_context_lens=all_lens[:nd], prefills=segments, cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, prefill_block_tables=p_tables,
        block_tables=all_tables, seq_lens=all_lens, query_start_loc=query_start,
        max_decode_context=max(decode_lens, default=0),
        decode_lens_equal=len(set(decode_lens)) <= 1, max_prefill_q=max(q_lens, default=0),
        max_prefill_k=max(k_lens, default=0),
    )
    return meta, extras


def _padded(tables: list[Sequence[int]], lengths: list[int], block_size: int) -> list[list[int]]:
    """Each table cut to the blocks its length needs, padded with block 0 to the widest; a
    block freed behind a sliding window (NO_BLOCK) reads as block 0 too: the kernels start at
    the window, and the torch backend's gather masks what it reads there."""
    needed = [-(-n // block_size) for n in lengths]
    width = max(needed, default=0)
    return [(list(t[:n]) if not n or t[0] >= 0 else [max(b, 0) for b in t[:n]])
            + [0] * (width - n) for t, n in zip(tables, needed, strict=True)]


def _flat(rows: list[list[int]]) -> list[int]:
    return [v for row in rows for v in row]


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _to_device(
    parts: list[list[int]], device: torch.device, split: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """parts[:split] as long tensors, parts[split:] as int32 ones, all views of one buffer that
    reaches `device` in a single (on CUDA, pinned and asynchronous) copy."""
    host = torch.tensor([v for p in parts for v in p], dtype=torch.long)
    if device.type == "cuda":
        buffer = host.pin_memory().to(device, non_blocking=True)
    else:
        buffer = host.to(device)
    long_lens = [len(p) for p in parts[:split]]
    longs = list(buffer[: sum(long_lens)].split(long_lens))
    ints = buffer[sum(long_lens):].to(torch.int32)  # on the device: a cast, not a copy from host
    return longs, list(ints.split([len(p) for p in parts[split:]]))
