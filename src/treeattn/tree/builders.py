"""Workload constructors: turn benchmark descriptions into :class:`~treeattn.tree.decoding_tree.DecodingTree`.

* :func:`tree_from_spec` -- the FastTree / PAT kernel-suite strings (``shared/workloads/kernel_suite.json``).
* :func:`tree_from_block_tables` -- PAT-style paged requests (block tables + lengths) as a radix tree.
* :func:`tree_from_tot_template` -- DeFT Tree-of-Thoughts templates (``deft/reasoning``).
* :func:`tree_from_medusa` -- DeFT/Medusa speculative token trees (``deft/speculative``).
"""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np

from treeattn.tree.topology import ranges
from treeattn.tree.decoding_tree import DecodingTree

__all__ = [
    "find_shared", "load_kernel_suite", "suite_trees", "tree_from_spec", "tree_from_block_tables",
    "tree_from_tot_template", "tree_from_medusa", "medusa_records",
]

_TOT_FILES = {"sorting": "sorting128ToT.json", "docmerge": "docmergeToT.json",
              "keyword": "keywordToT.json", "set": "set128ToT.json"}


def _scaled(lengths, scale: float) -> np.ndarray:
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return np.maximum(1, np.rint(np.asarray(lengths, dtype=np.float64) * scale)).astype(np.int64)


def find_shared() -> Path:
    """Locate the repository's ``shared`` folder.

    Returns ``$TREEATTN_SHARED`` when set; otherwise walks up from the current directory and from
    this file, returning the first ``<dir>/shared`` that holds a ``workloads`` folder.

    Raises
    ------
    FileNotFoundError
        If no such folder exists.
    """
    env = os.environ.get("TREEATTN_SHARED")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"TREEATTN_SHARED={env!r} is not a directory")
        return path
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            if (d / "shared" / "workloads").is_dir():
                return d / "shared"
    raise FileNotFoundError("could not find a 'shared/workloads' folder above the current directory "
                            "or the treeattn package; set TREEATTN_SHARED to the shared folder")


def load_kernel_suite(path=None) -> dict:
    """Parsed ``kernel_suite.json`` (default: ``find_shared() / 'workloads/kernel_suite.json'``)."""
    path = Path(path) if path is not None else find_shared() / "workloads" / "kernel_suite.json"
    with open(path) as f:
        return json.load(f)


def suite_trees(suite: str, path=None) -> list[str]:
    """Spec strings of ``suite`` (``'fasttree'``, ``'pat'`` or ``'all'``: both, duplicates dropped)."""
    suites = load_kernel_suite(path)["suites"]
    if suite == "all":
        return list(dict.fromkeys(s for name in ("fasttree", "pat") for s in suites[name]))
    if suite not in suites:
        raise ValueError(f"unknown suite {suite!r}; expected one of {sorted(suites)} or 'all'")
    return list(suites[suite])


