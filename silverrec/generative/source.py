"""The generative decode as a retrieval source of `RecModel`, and the hybrid model that ranks the
union of the ANN's and the decode's candidates in one forward.

    request -> user tower -> filtered IVF search (RecModel.retrieve)  -> ANN rows  [B, K1]
            -> filter program over the whole pool (bloom_filter, the verify program) & not excluded
               -> allowed rows [B, N] -> (trie order) beam decode     -> decode rows [B, W]
                  (+ EXTRA_PREFIXES rows in its last step: the ANN rows' exact log-probs)
            -> union (each row once; which source found it; each source's score) [B, K1 + W]
            -> embedding cache re-score, OverArch, value model (RecModel.rank_rows)
            -> + w x the decode's log-prob, source priority (fuse_sources) -> top-k

Rows: the decode works in trie-leaf order, everything else in the canonical (cluster-major) row
space; `GenerativeSource` maps once each way with two permutation buffers (`canon_to_trie`,
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
from silverrec.errors import QueryError
from silverrec.generative.decoder import BOS, PAD
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.rec_model import RecModel

SOURCES = ("ann", "generative")
SOURCE_ANN, SOURCE_GENERATIVE = 0, 1
FOUND_ANN, FOUND_GENERATIVE = 1, 2  # bits of `found_by`
PRIORITIES = ("none", "ann", "generative", "both")  # which candidates rank first (fuse_sources)
# the decode's last step extends this many more prefixes, of the ANN's best candidates, beside its
# beams: the log-prob those candidates are ranked with is then exact, not a bound (on
# MovieLens: offline, 8, 16 and 32 gave what exact log-probs of every candidate give; in the
# forward, 4 and 8 gave the same NDCG@10, and 4 costs half the extra rows in a step of 64)
EXTRA_PREFIXES = 4


class GenerativeSource(nn.Module):
    """A `GenerativeRetrieval` speaking canonical rows.

    Args:
        retrieval: the decode (rows in trie-leaf order; `retrieval.row_to_item` their item ids).
        row_to_item: int64 [N] item id of each canonical row (the index's `row_to_item`); the same
            set of items as the decode's, else ValueError naming a missing item.
        max_items: the most history items fed to the decoder, the newest (its training history
            length; None: as many as its RoPE table holds). The prefill costs grow with it.
        extra_prefixes: prefixes of the ANN's best candidates that the decode's last step extends
            beside its beams, so those candidates get exact log-probs (`EXTRA_PREFIXES`).
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


def fuse_sources(value: Tensor, log_prob: Tensor, found_by: Tensor, weight: float, tiers: Tensor
                 ) -> Tuple[Tensor, Tensor]:
    """The union's ranking: value float32 [B, C] (-inf at padding), the decoder's log-prob float32
    [B, C] (exact, or an upper bound for a row neither the beam found nor the last step extended;
    -inf where the request's decode is switched off), found_by int64 [B, C] (FOUND_* bits), the
    log-prob's weight w and the source priority's tiers float32 [4] (by found_by, `PRIORITIES`) ->

        score float32 [B, C] = value + w * log-prob (a -inf log-prob adds nothing: the ANN alone);
        key float32 [B, C]: the order of the top-k, score + tier * (the request's score range + 1):
            every row of a higher tier before every row of a lower one, by score within a tier.

    Priority "generative" (the decode's rows first) ranks the top-k as the decode alone does, and
    "ann" (the ANN's rows first) at w = 0 as the ANN alone does (by value), so a grid over (w,
    priority) on the validation split (publish/fusion.py) cannot choose a fusion worse there than
    the better source; "both" puts the rows both sources found first. Without the log-prob term the
    OverArch, trained on the ANN's candidates, ranks the union as it ranks the ANN's list
    (MovieLens: hybrid = ANN only). The log-prob of an ANN row is exact for the rows whose prefix the
    decode's last step extends (GenerativeSource.extra_prefixes): with a bound in their place (the
    decode's lowest beam log-prob) no fusion beat the better source on MovieLens.
    """
    score = value + weight * torch.where(log_prob > float("-inf"), log_prob, torch.zeros_like(log_prob))
    real = score > float("-inf")
    hi = torch.where(real, score, torch.full_like(score, float("-inf"))).amax(dim=1, keepdim=True)
    lo = torch.where(real, score, torch.full_like(score, float("inf"))).amin(dim=1, keepdim=True)
    span = torch.where(real.any(dim=1, keepdim=True), hi - lo + 1.0, torch.ones_like(hi))
    return score, score + tiers[found_by] * span


def priority_tiers(priority: str) -> Tensor:
    """A source priority (`PRIORITIES`) -> its tier per found_by value 0..3, float32 [4]."""
    if priority not in PRIORITIES:
        raise ValueError(f"source priority must be one of {PRIORITIES}, got {priority!r}")
    first = {"none": 0, "ann": FOUND_ANN, "generative": FOUND_GENERATIVE, "both": FOUND_ANN | FOUND_GENERATIVE}[priority]
    return torch.tensor([float(first != 0 and (f & first) == first) for f in range(4)])


class HybridRecModel(RecModel):
    """`RecModel` with a second retrieval source, the generative decode (module docstring).

    Args: those of `RecModel`, plus generative: a `GenerativeSource` over the same pool;
        generative_weight: w in the ranking score value + w * (the decode's log-prob) (0: the value alone);
        source_priority: which candidates rank first, one of `PRIORITIES` (see `fuse_sources`).
    Buffer: tiers float32 [4], the priority's tier of each found_by value.
    """

    def __init__(self, *args, generative: Optional[GenerativeSource] = None, generative_weight: float = 0.0,
                 source_priority: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.generative_weight = float(generative_weight)
        self.register_buffer("tiers", priority_tiers(source_priority))
        if generative is None:
            raise ValueError("HybridRecModel needs a generative source (a plain RecModel has none)")
        if generative.num_items != self.index.num_items:
            raise ValueError(f"generative source holds {generative.num_items} rows, the index {self.index.num_items}")
        self.generative = generative

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor,
                vops: Tensor, vrows: Tensor, lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int,
                k0: int, nprobe: int, max_probe: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One request batch: RecModel.forward's arguments, plus

            history int64 [B, H]: the user's history as canonical rows, oldest first, left-padded with -1;
            sources bool [B, 2]: the sources each request uses (SOURCE_ANN, SOURCE_GENERATIVE columns).

        Returns RecModel.forward's (item_ids, scores, task scores, rows) over the union (k <= K1 + W;
        scores: `fuse_sources`' score, in the order of its key),
        plus found_by int64 [B, k] (FOUND_ANN | FOUND_GENERATIVE; 0 = none) and source scores
        float32 [B, k, 2]: the exact re-score of task 0 (ANN; -inf where the ANN did not find the
        item) and the decoder's summed log-prob of the item (exact where the decode found it or
        extended its prefix, else its first code's log-prob, an upper bound; -inf where the
        request's decode was switched off).
        """
        # (literal columns and bits: TorchScript does not read module globals; SOURCE_* and FOUND_* name them)
        user, ops, rows, vops, vrows, lists = self.request(values, lengths, dense, ops, rows, vops, vrows, lists)
        ann = self.retrieve(user, exclude, ops, rows, vops, vrows, lists, mode, k0, nprobe, max_probe)
        ann = torch.where(sources[:, 0:1], ann, torch.full_like(ann, -1))
        allowed = self.generative.allowed_rows(self.index.bits, vops, vrows, exclude)
        allowed = allowed & sources[:, 1:2]
        gen, gen_scores, ann_log_prob = self.generative(history, allowed, ann)
        ann_log_prob = torch.where(sources[:, 1:2], ann_log_prob, float("-inf"))  # decode off: the ANN alone
        cand, found_by, gen_feature = merge_sources(ann, ann_log_prob, gen, gen_scores)
        value, task_scores = self.rank_rows(user, cand)
        score, key = fuse_sources(value, gen_feature, found_by, self.generative_weight, self.tiers)
        ids, _, tasks_out, top_rows, top = self.best(cand, key, task_scores, k)
        found = top_rows >= 0
        top_scores = torch.where(found, score.gather(1, top), float("-inf"))
        by = torch.where(found, found_by.gather(1, top), torch.zeros_like(top))
        ann_score = (self.cache.embeddings(top_rows) * user[:, :1, :]).sum(dim=2)  # task 0's exact re-score
        ann_score = torch.where((by & 1) != 0, ann_score, float("-inf"))
        gen_score = torch.where(found, gen_feature.gather(1, top), float("-inf"))  # the log-prob ranked with
        return ids, top_scores, tasks_out, top_rows, by, torch.stack([ann_score, gen_score], dim=2)


def request_tensors(histories: Sequence[np.ndarray], sources: Sequence[Optional[Sequence[str]]],
                    available: Sequence[str]) -> Tuple[Tensor, Tensor]:
    """The predictor's side: per request, its history as canonical rows (oldest first) and the
    sources it asks for (None = every source of the snapshot) -> (history int64 [B, H] left-padded
    with -1, H = max(2, longest); sources bool [B, 2]). A source the snapshot lacks, an unknown
    name, or an empty list is a QueryError naming the request."""
    flags = torch.zeros(len(histories), len(SOURCES), dtype=torch.bool)
    for b, names in enumerate(sources):
        names = list(available) if names is None else ([names] if isinstance(names, str) else list(names))
        bad = [x for x in names if x not in available]
        if bad or not names:
            raise QueryError(f"request {b}: sources must be a non-empty list of {list(available)}, got {names!r}")
        for x in names:
            flags[b, SOURCES.index(x)] = True
    H = max([2] + [len(h) for h in histories])
    history = torch.full((len(histories), H), -1, dtype=torch.int64)
    for b, h in enumerate(histories):
        if len(h):
            history[b, H - len(h):] = torch.as_tensor(np.asarray(h, dtype=np.int64))
    return history, flags


def example_inputs(example: tuple, num_items: int) -> tuple:
    """RecModel's export example (batch 2, publish/rec.py example_request) -> the hybrid's: the
    history rows [2, 4] (-1 left padding) and the source flags [2, 2] inserted before the ints."""
    history = torch.tensor([[-1, -1, 0, 1], [2, 0, 1, 2]], dtype=torch.int64).clamp_max(num_items - 1)
    return (*example[:10], history, torch.ones(2, 2, dtype=torch.bool), *example[10:])


def dynamic_shapes(shapes: dict) -> dict:
    """RecModel's export dynamic shapes (by argument name) -> the hybrid's: dynamic batch (the
    request batch's symbol) and history length."""
    batch = shapes["dense"][0]
    return {**shapes, "history": {0: batch, 1: torch.export.Dim.DYNAMIC}, "sources": {0: batch}}
