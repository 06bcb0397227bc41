"""The exact forward index: every item's (feature, value) tokens as CSR tensors.

    token_ids int32 [nnz]    global token id = feature_base[f] + index of the value in vocab[f]
    offsets   int64 [N + 1]  item r's tokens are token_ids[offsets[r]:offsets[r + 1]]
    token_rows int32 [nnz]   the item row of each token (derived; makes term evaluation one isin)

It answers a filter exactly (`evaluate`), which the tests use as ground truth for the Bloom
filter (false negatives, false-positive rate) and the benchmark as the "forward index" baseline.
It is also what the publisher builds the Bloom signatures and exact value-code planes from.
Semantics match the filter language: a multi-valued feature matches `f = v` when any value is v;
values not in the vocabulary match nothing.

Example:
    >>> fwd = ForwardIndex.from_lists({"genre": [["Drama"], ["Comedy", "Drama"], []]})
    >>> fwd.evaluate("genre = Comedy OR NOT genre = Drama")
    tensor([False,  True,  True])
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

from torch import nn

from silverrec.errors import QueryError
from silverrec.filtering.filter_lang import And, Node, Not, Term, parse


class ForwardIndex(nn.Module):
    """Exact per-item feature values (see module docstring). Row order is the caller's."""

    def __init__(self, features: Sequence[str], vocabs: Sequence[Sequence[str]], token_ids: torch.Tensor, offsets: torch.Tensor):
        super().__init__()
        self.features = list(features)
        self.vocabs = [list(v) for v in vocabs]
        self.value_index = [{v: i for i, v in enumerate(vocab)} for vocab in self.vocabs]
        sizes = [len(v) for v in self.vocabs]
        self.feature_base = [0] + list(np.cumsum(sizes)[:-1].tolist()) if sizes else []
        self.register_buffer("token_ids", token_ids.to(torch.int32).contiguous())
        self.register_buffer("offsets", offsets.to(torch.int64).contiguous())
        counts = self.offsets[1:] - self.offsets[:-1]
        self.register_buffer("token_rows", torch.repeat_interleave(torch.arange(self.size, dtype=torch.int32), counts))

    # --------------------------------------------------------------------------- construction

    @classmethod
    def from_lists(cls, features: dict[str, list[list[str]]]) -> "ForwardIndex":
        """From per-item value lists (Pool.features); vocabularies are the sorted distinct values."""
        names = sorted(features)
        n = len(features[names[0]]) if names else 0
        vocabs = [sorted({v for vals in features[f] for v in vals}) for f in names]
        index = [{v: i for i, v in enumerate(voc)} for voc in vocabs]
        base = np.cumsum([0] + [len(v) for v in vocabs])
        per_item: list[list[int]] = [[] for _ in range(n)]
        for fi, f in enumerate(names):
            for r, vals in enumerate(features[f]):
                per_item[r].extend(int(base[fi]) + index[fi][v] for v in dict.fromkeys(vals))
        counts = np.fromiter((len(t) for t in per_item), dtype=np.int64, count=n)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        tokens = np.fromiter((t for ts in per_item for t in ts), dtype=np.int32, count=int(offsets[-1]))
        return cls(names, vocabs, torch.from_numpy(tokens), torch.from_numpy(offsets))

    @classmethod
    def from_codes(cls, features: dict[str, tuple[Sequence[str], np.ndarray]]) -> "ForwardIndex":
        """From single-valued integer-coded features: name -> (vocab, value index int [N], -1 = none).

        Memory-lean path for large synthetic pools (no per-item Python lists).
        """
        names = sorted(features)
        vocabs = [list(features[f][0]) for f in names]
        codes = np.stack([np.asarray(features[f][1], dtype=np.int64) for f in names], axis=1)  # [N, F]
        base = np.cumsum([0] + [len(v) for v in vocabs])[:-1]
        present = codes >= 0
        tokens = (codes + base[None, :])[present].astype(np.int32)  # row-major: items in order
        offsets = np.concatenate([[0], np.cumsum(present.sum(axis=1))])
        return cls(names, vocabs, torch.from_numpy(tokens), torch.from_numpy(offsets))

    def permute(self, order: torch.Tensor) -> "ForwardIndex":
        """A new index whose row i is this index's row order[i] (e.g. cluster-major order)."""
        order = order.to(torch.int64)
        counts = (self.offsets[1:] - self.offsets[:-1])[order]
        new_off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        # source position of every new token: old start of its row + rank within the row
        starts = torch.repeat_interleave(self.offsets[:-1][order], counts)
        rank = torch.arange(int(new_off[-1])) - torch.repeat_interleave(new_off[:-1], counts)
        return ForwardIndex(self.features, self.vocabs, self.token_ids[starts + rank], new_off)

    # ------------------------------------------------------------------------------ queries

    @property
    def size(self) -> int:
        return int(self.offsets.numel() - 1)

    def token_counts(self) -> torch.Tensor:
        """int64 [N] tokens per item (the load on its Bloom signature)."""
        return self.offsets[1:] - self.offsets[:-1]

    def feature_codes(self, feature: str) -> tuple[torch.Tensor, int]:
        """Dense value codes of one feature: (int64 [N, slots] with code = value index + 1, 0 = empty; slots)."""
        fi = self.features.index(feature)
        lo, hi = self.feature_base[fi], self.feature_base[fi] + len(self.vocabs[fi])
        sel = ((self.token_ids >= lo) & (self.token_ids < hi)).nonzero().reshape(-1)
        rows = self.token_rows[sel].to(torch.int64)
        first = torch.searchsorted(rows, rows, right=False)
        slot = torch.arange(rows.numel()) - first
        slots = int(slot.max()) + 1 if slot.numel() else 1
        codes = torch.zeros(self.size, slots, dtype=torch.int64)
        codes[rows, slot] = self.token_ids[sel].to(torch.int64) - lo + 1
        return codes, slots

    def term_mask(self, feature: str, values: Sequence[str]) -> torch.Tensor:
        """bool [N]: items having any of `values` for `feature` (unknown values match nothing)."""
        if feature not in self.features:
            raise QueryError(f"unknown feature {feature!r}; known: {self.features}")
        fi = self.features.index(feature)
        ids = [self.feature_base[fi] + self.value_index[fi][v] for v in values if v in self.value_index[fi]]
        mask = torch.zeros(self.size, dtype=torch.bool)
        if ids:
            if len(ids) <= 8:  # a few equality scans beat isin's sort
                hit = self.token_ids == ids[0]
                for t in ids[1:]:
                    hit |= self.token_ids == t
            else:
                hit = torch.isin(self.token_ids, torch.tensor(ids, dtype=torch.int32))
            mask[self.token_rows[hit].to(torch.int64)] = True
        return mask

    def evaluate(self, filt: Union[str, Node, None]) -> torch.Tensor:
        """bool [N]: the exact answer of one filter (None = all items)."""
        if filt is None:
            return torch.ones(self.size, dtype=torch.bool)
        return self._eval(parse(filt) if isinstance(filt, str) else filt)

    def _eval(self, node: Node) -> torch.Tensor:
        if isinstance(node, Term):
            return self.term_mask(node.feature, node.values)
        if isinstance(node, Not):
            return ~self._eval(node.child)
        masks = [self._eval(c) for c in node.children]
        out = masks[0].clone()
        for m in masks[1:]:
            out = out & m if isinstance(node, And) else out | m
        return out

    def evaluate_batch(self, filters: Sequence[Optional[Union[str, Node]]]) -> torch.Tensor:
        """bool [B, N]: exact answers of a batch of filters."""
        return torch.stack([self.evaluate(f) for f in filters])


__all__ = ["ForwardIndex"]
