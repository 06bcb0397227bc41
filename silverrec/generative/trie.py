"""`ValidPathTrie`: the set of real items' semantic-ID paths as tensors, for constrained decoding.

Built from paths int64 [N, L] (codes, level l in [0, level_sizes[l]), unique per item). Rows are
the paths sorted lexicographically ("trie leaf order"): `row_order[r]` is the input index of the
item at row r, so a snapshot's `row_to_item = item_ids[trie.row_order]`, and a per-request item
bitmask uses the same rows (bit r & 63 of word r >> 6 is row r, the Bloom packed format).

Nodes are numbered breadth-first: the root is 0, then the depth-1 nodes (unique first codes), the
depth-2 nodes (unique 2-prefixes), ..., the leaves (depth L, one per row: leaf id = leaf_base + row).
Because paths are sorted, the children of every node are contiguous and sorted by code, which
gives one global CSR:

    offsets      int64 [n_internal + 1]   children of node i are CSR positions offsets[i]:offsets[i+1]
    child_codes  int64 [n_nodes - 1]      code of the child at CSR position p; its node id is p + 1
    first_child  int64 [level_sizes[0]]   dense first level: depth-1 node of each first code, -1 = none
    first_mask   bool  [level_sizes[0]]   first_child >= 0

In-model (no Python loop over beams): `child_table(nodes, depth)` turns node ids [M] at `depth` into a
dense child table [M, level_sizes[depth]] (-1 = invalid code) by scattering each node's CSR range;
`node_alive(item_bitmask)` marks, per request, the nodes with at least one passing item below
them (leaf bits, then segment sums up the CSR, level by level), so filtered items are pruned at
every level of the decode, not after it.

Example:
    >>> trie = ValidPathTrie(paths, level_sizes=[256, 256, 256, 4])
    >>> child = trie.child_table(torch.zeros(1, dtype=torch.int64), 0)   # [1, 256]: depth-1 ids or -1
"""


from typing import List

import torch

from silverrec.bitmask import unpack_bits
from torch import nn