def tree_from_spec(spec: str, *, scale: float = 1.0) -> DecodingTree:
    """Tree of a kernel-suite spec ``'sizes_lengths'`` such as ``'1,4,256_8,256,32'``.

    Level ``k`` has ``sizes[k]`` nodes of ``lengths[k]`` tokens; its node ``j`` hangs under node
    ``j * sizes[k-1] // sizes[k]`` of level ``k - 1``. Nodes are numbered level by level; there is
    one query per last-level node, seeing the whole node. Several first-level nodes make a forest.

    Parameters
    ----------
    spec : str
        The spec string.
    scale : float
        Multiplies every length (rounded, at least 1).

    Raises
    ------
    ValueError
        For a malformed spec.
    """
    parts = str(spec).strip().split("_")
    if len(parts) != 2:
        raise ValueError(f"malformed tree spec {spec!r}: expected 'sizes_lengths' with one '_'")
    try:
        sizes, lens = ([int(x) for x in p.split(",")] for p in parts)
    except ValueError:
        raise ValueError(f"malformed tree spec {spec!r}: levels must be comma-separated integers") from None
    if len(sizes) != len(lens):
        raise ValueError(f"malformed tree spec {spec!r}: {len(sizes)} level sizes but {len(lens)} lengths")
    if min(sizes) < 1 or min(lens) < 1:
        raise ValueError(f"malformed tree spec {spec!r}: node counts and lengths must be >= 1")
    sizes_a = np.asarray(sizes, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes_a)))
    parents = [np.full(sizes[0], -1, dtype=np.int64)]
    for k in range(1, len(sizes)):
        parents.append(offsets[k - 1] + np.arange(sizes[k], dtype=np.int64) * sizes[k - 1] // sizes[k])
    lengths = np.repeat(_scaled(lens, scale), sizes_a)
    return DecodingTree.from_parents(np.concatenate(parents), lengths,
                                     query_nodes=np.arange(offsets[-2], offsets[-1]))


def _merge_chains(parent: np.ndarray, depth: np.ndarray, stop: np.ndarray):
    """Merge each unit into its parent's chain when the parent has one child and is not ``stop``.

    Returns ``head`` (bool: the unit starts a merged node) and ``group`` (each unit's chain head).
    """
    has = parent >= 0
    nchild = np.bincount(parent[has], minlength=parent.size)
    head = ~has
    head[has] = (nchild[parent[has]] != 1) | stop[parent[has]]
    group = np.arange(parent.size)
    by_depth = np.argsort(depth, kind="stable")
    for ids in np.split(by_depth, np.cumsum(np.bincount(depth))[:-1])[1:]:  # parents first
        inner = ids[~head[ids]]
        group[inner] = group[parent[inner]]
    return head, group


def tree_from_block_tables(block_tables, seq_lens, *, page_size: int,
                           num_pages: int | None = None) -> DecodingTree:
    """Radix tree of paged requests (PAT-style prefix sharing).

    Request ``r`` holds ``seq_lens[r]`` tokens in pages ``block_tables[r][:ceil(seq_lens[r] / page_size)]``
    (extra entries are ignored). Requests share trie nodes while their pages agree; a request's last
    page is keyed by (page, fill) so a partially filled page is shared only with identical fill.
    Single-child chains where no request ends are merged into one node. Each node's ``kv_indices``
    are its tokens' slots ``page * page_size + offset``; there is one query per request (in order),
    at the node where it ends, seeing the whole node.

    Parameters
    ----------
    block_tables : list of lists of int, or 2-D int array
        Physical page ids of each request.
    seq_lens : sequence of int
        Tokens of each request.
    page_size : int
        Tokens per page.
    num_pages : int, optional
        Pages in the pool; page ids are range-checked and ``num_slots`` is set when given.

    Raises
    ------
    ValueError
        For a non-positive length, a too-short block table or an out-of-range page id.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seq_lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    nreq = seq_lens.size
    if nreq == 0 or len(block_tables) != nreq:
        raise ValueError(f"need one block table per request: {len(block_tables)} tables, {nreq} lengths")
    bad = np.flatnonzero(seq_lens <= 0)
    if bad.size:
        raise ValueError(f"request {int(bad[0])} has length {int(seq_lens[bad[0]])}; lengths must be >= 1")
    npages = -(-seq_lens // page_size)
    tables = [np.asarray(b, dtype=np.int64).reshape(-1) for b in block_tables]
    widths = np.array([t.size for t in tables], dtype=np.int64)
    short = np.flatnonzero(widths < npages)
    if short.size:
        r = int(short[0])
        raise ValueError(f"request {r}: block table has {int(widths[r])} pages but length "
                         f"{int(seq_lens[r])} needs {int(npages[r])} pages of {page_size}")
    page = np.concatenate([t[:k] for t, k in zip(tables, npages)])
    pos = ranges(np.zeros(nreq), npages)                      # page position within its request
    oob = np.flatnonzero((page < 0) | (page >= (num_pages if num_pages is not None else 1 << 62)))
    if oob.size:
        i, req = int(oob[0]), np.repeat(np.arange(nreq), npages)
        raise ValueError(f"request {int(req[i])}: page {int(page[i])} (block-table entry {int(pos[i])}) "
                         f"is out of range [0, {num_pages if num_pages is not None else 'inf'})")
    last = np.cumsum(npages) - 1
    fill = np.full(page.size, page_size, dtype=np.int64)
    fill[last] = seq_lens - (npages - 1) * page_size
    # trie of (parent, page, fill) keys, one numpy step per page depth
    tnode = np.empty(page.size, dtype=np.int64)
    t_parent, t_page, t_fill, t_depth = [], [], [], []
    by_pos = np.argsort(pos, kind="stable")
    for d, at in enumerate(np.split(by_pos, np.cumsum(np.bincount(pos))[:-1])):
        prev = tnode[at - 1] if d else np.full(at.size, -1, dtype=np.int64)
        keys, inv = np.unique(np.stack([prev, page[at], fill[at]], axis=1), axis=0, return_inverse=True)
        tnode[at] = sum(x.size for x in t_parent) + inv.reshape(-1)
        t_parent.append(keys[:, 0]); t_page.append(keys[:, 1]); t_fill.append(keys[:, 2])
        t_depth.append(np.full(keys.shape[0], d))
    t_parent, t_page, t_fill, t_depth = (np.concatenate(x) for x in (t_parent, t_page, t_fill, t_depth))
    t_end = tnode[last]
    head, group = _merge_chains(t_parent, t_depth, np.bincount(t_end, minlength=t_parent.size) > 0)
    node_of = (np.cumsum(head) - 1)[group]
    heads = np.flatnonzero(head)
    parents = np.where(t_parent[heads] >= 0, node_of[np.maximum(t_parent[heads], 0)], -1)
    order = np.argsort(node_of, kind="stable")                 # by node, then depth
    lengths = np.bincount(node_of, weights=t_fill, minlength=heads.size).astype(np.int64)
    kv = ranges(t_page[order] * page_size, t_page[order] * page_size + t_fill[order])
    return DecodingTree.from_parents(
        parents, lengths, kv_indices=kv, query_nodes=node_of[t_end], page_size=page_size,
        num_slots=None if num_pages is None else int(num_pages) * page_size)


def _resolve(path_or_name, folder: str, aliases: dict) -> Path:
    """A workload file: an existing path, else a (file) name in ``shared/workloads/deft/<folder>``."""
    key = str(path_or_name)
    if Path(key).is_file():
        return Path(key)
    name = aliases.get(key, key if key.endswith(".json") else f"{key}.json")
    path = find_shared() / "workloads" / "deft" / folder / Path(name).name
    if not path.exists():
        raise FileNotFoundError(f"no workload {path_or_name!r}: {path} does not exist")
    return path


def tree_from_tot_template(path_or_name, index: int = 0, *, scale: float = 1.0) -> DecodingTree:
    """Tree of entry ``index`` of a DeFT Tree-of-Thoughts template file.

    Parameters
    ----------
    path_or_name : str or Path
        A template file, or one of ``'sorting'``, ``'docmerge'``, ``'keyword'``, ``'set'``.
    index : int
        Entry of the file's list.
    scale : float
        Multiplies every node's token count ``value`` (rounded, at least 1; empty thoughts get 1 token).

    The tree's nodes are the template's in increasing id order (the prompt first), one query per leaf.

    Raises
    ------
    ValueError
        For a malformed template (missing keys, unknown children, two parents, cycles, no nodes).
    """
    path = _resolve(path_or_name, "reasoning", _TOT_FILES)
    with open(path) as f:
        entries = json.load(f)
    if not isinstance(entries, list) or not -len(entries) <= index < len(entries):
        raise ValueError(f"{path.name}: no entry {index} (the file holds "
                         f"{len(entries) if isinstance(entries, list) else 'no list of'} entries)")
    return _tot_tree(entries[index], f"{path.name}[{index}]", scale)


def _tot_tree(entry, where: str, scale: float) -> DecodingTree:
    if not isinstance(entry, dict) or not isinstance(entry.get("data"), dict):
        raise ValueError(f"malformed template {where}: missing 'data' dict of nodes")
    nodes = list(entry["data"].values())
    if not nodes:
        raise ValueError(f"malformed template {where}: it has no nodes")
    for nd in nodes:
        missing = [k for k in ("id", "value", "children") if not isinstance(nd, dict) or k not in nd]
        if missing:
            raise ValueError(f"malformed template {where}: node {nd!r:.60} lacks {missing}")
    ids = np.array([int(nd["id"]) for nd in nodes], dtype=np.int64)
    if np.unique(ids).size != ids.size:
        raise ValueError(f"malformed template {where}: duplicate node ids")
    order = np.argsort(ids)
    sorted_ids = ids[order]
    values = np.array([int(nd["value"]) for nd in nodes], dtype=np.int64)[order]
    src = np.repeat(ids, [len(nd["children"]) for nd in nodes])
    dst = np.array([int(c) for nd in nodes for c in nd["children"]], dtype=np.int64)
    pos = np.searchsorted(sorted_ids, dst)
    unknown = (pos >= ids.size) | (sorted_ids[np.minimum(pos, ids.size - 1)] != dst)
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise ValueError(f"malformed template {where}: node {int(src[i])} has child {int(dst[i])}, "
                         f"which is not a node")
    counts = np.bincount(pos, minlength=ids.size)
    if counts.max(initial=0) > 1:
        raise ValueError(f"malformed template {where}: node {int(sorted_ids[np.argmax(counts)])} "
                         f"has two parents")
    parents = np.full(ids.size, -1, dtype=np.int64)
    parents[pos] = np.searchsorted(sorted_ids, src)
    reach = parents < 0
    frontier = reach.copy()
    while frontier.any():
        frontier = ~reach & frontier[np.maximum(parents, 0)] & (parents >= 0)
        reach |= frontier
    if not reach.all():
        raise ValueError(f"malformed template {where}: node {int(sorted_ids[np.argmin(reach)])} "
                         f"is on or below a cycle")
    return DecodingTree.from_parents(parents, _scaled(values, scale))


def _load_medusa(path_or_size) -> dict:
    key = str(path_or_size)
    path = _resolve(path_or_size, "speculative", {key: f"tree_size{key}.json"} if key.isdigit() else {})
    with open(path) as f:
        data = json.load(f)
    for k in ("Tree_Structure", "Records"):
        if k not in data:
            raise ValueError(f"malformed Medusa file {path.name}: missing key {k!r}")
        if isinstance(data[k], str):
            data[k] = ast.literal_eval(data[k])
    return data


def medusa_records(path_or_size) -> list[dict]:
    """The ``Records`` (prompt, ``Accept_length`` per step, ...) of a Medusa tree file."""
    return list(_load_medusa(path_or_size)["Records"])


def tree_from_medusa(path_or_size, *, context_len: int, compress: bool = True) -> DecodingTree:
    """Tree of a Medusa speculative token tree over a context.

    Node 0 is the context (``context_len`` tokens, slots ``0..context_len-1``) with a query at prefix
    ``context_len``. Path ``p`` of ``Tree_Structure`` (``i``-th, slot ``context_len + i``) is a draft
    token under path ``p[:-1]`` (the context when ``len(p) == 1``) with a query seeing its ancestors
    and itself. Queries: the context's, then the draft tokens in ``Tree_Structure`` order.

    Parameters
    ----------
    path_or_size : str, Path or int
        A file, a size such as ``32`` (``tree_size32.json``) or a name such as ``'APPS_tree_size32'``.
    context_len : int
        Tokens of the context (its last token is the tree's root token).
    compress : bool
        False: one node per draft token. True: chains of draft tokens with exactly one child are
        merged into one node and their queries sit inside it at prefixes ``1..len``.

    Raises
    ------
    ValueError
        For a malformed structure (empty or duplicate paths, a path whose parent is missing).
    """
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    paths = [tuple(int(c) for c in p) for p in _load_medusa(path_or_size)["Tree_Structure"]]
    index = {p: i for i, p in enumerate(paths)}
    if len(index) != len(paths) or () in index:
        raise ValueError("malformed Medusa tree: empty or duplicate paths")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
    if missing:
        raise ValueError(f"malformed Medusa tree: path {list(missing[0])} has no parent path "
                         f"{list(missing[0][:-1])}")
    m = len(paths)
    tok_parent = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=np.int64)
    depth = np.array([len(p) for p in paths], dtype=np.int64)
    head, group = (_merge_chains(tok_parent, depth, np.zeros(m, dtype=bool)) if compress
                   else (np.ones(m, dtype=bool), np.arange(m)))
    node_of = (np.cumsum(head) - 1)[group] + 1                 # node 0 is the context
    heads = np.flatnonzero(head)
    parents = np.concatenate(([-1], np.where(tok_parent[heads] >= 0,
                                             node_of[np.maximum(tok_parent[heads], 0)], 0)))
    lengths = np.concatenate(([context_len], np.bincount(node_of - 1, minlength=heads.size)))
    order = np.lexsort((depth, node_of))
    kv = np.concatenate((np.arange(context_len), context_len + order))
    prefix = depth - depth[group] + 1
    return DecodingTree.from_parents(
        parents, lengths, kv_indices=kv, query_nodes=np.concatenate(([0], node_of)),
        query_prefix=np.concatenate(([context_len], prefix)))
