"""KV splits of work items: Flash-Decoding's, PAT's and FastTree's long-KV split, and the lengths
at which planners split for parallelism (to fill the GPU, or items longer than a fair share of the
work)."""
from __future__ import annotations

import functools

import numpy as np

from treeattn.plan.strategies.items import DeferredItems, WorkItems, _indptr
from treeattn.plan.format import BLOCK_M_CHOICES
from treeattn.tree.topology import ranges

__all__ = ["split_long_items", "spread_items", "spread_length", "fill_length", "fair_share_length"]


def split_long_items(items: WorkItems, max_len: np.ndarray | int, *, align: int = 16) -> WorkItems:
    """Split every item longer than ``max_len`` (scalar or per item) into equal chunks of at most
    ``max_len`` tokens (rounded up to ``align``), each with all the item's queries: Flash-Decoding's
    KV split, PAT's long-KV split and FastTree's long-context splitting.

    The chunks' segments and queries are made when first read (:class:`_SplitItems`)."""
    length = items.item_len
    if isinstance(max_len, (int, np.integer)):
        max_len = max(int(max_len), 1)
        if length.size == 0 or int(length.max()) <= max_len:
            return items
    else:
        max_len = np.maximum(np.asarray(max_len, dtype=np.int64), 1)
        if not (length > max_len).any():
            return items
    # ceil(a / b) as (a - 1) // b + 1 of a >= 1: an empty item counts as one token (one chunk of
    # length 1 either way), so every chunk count is at least 1 and every rounded length at least
    # ``align`` without clamping them
    whole = np.maximum(length, 1)
    less = whole - 1
    chunks = less // max_len + 1
    # each chunk's share rounded up to ``align`` (for a power of two by a mask, cheaper than //),
    # at most the item
    share = less // chunks + align
    chunk_len = np.minimum(share & -align if align & (align - 1) == 0 else share // align * align, whole)
    chunks = less // chunk_len + 1
    return _SplitItems(items, chunks, chunk_len)


class _SplitItems(DeferredItems):
    """:func:`split_long_items`'s result: ``chunks[i]`` chunks of ``chunk_len[i]`` tokens for item
    ``i`` of ``source`` (the last one shorter)."""

    def __init__(self, source: WorkItems, chunks: np.ndarray, chunk_len: np.ndarray):
        base = _indptr(chunks)
        # an item's chunks are all chunk_len long but its last, which holds the rest
        length = chunk_len.repeat(chunks)
        length[base[1:] - 1] = source.item_len - (chunks - 1) * chunk_len
        masked = mask_lead = None
        self.__dict__.update(source=source, chunks=chunks, chunk_len=chunk_len, chunk_base=base)
        if source.mask_lead is not None and source.masked is not None:
            # a chunk's lead is the part of its item's lead that falls in it (np.clip costs
            # several times more than its two ufuncs)
            start = (np.arange(length.size) - base[:-1].repeat(chunks)) * chunk_len.repeat(chunks)
            item_lead = source.mask_lead.repeat(chunks)
            lead = np.minimum(np.maximum(item_lead - start, 0), length)
            masked = source.masked.repeat(chunks) & (lead < length)
            mask_lead = np.where(item_lead < 0, -1, lead)
        super().__init__(length, source.item_queries.repeat(chunks), self._split, masked=masked, mask_lead=mask_lead)

    @functools.cached_property
    def chunk_item(self) -> np.ndarray:
        """int64 [chunks]: the source item of each chunk."""
        return np.arange(self.chunks.size).repeat(self.chunks)

    def used_merge_rows(self, used: np.ndarray | None = None) -> int:
        rows = self.__dict__.get("_used_merge_rows")
        if rows is None:
            if used is None:
                used = (self.item_len > 0) & (self.item_queries > 0)
            # a chunk has tokens iff its item has, and the item's queries: an item's chunks are
            # all used or none, as its first one, and each used item weighs its chunks
            weights = self.source.query_weights(self.chunks if used.all() else
                                                self.chunks * used[self.chunk_base[:-1]])
            rows = self.__dict__["_used_merge_rows"] = int(weights.max()) if weights.size else 0
        return rows

    def merge_rows_max(self, used: np.ndarray) -> int:
        # each query of a source item is in that item's used chunks: no need to make the chunks'
        # query lists
        rows = self.query_weights(used)
        return int(rows.max()) if rows.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        src = self.source
        if per_item.dtype == bool and per_item.all():  # every chunk counted: its item's chunks
            return src.query_weights(self.chunks)
        return src.query_weights(np.bincount(self.chunk_item, per_item, minlength=src.num_items))

    def _split(self) -> WorkItems:
        items, chunk_len, chunk_item, new_item_base = self.source, self.chunk_len, self.chunk_item, self.chunk_base
        n = items.num_items
        num_new = int(new_item_base[-1])
        # every non-empty segment is cut at the chunk boundaries it crosses (item-local positions)
        seg_len = items.seg_hi - items.seg_lo
        seg_item = np.arange(n).repeat(items.seg_indptr[1:] - items.seg_indptr[:-1])
        csum = _indptr(seg_len)
        seg_start = csum[:-1] - csum[items.seg_indptr[:-1]][seg_item]
        live = np.flatnonzero(seg_len > 0)
        cl = chunk_len[seg_item[live]]
        start0, len0 = seg_start[live], seg_len[live]
        c0 = start0 // cl
        pieces = (start0 + len0 - 1) // cl - c0 + 1
        piece_seg = live.repeat(pieces)
        piece_chunk = ranges(c0, c0 + pieces)
        piece_cl = cl.repeat(pieces)
        offset = seg_start[piece_seg]
        start = np.maximum(piece_chunk * piece_cl, offset)
        end = np.minimum(piece_chunk * piece_cl + piece_cl, offset + seg_len[piece_seg])
        piece_lo = items.seg_lo[piece_seg] + (start - offset)
        piece_new_item = new_item_base[seg_item[piece_seg]] + piece_chunk
        q_cnt = self.item_queries
        q_new = items.q_indices[ranges(items.q_indptr[chunk_item], items.q_indptr[chunk_item + 1])]
        q_tokens = None
        if items.q_tokens is not None and np.array_equal(items.q_tokens,
                                                         items.item_len.repeat(items.item_queries)):
            q_tokens = self.item_len.repeat(q_cnt)  # queries that saw their items whole see every chunk whole
        # pieces go item by item, chunk by chunk, and the chunks' queries keep their item's order:
        # already grouped by new item
        return WorkItems(_indptr(np.bincount(piece_new_item, minlength=num_new)), items.seg_node[piece_seg],
                         piece_lo, piece_lo + (end - start), _indptr(q_cnt), q_new, q_tokens)


def spread_items(items: WorkItems, heads, cost, *, tile_rows: int = 64) -> tuple[WorkItems, str]:
    """``items`` split for parallelism at :func:`spread_length`, and its note."""
    max_len, note = spread_length(items, heads, cost, tile_rows=tile_rows)
    return (items if max_len is None else split_long_items(items, max_len)), note


def spread_length(items: WorkItems, heads, cost, *, tile_rows: int = 64) -> tuple[int | None, str]:
    """The length at which to split ``items`` for parallelism (None: none) and a note saying why:
    :func:`fill_length` when their programs cannot fill the GPU, else the items whose programs are
    longer than a fair share of the work (:func:`fair_share_length`)."""
    max_len, note = fill_length(items, heads, cost, tile_rows=tile_rows)
    if max_len is not None or note is None:
        return max_len, note or ""
    max_len = fair_share_length(items, group=heads.group, num_kv_heads=heads.num_kv_heads,
                                tile_rows=BLOCK_M_CHOICES[-1], slots=cost.balance_slots, min_len=cost.min_split_tokens)
    return max_len, "" if max_len is None else f"; long contexts split at {max_len} tokens (fair share of the work)"


def fill_length(items: WorkItems, heads, cost, *, tile_rows: int = 64) -> tuple[int | None, str | None]:
    """When the items' programs (query tiles of ``tile_rows`` rows, per KV head) cannot fill the
    GPU (``cost.target_programs``): the length that splits them evenly into about that many, and
    a note; else ``(None, "")``; ``(None, None)`` without items."""
    item_len, nq = items.item_len, items.item_queries
    q_tile = max(1, tile_rows // heads.group)
    # (sums over the items with tokens and queries: an item without either adds no tiles or no
    # tokens, so none are used iff there are no tiles)
    programs = int(((nq + (q_tile - 1)) // q_tile) @ (item_len > 0)) * heads.num_kv_heads
    if not programs:
        return None, None
    if programs >= cost.target_programs:
        return None, ""
    per_head = max(1, cost.target_programs // heads.num_kv_heads)
    max_len = max(cost.min_split_tokens, -(-int(item_len @ (nq > 0)) // per_head))
    return max_len, f"; long contexts split at {max_len} tokens ({programs} programs < {cost.target_programs})"


def fair_share_length(items: WorkItems, *, group: int, num_kv_heads: int, tile_rows: int, slots: int,
                      min_len: int) -> int | None:
    """The length at which to split the items whose programs are longer than a fair share of the
    work (PAT's long-KV split, by work rather than by token count); None when no item is longer.

    A program is one query tile (``tile_rows`` rows of queries x GQA ``group``) of an item for one
    KV head, and walks the item's tokens. When few programs hold most of the work (many queries
    verifying a token tree over one long context: a handful of tall tiles, thousands of tiny
    ones) they run on a few SMs while the rest idle, whatever the program count. The fair share
    is the total work (tokens walked by all programs) over ``slots`` concurrent programs; items
    longer than it (and than ``min_len``) are to be split into chunks of about that length.
    """
    length, nq = items.item_len, items.item_queries
    # (over the items with tokens and queries: an item without either walks no tokens, so none are
    # used iff there is no work)
    work = int(((nq * group + (tile_rows - 1)) // tile_rows) @ length)
    if not work:
        return None
    share = -(-work * num_kv_heads // max(1, slots))
    max_len = max(share, min_len)
    return None if int((length * (nq > 0)).max()) <= max_len else max_len
