"""Independent reference for generative retrieval, and tiny synthetic setups (tests, benchmarks).

`reference_beam_search` is deliberately plain: for every request and every step it recomputes the
whole sequence of every beam with `RecDecoder.forward` (full KV per beam, no cache), builds the
allowed codes from a Python dict of the pool's paths (not from the tensor trie), and selects with
one full stable sort over all Wi x C candidates after the per-beam top_k cut. Same semantics as
`GenerativeRetrieval` (see silverrec/generative/generative.py): scores are summed full-vocabulary
log-probs, ties go to the lower (beam, code), fewer than W items pad with id -1 / score -inf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from silverrec.generative.decoder import BOS, PAD, DecoderConfig, RecDecoder, level_offsets, paths_to_tokens, vocab_size


def _allowed_children(paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], set[int]]:
    children: dict[tuple[int, ...], set[int]] = {}
    for p in paths:
        for d in range(len(p)):
            children.setdefault(p[:d], set()).add(p[d])
    return children


@torch.no_grad()
def reference_beam_search(
    decoder: RecDecoder,
    history: torch.Tensor,
    paths: torch.Tensor,
    item_ids: torch.Tensor,
    level_sizes: list[int],
    beam_width: int,
    top_k: int,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Constrained beam search, the straightforward way.

    Args:
        decoder: the model; history: int64 [B, T] left-padded (decoder vocabulary).
        paths: int64 [N, L] codes of the pool (any order); item_ids: int64 [N] in the same order.
        allowed: optional bool [B, N] (same order as paths): items each request may return.
    Returns:
        item_ids int64 [B, W], scores [B, W] (promote(decoder dtype, float32)), descending.
    """
    offsets = level_offsets(level_sizes)
    L = len(level_sizes)
    path_list = [tuple(p) for p in paths.tolist()]
    id_of = {p: int(i) for p, i in zip(path_list, item_ids.tolist())}
    out_ids = torch.full((history.shape[0], beam_width), -1, dtype=torch.int64)
    out_scores = None
    for b in range(history.shape[0]):
        pool = path_list if allowed is None else [p for p, ok in zip(path_list, allowed[b].tolist()) if ok]
        children = _allowed_children(pool)
        prefixes: list[tuple[int, ...]] = [()]
        beam_scores = None
        for level in range(L):
            C = level_sizes[level]
            seqs = history[b][None, :].expand(len(prefixes), -1)
            if level > 0:
                prefix_tokens = paths_to_tokens(torch.tensor(prefixes, dtype=torch.int64), level_sizes[:level])
                seqs = torch.cat([seqs, prefix_tokens], dim=1)
            logits = decoder(seqs)[:, -1]
            dtype = torch.promote_types(logits.dtype, torch.float32)
            lp = F.log_softmax(logits.to(dtype), dim=-1)[:, offsets[level] : offsets[level] + C]
            if beam_scores is None:
                beam_scores = torch.zeros(1, dtype=dtype)
            mask = torch.zeros(len(prefixes), C, dtype=torch.bool)
            for i, p in enumerate(prefixes):
                for c in children.get(p, ()):
                    mask[i, c] = True
            total = beam_scores[:, None] + lp.masked_fill(~mask, float("-inf")) + 0.0
            # per-beam top_k (ties: lower code), then one full sort (ties: lower beam, then code)
            rank = torch.sort(total, dim=1, descending=True, stable=True).indices.argsort(dim=1)
            k = top_k if level > 0 else max(top_k, beam_width)  # the single start beam keeps W codes
            total = total.masked_fill(rank >= k, float("-inf")).reshape(-1)
            order = torch.sort(total, descending=True, stable=True).indices[:beam_width]
            order = order[total[order] > float("-inf")]
            prefixes = [prefixes[int(j) // C] + (int(j) % C,) for j in order]
            beam_scores = total[order]
        if out_scores is None:
            out_scores = torch.full((history.shape[0], beam_width), float("-inf"), dtype=beam_scores.dtype)
        n = len(prefixes)
        out_ids[b, :n] = torch.tensor([id_of[p] for p in prefixes], dtype=torch.int64)
        out_scores[b, :n] = beam_scores
    return out_ids, out_scores


@torch.no_grad()
def reference_log_prob(decoder: RecDecoder, history: torch.Tensor, path: torch.Tensor, level_sizes: list[int]) -> float:
    """The decoder's summed log-prob of one item, teacher-forced the plain way: history int64 [T]
    (left-padded) + the item's first L-1 tokens through `RecDecoder.forward`, full-vocabulary
    log-softmax at each of the last L positions, the item's code at each level (path int64 [L])."""
    offsets = level_offsets(level_sizes)
    L = len(level_sizes)
    seq = torch.cat([history, paths_to_tokens(path[None, : L - 1], level_sizes[: L - 1])[0]])
    logits = decoder(seq[None])[0, -L:]
    lp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return float(sum(lp[level, offsets[level] + int(path[level])] for level in range(L)))


# ---------------------------------------------------------------- synthetic setups


def random_paths(n_items: int, level_sizes: list[int], seed: int = 0, skew: float = 1.0) -> torch.Tensor:
    """Unique semantic-ID paths int64 [n, L] like residual k-means produces: the first L-1 levels are
    drawn with a Zipf-like skew (so prefixes collide), the last level disambiguates colliding items
    (0 when a prefix is unique). Items whose collision group outgrows the last level are dropped,
    so n <= n_items."""
    g = torch.Generator().manual_seed(seed)
    cols = []
    for size in level_sizes[:-1]:
        weights = 1.0 / torch.arange(1, size + 1, dtype=torch.float64) ** skew
        cols.append(torch.multinomial(weights, n_items, replacement=True, generator=g))
    prefix = torch.stack(cols, dim=1) if cols else torch.zeros(n_items, 0, dtype=torch.int64)
    seen: dict[tuple[int, ...], int] = {}
    last = []
    for p in prefix.tolist():
        k = seen.get(tuple(p), 0)
        seen[tuple(p)] = k + 1
        last.append(k)
    last = torch.tensor(last, dtype=torch.int64)
    keep = last < level_sizes[-1]
    return torch.cat([prefix, last[:, None]], dim=1)[keep]


def random_decoder(
    level_sizes: list[int],
    dim: int = 32,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_hidden: int = 64,
    max_seq_len: int = 256,
    std: float = 0.4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> RecDecoder:
    """A randomly initialised `RecDecoder` whose next-token distributions are peaked (std ~0.4), so
    beam scores are well separated and rankings are not decided by rounding."""
    cfg = DecoderConfig(
        vocab_size=vocab_size(level_sizes), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden, max_seq_len=max_seq_len,
    )
    torch.manual_seed(seed)
    model = RecDecoder(cfg)
    model.reset_parameters(std)
    return model.to(dtype).eval()


def random_histories(
    paths: torch.Tensor, level_sizes: list[int], batch: int, max_items: int, seed: int = 0, min_items: int = 0
) -> torch.Tensor:
    """Left-padded histories int64 [batch, 1 + max_items * L]: BOS + random items' tokens."""
    g = torch.Generator().manual_seed(seed)
    L = len(level_sizes)
    T = 1 + max_items * L
    out = torch.full((batch, T), PAD, dtype=torch.int64)
    tokens = paths_to_tokens(paths, level_sizes)
    for b in range(batch):
        n = int(torch.randint(min_items, max_items + 1, (1,), generator=g))
        items = torch.randint(0, paths.shape[0], (n,), generator=g)
        row = torch.cat([torch.tensor([BOS]), tokens[items].reshape(-1)])
        out[b, T - row.numel() :] = row
    return out
