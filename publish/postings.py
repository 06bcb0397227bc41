"""Posting lists of the selective (feature, value) tokens (publish side).

    post_rows    int32 [E]      the index rows holding each kept token, ascending, list after list
    post_offsets int64 [V + 1]  list l = post_rows[post_offsets[l]:post_offsets[l + 1]]

A token gets a list when at most `limit` items hold it. Those are the tokens a very selective filter
is built from ("topic = t7 AND country IN (...)"): the filtered search then evaluates the filter
only on the rows of the filter's cheapest posting-list superset and scores the survivors exactly,
at a cost proportional to the list, not to N or to the probed clusters. Frequent tokens get no
list (their filters are served by the probed or whole-pool paths), which bounds the memory by
4 bytes x (item, selective token) pairs.

The manifest records, per feature and value, the list id (-1 = none) and the item count, which
`silverrec.filtering.filter_program.compile_lists` uses to choose each filter's lists.
"""

from __future__ import annotations

import numpy as np
import torch

from silverrec.filtering.forward_index import ForwardIndex

DEFAULT_LIMIT_DIVISOR = 32  # lists for tokens held by <= N / 32 items (and at least 256)


def default_limit(n: int) -> int:
    """Longest posting list kept for a pool of n items: max(256, n // 32)."""
    return max(256, n // DEFAULT_LIMIT_DIVISOR)


def build_postings(fwd: ForwardIndex, limit: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, dict[str, list[int]]]]:
    """(post_rows int32 [E], post_offsets int64 [V + 1], per feature {"postings": list id per value,
    "counts": items per value}) for `fwd` in the index's row order."""
    tokens = fwd.token_ids.numpy().astype(np.int64)
    rows = fwd.token_rows.numpy()
    total = sum(len(v) for v in fwd.vocabs)
    counts = np.bincount(tokens, minlength=total)
    keep = counts <= limit
    order = np.argsort(tokens, kind="stable")  # rows stay ascending within a token
    post_rows = rows[order][keep[tokens[order]]].astype(np.int32)
    list_id = np.full(total, -1, dtype=np.int64)
    list_id[keep] = np.arange(int(keep.sum()))
    post_offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
    meta = {}
    for f, base, vocab in zip(fwd.features, fwd.feature_base, fwd.vocabs):
        sl = slice(base, base + len(vocab))
        meta[f] = {"postings": list_id[sl].tolist(), "counts": counts[sl].tolist()}
    return torch.from_numpy(post_rows), torch.from_numpy(post_offsets), meta
