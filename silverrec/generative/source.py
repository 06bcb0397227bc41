"""The generative decode as a retrieval source of `RecModel`: alone (a generative-only snapshot) or
beside the ANN search (a hybrid), whose union the ranking stages then rank.

    request -> user tower -> filtered IVF search + cache/merge (AnnSource) -> ANN rows  [B, K1]
            -> filter program over the whole pool (bloom_filter, the verify program) & not excluded
               -> allowed rows [B, N] -> (trie order) beam decode     -> decode rows [B, W]
                  (+ EXTRA_PREFIXES rows in its last step: the ANN rows' exact log-probs)
            -> union (each row once; which source found it; each source's score) [B, K1 + W]
            (`HybridSources`; then the ranking stages and ranking/top_k.py's `FusedTopK`)

    request -> filter program & not excluded -> beam decode -> rows [B, W] by log-prob (`DecodeSource`)

Rows: the decode works in trie-leaf order, everything else in the canonical row space (the
IVF's cluster-major order; a generative-only snapshot's canonical order is the trie's);
`GenerativeSource` maps once each way with two permutation buffers (`canon_to_trie`,
`trie_to_canon`), and feeds the decoder from canonical history rows through `canon_tokens`.

The filter is the request's own compiled program (filter_program.compile_request's verify program:
exact on features with value planes, a Bloom superset otherwise), evaluated by the same op the
filtered search's whole-pool route uses (`silverrec::bloom_filter`, one window of the whole bank
per request). Exclusions come from the same `exclude` tensor as the ANN's. No host work.

Sources are switched per request by `sources` bool [B, 2] (column SOURCE_ANN, SOURCE_GENERATIVE):
both sources always run (static shapes, no host sync); a switched-off source's rows are dropped
before the merge.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.bloom_filter)
from silverrec.bitmask import unpack_bits
from silverrec.candidates import (FOUND_ANN, FOUND_GENERATIVE, SOURCE_ANN, SOURCE_GENERATIVE, SOURCES, Candidates,
                                  RetrievalStage)
from silverrec.errors import QueryError
from silverrec.generative.decoder import BOS, PAD
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.retrieval.item_ids import rows_to_items
from silverrec.retrieval.sources import AnnSource
from silverrec.spec import EXTRA_PREFIXES

__all__ = ["FOUND_ANN", "FOUND_GENERATIVE", "SOURCE_ANN", "SOURCE_GENERATIVE", "SOURCES", "DecodeSource",
           "GenerativeSource", "HybridSources", "merge_sources", "request_tensors"]


class GenerativeSource(nn.Module):
    """A `GenerativeRetrieval` speaking canonical rows.

    Args:
        retrieval: the decode (rows in trie-leaf order; `retrieval.row_to_item` their item ids).
        row_to_item: int64 [N] item id of each canonical row (the index's `row_to_item`); the same
            set of items as the decode's, else ValueError naming a missing item.
        max_items: the most history items fed to the decoder, the newest (its training history
            length; None: as many as its RoPE table holds). The prefill costs grow with it.
        extra_prefixes: prefixes of the ANN's best candidates that the decode's last step extends
            beside its beams, so those candidates get exact log-probs (spec.EXTRA_PREFIXES).
    Buffers:
        trie_to_canon int64 [N], canon_to_trie int64 [N]: the row permutations;
        canon_tokens int64 [N, L]: each canonical row's L decoder tokens.
    """

    def __init__(self, retrieval: GenerativeRetrieval, row_to_item: Tensor, max_items: Optional[int] = None,
                 extra_prefixes: int = EXTRA_PREFIXES):
        super().__init__()
        if extra_prefixes < 0:
            raise ValueError(f"extra_prefixes must be >= 0, got {extra_prefixes}")
        self.extra_prefixes = int(extra_prefixes)
        gen_ids = retrieval.row_to_item.to(torch.int64)
        canon_ids = torch.as_tensor(row_to_item).to(torch.int64)
        n = canon_ids.shape[0]
        if gen_ids.shape[0] != n:
            raise ValueError(f"the generative source holds {gen_ids.shape[0]} items, the index {n}: "
                             "semantic IDs must cover exactly the snapshot's pool")
        order = torch.argsort(gen_ids)
        pos = torch.searchsorted(gen_ids[order], canon_ids).clamp_max(n - 1)
        missing = (gen_ids[order][pos] != canon_ids).nonzero()
        if missing.numel():
            raise ValueError(f"item {int(canon_ids[missing[0, 0]])} of the pool has no semantic ID")
        canon_to_trie = order[pos]
        trie_to_canon = torch.empty_like(canon_to_trie)
        trie_to_canon[canon_to_trie] = torch.arange(n)
        trie = retrieval.trie
        offsets = torch.tensor(retrieval.level_offsets, dtype=torch.int64)
        self.retrieval = retrieval
        self.register_buffer("canon_to_trie", canon_to_trie)
        self.register_buffer("trie_to_canon", trie_to_canon)
        self.register_buffer("canon_tokens", (trie.leaf_paths + offsets)[canon_to_trie].contiguous())
        self.n_levels = int(trie.n_levels)
        self.pad, self.bos = PAD, BOS  # (attributes: TorchScript does not read imported globals)
        self.num_items = int(n)
        # BOS + items * L tokens, then L - 1 generated ones, within the RoPE table
        limit = max(1, (int(retrieval.decoder.max_seq_len) - self.n_levels) // self.n_levels)
        if max_items is not None and not 1 <= int(max_items) <= limit:
            raise ValueError(f"max_items must be in [1, {limit}] (the decoder's RoPE table), got {max_items}")
        self.max_items = limit if max_items is None else int(max_items)

    def history_tokens(self, history: Tensor) -> Tensor:
        """history int64 [B, H] canonical rows, oldest first, left-padded with -1 -> decoder tokens
        int64 [B, 1 + H' * L] (H' = min(H, max_items), the newest), the decode's contract: PAD ...
        PAD, BOS, the items' tokens."""
        history = history[:, -self.max_items:]
        B, H = history.shape
        tokens = self.canon_tokens[history.clamp_min(0)]  # [B, H, L]
        tokens = torch.where((history >= 0)[:, :, None], tokens, torch.full_like(tokens, self.pad)).reshape(B, H * self.n_levels)
        tokens = torch.cat([torch.full_like(tokens[:, :1], self.pad), tokens], dim=1)
        pads = (history < 0).sum(dim=1, keepdim=True) * self.n_levels  # BOS sits just before the first item
        return tokens.scatter(1, pads, torch.full_like(pads, self.bos))

    def allowed_rows(self, bits: Tensor, ops: Tensor, rows: Tensor, exclude: Tensor) -> Tensor:
        """bits int64 [R, ceil(N / 64)] the filter row bank, (ops int64 [B, L], rows int64 [B, L, T])
        one filter program per request, exclude int64 [B, E] rows (-1 = none) -> bool [B, N]: the
        canonical rows that pass the program and are not excluded."""
        B = ops.shape[0]
        start = torch.zeros(B, 1, dtype=torch.int64, device=ops.device)
        words = torch.ops.silverrec.bloom_filter(bits, ops, rows, start, bits.shape[1])[:, 0]  # [B, W]
        passing = unpack_bits(words, self.num_items)
        spare = torch.where(exclude >= 0, exclude, torch.full_like(exclude, self.num_items))  # -1 -> column N
        dropped = torch.zeros(B, self.num_items + 1, dtype=torch.bool, device=ops.device)
        dropped = dropped.scatter(1, spare, torch.ones_like(spare, dtype=torch.bool))
        return passing & ~dropped[:, : self.num_items]

    def forward(self, history: Tensor, allowed: Tensor, candidates: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """history int64 [B, H] canonical rows (see `history_tokens`), allowed bool [B, N] canonical,
        candidates int64 [B, K] canonical rows found elsewhere (the ANN's, best first; -1 = none)
        -> (rows int64 [B, W] canonical, -1 = none; scores float32 [B, W] summed log-probs, -inf = none;
        the candidates' log-probs float32 [B, K]: exact where the decode's last step extended their
        prefix, the beam's or one of `extra_prefixes` more, else their first code's, an upper bound)."""
        trie_cand = torch.where(candidates >= 0, self.canon_to_trie[candidates.clamp_min(0)], torch.full_like(candidates, -1))
        trie_rows, scores, cand_lp = self.retrieval.decode_rows(self.history_tokens(history), allowed[:, self.trie_to_canon],
                                                                trie_cand, self.extra_prefixes)
        rows = torch.where(trie_rows >= 0, self.trie_to_canon[trie_rows.clamp_min(0)], torch.full_like(trie_rows, -1))
        return rows, scores, cand_lp


class DecodeSource(RetrievalStage):
    """The decode as a retrieval stage: `GenerativeSource` with the filter bank its filter runs on.

    Alone (a generative-only snapshot) its forward is the retrieval stage (silverrec/retrieval/
    sources.py's signature): the decode's rows ranked by log-prob; beside the ANN (`HybridSources`)
    `candidates` is called with the ANN's rows.

    Args:
        generative: the decode over the canonical rows; bits: int64 [R, ceil(N / 64)] the filter row
            bank (the index's, beside the ANN: the same tensor); row_to_item: int64 [N] item id of each
            canonical row.
    """

    def __init__(self, generative: GenerativeSource, bits: Tensor, row_to_item: Tensor):
        super().__init__()
        n = generative.num_items
        if bits.dim() != 2 or bits.shape[1] != (n + 63) // 64 or row_to_item.shape != (n,):
            raise ValueError(f"the filter bank must be int64 [R, {(n + 63) // 64}] and row_to_item [{n}] for the "
                             f"decode's {n} rows, got {tuple(bits.shape)} and {tuple(row_to_item.shape)}")
        self.generative = generative
        self.num_items = n
        self.register_buffer("bits", bits)
        self.register_buffer("row_to_item", row_to_item)

    def candidates(self, history: Tensor, vops: Tensor, vrows: Tensor, exclude: Tensor, on: Tensor,
                   ann: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The decode of the requests whose `on` bool [B, 1] is set, over the rows their verify
        programs (vops, vrows) pass and `exclude` does not list, with the ANN's rows int64 [B, K]
        -> GenerativeSource's (rows [B, W], log-probs [B, W], the ANN rows' log-probs [B, K])."""
        allowed = self.generative.allowed_rows(self.bits, vops, vrows, exclude) & on
        return self.generative(history, allowed, ann)

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """The decode alone -> Candidates ranked by log-prob: rows, ids int64 [B, W] (-1 = none),
        scores = log_prob float32 [B, W] (-inf = none), found_by FOUND_GENERATIVE."""
        found, log_prob, _ = self.candidates(history, vops, vrows, exclude, sources[:, 1:2], history[:, :0])
        found_by = torch.where(found >= 0, torch.full_like(found, 2), torch.zeros_like(found))  # FOUND_GENERATIVE
        return Candidates(found, found_by, log_prob, log_prob, rows_to_items(self.row_to_item, found))


class HybridSources(RetrievalStage):
    """The ANN source and the decode, their union (module docstring): the retrieval stage of a hybrid."""

    def __init__(self, ann: AnnSource, decode: DecodeSource):
        super().__init__()
        if decode.num_items != ann.index.num_items:
            raise ValueError(f"generative source holds {decode.num_items} rows, the index {ann.index.num_items}")
        self.ann = ann
        self.decode = decode

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """-> Candidates: rows int64 [B, K1 + W] (the union, each row once), found_by (FOUND_* bits),
        log_prob (the decoder's log-prob of each row: exact where the decode found it or extended its
        prefix, else its first code's, an upper bound; -inf where the request's decode is off)."""
        # (literal columns: TorchScript does not read module globals; SOURCE_* name them)
        ann = self.ann(user, exclude, ops, rows, vops, vrows, lists, mode, history, sources, k, k0, nprobe,
                       max_probe).rows
        ann = torch.where(sources[:, 0:1], ann, torch.full_like(ann, -1))
        gen, gen_scores, ann_log_prob = self.decode.candidates(history, vops, vrows, exclude, sources[:, 1:2], ann)
        ann_log_prob = torch.where(sources[:, 1:2], ann_log_prob, float("-inf"))  # decode off: the ANN alone
        cand, found_by, log_prob = merge_sources(ann, ann_log_prob, gen, gen_scores)
        none = cand[:, :0]
        return Candidates(cand, found_by, log_prob, none.float(), none)


def merge_sources(ann: Tensor, ann_log_prob: Tensor, gen: Tensor, gen_scores: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The union of two candidate lists, each row once.

    Args:
        ann int64 [B, K], gen int64 [B, W]: rows (-1 = none; no list holds a row twice);
        ann_log_prob float32 [B, K], gen_scores float32 [B, W]: the decoder's log-prob of each entry.
    Returns:
        rows int64 [B, K + W] (ascending, -1 = none, padding anywhere), found_by int64 [B, K + W]
        (FOUND_ANN | FOUND_GENERATIVE bits, 0 at padding), the decoder's log-prob float32 [B, K + W]
        (the larger of a row's two entries; -inf at padding).

    Static shapes: one stable sort; equal rows form a group whose slot is its rank among the
    groups (cumsum of group starts); the members' flags add up (a row appears once per source).
    """
    both = torch.cat([ann, gen], dim=1)
    flags = torch.cat([torch.full_like(ann, 1), torch.full_like(gen, 2)], dim=1)  # FOUND_ANN, FOUND_GENERATIVE
    scores = torch.cat([ann_log_prob.to(gen_scores.dtype), gen_scores], dim=1)
    srt, perm = torch.sort(both, dim=1, stable=True)
    start = torch.cat([torch.ones_like(srt[:, :1], dtype=torch.bool), srt[:, 1:] != srt[:, :-1]], dim=1)
    slot = torch.cumsum(start.to(torch.int64), dim=1) - 1
    rows = torch.full_like(both, -1).scatter(1, slot, srt)
    found = torch.zeros_like(both).scatter_add(1, slot, flags.gather(1, perm))
    best = torch.full_like(scores, float("-inf")).scatter_reduce(1, slot, scores.gather(1, perm), "amax")
    real = rows >= 0
    return rows, torch.where(real, found, torch.zeros_like(found)), torch.where(real, best, torch.full_like(best, float("-inf")))


def request_tensors(histories: Sequence[np.ndarray], sources: Sequence[Optional[Sequence[str]]],
                    available: Sequence[str], max_items: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The predictor's side: per request, its history as canonical rows (oldest first) and the
    sources it asks for (None = every source of the snapshot) -> (history int64 [B, H] left-padded
    with -1, the newest `max_items` of each (all: None; the decoder reads no more), H = max(2,
    longest); sources bool [B, 2]). A source the snapshot lacks, an unknown name, or an empty list
    is a QueryError naming the request."""
    flags = torch.zeros(len(histories), len(SOURCES), dtype=torch.bool)
    for b, names in enumerate(sources):
        names = list(available) if names is None else ([names] if isinstance(names, str) else list(names))
        bad = [x for x in names if x not in available]
        if bad or not names:
            raise QueryError(f"request {b}: sources must be a non-empty list of {list(available)}, got {names!r}")
        for x in names:
            flags[b, SOURCES.index(x)] = True
    if max_items is not None:
        histories = [h[len(h) - min(len(h), max_items):] for h in histories]
    H = max([2] + [len(h) for h in histories])
    history = torch.full((len(histories), H), -1, dtype=torch.int64)
    for b, h in enumerate(histories):
        if len(h):
            history[b, H - len(h):] = torch.as_tensor(np.asarray(h, dtype=np.int64))
    return history, flags