class ValidPathTrie(nn.Module):
    """Valid semantic-ID paths as a breadth-first CSR trie (see module docstring).

    Args:
        paths: int64 [N, L] codes, unique rows, 0 <= paths[:, l] < level_sizes[l].
        level_sizes: codes per level, length L.
    Attributes:
        level_sizes, level_base (first node id of each depth 0..L), max_children (per depth < L),
        n_items, n_levels, leaf_base, n_prefixes (depth L-1 nodes): Python ints/lists (static per snapshot).
    Buffers:
        offsets, child_codes, first_child, first_mask (see module docstring); row_order int64 [N];
        leaf_paths int64 [N, L] (the sorted paths); leaf_prefix int64 [N] (each row's depth L-1
        node, as an index among those nodes) and prefix_codes int64 [n_prefixes, L - 1] (their codes):
        the prefixes the decode's last step extends (GenerativeRetrieval's candidate log-probs).
    """

    level_sizes: List[int]
    level_base: List[int]
    max_children: List[int]
    n_levels: int
    n_items: int
    leaf_base: int
    n_prefixes: int

    def __init__(self, paths: torch.Tensor, level_sizes: list[int]):
        super().__init__()
        paths = torch.as_tensor(paths)
        level_sizes = [int(s) for s in level_sizes]
        _check_paths(paths, level_sizes)
        N, L = paths.shape
        paths = paths.to(torch.int64).cpu()
        order = _lexsort_rows(paths, level_sizes)
        sorted_paths = paths[order]
        if N > 1:
            dup = (sorted_paths[1:] == sorted_paths[:-1]).all(dim=1)
            if bool(dup.any()):
                r = int(dup.nonzero()[0, 0])
                i, j = int(order[r]), int(order[r + 1])
                raise ValueError(f"items {i} and {j} share the semantic-ID path {sorted_paths[r].tolist()}")

        # node_of_row[d][r]: depth-d node (local index) containing row r; depth 0 = root.
        node_of_row = [torch.zeros(N, dtype=torch.int64)]
        counts_per_depth = []  # children count of every node at depth d (d < L)
        codes_per_depth = []  # child codes of depth-(d+1) nodes, in node order
        n_nodes = [1]
        for d in range(1, L + 1):
            is_new = _new_prefix(sorted_paths, d)
            local = torch.cumsum(is_new.to(torch.int64), 0) - 1
            first = is_new.nonzero().squeeze(1)
            parent = node_of_row[d - 1][first]
            counts_per_depth.append(torch.bincount(parent, minlength=n_nodes[d - 1]))
            codes_per_depth.append(sorted_paths[first, d - 1])
            node_of_row.append(local)
            n_nodes.append(int(first.numel()))

        self.level_sizes = level_sizes
        self.n_levels = L
        self.n_items = N
        self.level_base = [sum(n_nodes[:d]) for d in range(L + 1)]
        self.leaf_base = self.level_base[L]
        self.max_children = [int(c.max()) for c in counts_per_depth]
        counts = torch.cat(counts_per_depth)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(counts, 0)
        first_child = torch.full((level_sizes[0],), -1, dtype=torch.int64)
        first_child[codes_per_depth[0]] = torch.arange(1, n_nodes[1] + 1, dtype=torch.int64)
        self.register_buffer("offsets", offsets)
        self.register_buffer("child_codes", torch.cat(codes_per_depth))
        self.register_buffer("first_child", first_child)
        self.register_buffer("first_mask", first_child >= 0)
        self.register_buffer("row_order", order)
        self.register_buffer("leaf_paths", sorted_paths)
        # the prefixes the last decode step extends (depth L-1 nodes): each row's, and each one's codes
        # (derived from the paths, so not saved: a checkpoint's state dict stays as it was)
        last = L - 1
        self.n_prefixes = n_nodes[last]
        self.register_buffer("leaf_prefix", node_of_row[last], persistent=False)
        first_rows = _new_prefix(sorted_paths, last).nonzero().squeeze(1)
        self.register_buffer("prefix_codes", sorted_paths[first_rows, :last].contiguous(), persistent=False)

    def child_table(self, nodes: torch.Tensor, depth: int) -> torch.Tensor:
        """Dense child table of nodes at `depth`.

        Args:
            nodes: int64 [M] node ids at `depth` (0 = root; any valid id of that depth).
            depth: static int in [0, L).
        Returns:
            int64 [M, level_sizes[depth]]: child node id for each code, -1 where the path is invalid.
        """
        M = nodes.shape[0]
        C = self.level_sizes[depth]
        if depth == 0:
            # a real [M, C] tensor, not an expand() view: reshaping a stride-0 view makes
            # torch.export guard M != 1 (the exported decode would then reject batch 1)
            return nodes[:, None] * 0 + self.first_child[None, :]
        start = self.offsets[nodes]
        end = self.offsets[nodes + 1]
        pos = start[:, None] + torch.arange(self.max_children[depth], dtype=torch.int64, device=nodes.device)[None, :]
        ok = pos < end[:, None]
        pos = torch.where(ok, pos, torch.zeros_like(pos))
        col = torch.where(ok, self.child_codes[pos], torch.full_like(pos, C))  # invalid -> spare column C
        dense = torch.full((M, C + 1), -1, dtype=torch.int64, device=nodes.device)
        dense = dense.scatter(1, col, torch.where(ok, pos + 1, torch.full_like(pos, -1)))
        return dense[:, :C]

    def node_alive(self, item_bitmask: torch.Tensor) -> torch.Tensor:
        """Per-request node masks: a node is alive iff some item below it passes the request's filter.

        Args:
            item_bitmask: int64 [B, ceil(N / 64)] packed rows (trie leaf order).
        Returns:
            bool [B, n_nodes] indexed by node id (root, depth 1, ..., leaves).
        """
        return self.alive_nodes(unpack_bits(item_bitmask, self.n_items))

    def alive_nodes(self, alive: torch.Tensor) -> torch.Tensor:
        """`node_alive` from unpacked leaves: alive bool [B, N] (trie leaf order) -> bool [B, n_nodes]."""
        B = alive.shape[0]
        parts = [alive]
        for d in range(self.n_levels - 1, -1, -1):
            lo, hi = self.level_base[d], self.level_base[d + 1]
            # children of depth-d nodes are CSR positions offsets[lo]:offsets[hi] = node ids +1
            # prefix counts [B, n + 1] by concatenation, not by writing into a slice: the slice
            # write makes torch.export guard batch != 1 (a memory-overlap check on the view)
            zero = torch.zeros(B, 1, dtype=torch.int32, device=alive.device)
            cs = torch.cat([zero, torch.cumsum(alive.to(torch.int32), dim=1)], dim=1)
            child_lo = self.offsets[lo : hi + 1] - self.offsets[lo]  # [n_d + 1] local child positions
            counts = cs[:, child_lo[1:]] - cs[:, child_lo[:-1]]
            alive = counts > 0
            parts.append(alive)
        parts.reverse()
        return torch.cat(parts, dim=1)

    @torch.jit.unused
    def enumerate_paths(self) -> torch.Tensor:
        """All root-to-leaf paths int64 [N, L] by walking `children` level by level (for tests)."""
        nodes = torch.zeros(1, dtype=torch.int64, device=self.offsets.device)
        prefixes = torch.zeros(1, 0, dtype=torch.int64, device=self.offsets.device)
        for d in range(self.n_levels):
            child = self.child_table(nodes, d)
            parent, code = (child >= 0).nonzero(as_tuple=True)
            prefixes = torch.cat([prefixes[parent], code[:, None]], dim=1)
            nodes = child[parent, code]
        return prefixes

    @torch.jit.unused
    def path_nodes(self) -> torch.Tensor:
        """Node ids int64 [N, L + 1] along every row's path (trie leaf order): column d is the row's
        depth-d node (column 0 the root, column L its leaf)."""
        N, L = self.leaf_paths.shape
        out = torch.zeros(N, L + 1, dtype=torch.int64, device=self.leaf_paths.device)
        for d in range(1, L + 1):
            out[:, d] = self.level_base[d] + torch.cumsum(_new_prefix(self.leaf_paths, d).to(torch.int64), 0) - 1
        return out

    @torch.jit.unused
    def child_tokens(self, level_offsets: List[int], vocab: int) -> torch.Tensor:
        """bool [n_internal, vocab]: row n marks the decoder tokens (level_offsets[depth] + code) of
        node n's children, the valid next tokens after the prefix n (n < leaf_base)."""
        counts = self.offsets[1:] - self.offsets[:-1]  # children per internal node
        parent = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        depth = torch.bucketize(parent, torch.tensor(self.level_base[1:], device=counts.device), right=True)
        token = torch.tensor(level_offsets, device=counts.device)[depth] + self.child_codes
        out = torch.zeros(counts.numel(), vocab, dtype=torch.bool, device=counts.device)
        out[parent, token] = True
        return out

    @torch.jit.unused
    def accepts(self, paths: torch.Tensor) -> torch.Tensor:
        """bool [M]: which of paths int64 [M, L] walk from the root to a leaf."""
        M = paths.shape[0]
        nodes = torch.zeros(M, dtype=torch.int64, device=paths.device)
        ok = torch.ones(M, dtype=torch.bool, device=paths.device)
        for d in range(self.n_levels):
            code = paths[:, d]
            inside = (code >= 0) & (code < self.level_sizes[d])
            child = self.child_table(nodes, d).gather(1, code.clamp(0, self.level_sizes[d] - 1)[:, None]).squeeze(1)
            ok = ok & inside & (child >= 0)
            nodes = torch.where(ok, child, torch.full_like(child, self.level_base[d + 1]))
        return ok


def _check_paths(paths: torch.Tensor, level_sizes: list[int]) -> None:
    if paths.dim() != 2 or paths.shape[0] == 0:
        raise ValueError(f"paths must be a non-empty int [N, L] tensor, got shape {tuple(paths.shape)}")
    if paths.dtype.is_floating_point or paths.dtype == torch.bool:
        raise ValueError(f"paths must be integer codes, got {paths.dtype}")
    if paths.shape[1] != len(level_sizes):
        raise ValueError(f"paths have {paths.shape[1]} levels but level_sizes has {len(level_sizes)}")
    for level, size in enumerate(level_sizes):
        if size <= 0:
            raise ValueError(f"level_sizes[{level}] must be positive, got {size}")
        col = paths[:, level]
        bad = (col < 0) | (col >= size)
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            raise ValueError(f"item {r} has code {int(col[r])} at level {level}, outside [0, {size})")


def _new_prefix(sorted_paths: torch.Tensor, d: int) -> torch.Tensor:
    """bool [N]: row r of lexicographically sorted paths [N, L] starts a new length-d prefix."""
    is_new = torch.ones(sorted_paths.shape[0], dtype=torch.bool, device=sorted_paths.device)
    if sorted_paths.shape[0] > 1:
        is_new[1:] = (sorted_paths[1:, :d] != sorted_paths[:-1, :d]).any(dim=1)
    return is_new


def _lexsort_rows(paths: torch.Tensor, level_sizes: list[int]) -> torch.Tensor:
    """Stable lexicographic order of the rows of paths [N, L] (last level sorted first)."""
    order = torch.arange(paths.shape[0], dtype=torch.int64)
    for level in range(len(level_sizes) - 1, -1, -1):
        idx = torch.sort(paths[order, level], stable=True).indices
        order = order[idx]
    return order
