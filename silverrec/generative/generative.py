"""`GenerativeRetrieval`: next-item retrieval by constrained beam search over semantic IDs, one call.

Contract (shared with publish/semantic_ids.py, the training script and the predictor):
  * every item has a unique semantic-ID path of L codes (level l in [0, level_sizes[l]); the last
    level is the disambiguation token, always present);
  * tokens: PAD = 0, BOS = 1, token = level_offsets[l] + code (see silverrec/generative/decoder.py);
  * history int64 [B, T] = BOS + the L tokens of each past item (oldest first), LEFT-padded with PAD;
  * item rows are in trie leaf order (sorted paths): `row_to_item[r]` is the external id of row r
    and the optional per-request `item_bitmask` int64 [B, ceil(N / 64)] has bit r & 63 of word
    r >> 6 set for each allowed row r (the Bloom packed format).

    item_ids, scores = module(history, item_bitmask)   # int64 [B, W], float32 [B, W]
    # scores: summed log-probs (full-vocabulary log-softmax) of the L tokens, sorted descending;
    # fewer than W valid items: item id -1 and score -inf in the remaining slots

One forward:
  1. prefill the history ONCE: its K/V per layer is the shared cache [n_layers, B, KV, T, hd]
     (stored once per request, not per beam);
  2. step 0: the last position's log-probs over level-0 codes, masked by the trie (and the
     bitmask: a node with no passing item below it is pruned), expand the single start beam;
  3. steps 1..L-1: feed each beam's last token, attention = shared stage (all W beams' queries vs
     the shared KV, one batched matmul) + unshared stage (per-beam KV [n_layers, B*W, L-1, KV, hd],
     preallocated once) merged by log-sum-exp (`silverrec::staged_attention`); mask by the trie,
     select with `silverrec::beam_topk` (per-beam top_k, then global top W, exact full-sort
     semantics with ties to lower (beam, code)); reorder the unshared cache by parent index.

The loop has exactly L static steps with static shapes (W, top_k, L fixed per module); no host
synchronisation in forward (data-dependent work happens only inside the opaque ops' CPU
implementations), so it exports with torch.export (dynamic batch and history length) and
scripts with TorchScript.

The unshared cache is a ping-pong pair allocated once per call: each reorder gathers the rows of
one half into the other (`reorder_beams`) and the halves swap. An in-place row gather
`cache[j] = cache[parent[j]]` would overwrite a row before a later beam reads it
(tests/test_generative.py::test_reorder_hazard).
"""


from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.beam_topk / staged_attention)
from silverrec.generative.decoder import RecDecoder, level_offsets
from silverrec.generative.trie import ValidPathTrie


def reorder_beams(cache: torch.Tensor, parent: torch.Tensor, out: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Ping-pong reorder: out[..., b*W + j, ...] = cache[..., b*W + parent[b, j], ...] along `dim`.

    Args:
        cache: [..., B*W, ...] per-beam rows along `dim`; parent: int64 [B, W], index within request.
        out: the preallocated other half of the ping-pong pair (same shape). A row-by-row in-place
            gather would overwrite rows before they are read; the gather here completes first.
    Returns:
        out.
    """
    B, W = parent.shape
    rows = (parent + torch.arange(B, device=parent.device)[:, None] * W).reshape(B * W)
    # gather, then copy into the other half (not index_select(out=...): autograd-safe when an
    # exported program is called with grad enabled); rows are all read before any is written
    return out.copy_(cache.index_select(dim, rows))


class GenerativeRetrieval(nn.Module):
    """Constrained beam search over semantic IDs in one forward (see module docstring).

    Args:
        decoder: a trained `RecDecoder` whose vocabulary matches `trie.level_sizes`.
        trie: the `ValidPathTrie` of the candidate pool.
        row_to_item: int64 [N] external item id of each trie row (`item_ids[trie.row_order]`).
        beam_width: W, beams kept per step and results per request.
        top_k: candidates kept per beam before the global top W (>= W: plain beam search); step 0
            has a single start beam and keeps W codes whatever top_k is.
    """

    level_sizes: List[int]
    level_offsets: List[int]

    def __init__(self, decoder: RecDecoder, trie: ValidPathTrie, row_to_item: torch.Tensor, beam_width: int, top_k: int):
        super().__init__()
        level_sizes = list(trie.level_sizes)
        expected = 2 + sum(level_sizes)
        if decoder.vocab_size != expected:
            raise ValueError(f"decoder vocab_size {decoder.vocab_size} != 2 + sum(level_sizes) = {expected}")
        if row_to_item.shape != (trie.n_items,):
            raise ValueError(f"row_to_item must be [{trie.n_items}], got {tuple(row_to_item.shape)}")
        if beam_width <= 0 or top_k <= 0:
            raise ValueError(f"beam_width and top_k must be positive, got {beam_width} and {top_k}")
        self.decoder = decoder
        self.trie = trie
        self.register_buffer("row_to_item", row_to_item.to(torch.int64).contiguous())
        self.beam_width = int(beam_width)
        self.top_k = int(top_k)
        self.n_levels = len(level_sizes)
        self.level_sizes = level_sizes
        self.level_offsets = level_offsets(level_sizes)

    def _level_logprobs(self, logits: torch.Tensor, level: int) -> torch.Tensor:
        """logits [..., V] -> log-probs over level `level`'s codes [..., C] (full-vocab softmax)."""
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lo = self.level_offsets[level]
        return F.log_softmax(logits.to(dtype), dim=-1)[..., lo : lo + self.level_sizes[level]]

    def forward(self, history: torch.Tensor, item_bitmask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """history int64 [B, T] (left-padded, see contract), item_bitmask int64 [B, ceil(N/64)] or None
        -> (item_ids int64 [B, W], scores float32 [B, W]).

        Inference only (runs under no_grad). Positions must fit the RoPE table: the number of real
        history tokens + L - 1 <= decoder.max_seq_len (truncate old items before calling). An
        exported program accepts T >= 2 (torch.export specialises size 1): left-pad a bare BOS.
        """
        with torch.no_grad():
            alive: Optional[torch.Tensor] = None
            if item_bitmask is not None:
                alive = self.trie.node_alive(item_bitmask)  # [B, n_nodes]
            rows, scores, _ = self._search(history, alive, history.new_zeros(history.shape[0], 0), 0)
            item_ids = torch.where(rows >= 0, self.row_to_item[rows.clamp_min(0)], torch.full_like(rows, -1))
            return item_ids, scores

    def decode_rows(self, history: torch.Tensor, allowed: torch.Tensor, candidates: torch.Tensor, extra: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode over an unpacked leaf mask, and the decoder's log-prob of other candidates.

        Args:
            history int64 [B, T] (contract); allowed bool [B, N] (trie leaf order);
            candidates int64 [B, K]: rows (trie leaf order, -1 = none) found elsewhere, best first;
            extra: how many more prefixes the last step extends for them (see `_search`).
        Returns:
            rows int64 [B, W] in trie leaf order (-1 = none), scores float32 [B, W], and the candidates'
            log-probs float32 [B, K] (exact or an upper bound, -inf at -1).

        The entry point of a model that evaluates the filter itself (silverrec/generative/source.py):
        no packing of the mask it just computed."""
        with torch.no_grad():
            return self._search(history, self.trie.alive_nodes(allowed), candidates, extra)

    def _search(self, history: torch.Tensor, alive: Optional[torch.Tensor], candidates: torch.Tensor, extra: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """history [B, T], alive bool [B, n_nodes] or None, candidates int64 [B, K] (trie rows, -1 =
        none, best first), extra static int -> (rows int64 [B, W] trie order, -1 = none; scores
        float32 [B, W]; the candidates' log-probs float32 [B, K]).

        A candidate's log-prob is exact when the last step extends its prefix (its first L - 1 codes):
        a beam's, or one of `extra` more prefixes, those of the best candidates whose first code the
        beam did not keep at step 0 (teacher-forced beside the beams, M = min(extra, K) more rows per
        step, none of them in the beam's selection). Any other candidate gets its first code's
        log-prob, an upper bound. (L = 1: every candidate is exact.)
        """
        B = history.shape[0]
        W = self.beam_width
        L = self.n_levels
        dec = self.decoder
        key_valid = history != 0  # [B, T], 0 = PAD
        n_real = key_valid.to(torch.int64).sum(dim=1)  # [B] positions of the first generated token
        last_logits, shared_k, shared_v = dec.prefill(history)  # [B, V], [n_layers, B, KV, T, hd]
        # attention state in float32 at least (bf16 weights: bf16 matmuls, float32 attention)
        attn_dtype = torch.promote_types(shared_k.dtype, torch.float32)
        shared_k = shared_k.to(attn_dtype)
        shared_v = shared_v.to(attn_dtype)

        # step 0: one start beam per request; it keeps up to W codes (not top_k: a per-beam cut
        # below W on the single start beam would leave only top_k beams for the whole decode)
        lp0 = self._level_logprobs(last_logits, 0)  # [B, C0], unmasked: the candidates' first factor
        child = self.trie.child_table(torch.zeros(B, dtype=torch.int64, device=history.device), 0)[:, None, :]
        logprobs = self._mask(lp0[:, None, :], child, alive)
        scores, parent, code = torch.ops.silverrec.beam_topk(
            logprobs.new_zeros(B, 1), logprobs, max(self.top_k, W), W
        )  # [B, W] each
        nodes = self._advance(child, parent, code, scores, 1)  # [B, W] depth-1 node ids
        tokens = code + self.level_offsets[0]

        cand = candidates.clamp_min(0)
        first_lp = lp0.gather(1, self.trie.leaf_paths[:, 0][cand])  # [B, K] every candidate's upper bound
        M = min(extra, candidates.shape[1]) if L > 1 else 0
        extra_prefix, extra_codes, extra_lp = self._extra_prefixes(candidates, code, scores, lp0, M)
        if M > 0:
            tokens = torch.cat([tokens, extra_codes[:, :, 0] + self.level_offsets[0]], dim=1)  # [B, W + M]
        rows_per = W + M
        keep_extra = torch.arange(W, rows_per, device=history.device).expand(B, M)  # extra rows never move

        # unshared KV, preallocated once as a ping-pong pair of [K|V, n_layers, B*(W+M), L-1, KV, hd]
        n_slots = max(L - 1, 1)
        cache = shared_k.new_zeros(2, dec.n_layers, B * rows_per, n_slots, dec.n_kv_heads, dec.head_dim)
        spare = torch.zeros_like(cache)
        prefix_nodes, prefix_lp, last_lp = nodes, scores, lp0[:, None, :]
        for level in range(1, L):
            logits = dec.decode(
                tokens, n_real + (level - 1), shared_k, shared_v, key_valid, cache[0], cache[1], level - 1
            )  # [B, W + M, V]; writes this step's K/V into slot level - 1 of `cache`
            lp = self._level_logprobs(logits, level)  # [B, W + M, C]
            if level == L - 1:  # the prefixes the last step extends, their log-probs, its log-probs
                prefix_nodes, prefix_lp, last_lp = nodes, scores, lp
            child = self.trie.child_table(nodes.reshape(B * W), level).reshape(B, W, self.level_sizes[level])
            logprobs = self._mask(lp[:, :W], child, alive)
            scores, parent, code = torch.ops.silverrec.beam_topk(scores, logprobs, self.top_k, W)
            nodes = self._advance(child, parent, code, scores, level + 1)
            tokens = code + self.level_offsets[level]
            if level < L - 1:
                if M > 0:  # the extra prefixes' next codes, teacher-forced
                    extra_lp = extra_lp + lp[:, W:].gather(2, extra_codes[:, :, level : level + 1]).squeeze(2)
                    tokens = torch.cat([tokens, extra_codes[:, :, level] + self.level_offsets[level]], dim=1)
                cache, spare = reorder_beams(cache, torch.cat([parent, keep_extra], dim=1), spare, dim=2), cache

        found = scores > float("-inf")
        rows = (nodes - self.trie.leaf_base).clamp(0, self.trie.n_items - 1)
        rows = torch.where(found, rows, torch.full_like(rows, -1))
        if candidates.shape[1] == 0:
            return rows, scores.to(torch.float32), first_lp.to(torch.float32)
        if L == 1:
            return rows, scores.to(torch.float32), torch.where(candidates >= 0, first_lp, float("-inf")).to(torch.float32)
        # each candidate's prefix -> the last step's row extending it (-1: none) -> exact log-prob
        n_pre = self.trie.n_prefixes
        local = torch.where(prefix_lp > float("-inf"), prefix_nodes - self.trie.level_base[L - 1],
                            torch.full_like(prefix_nodes, n_pre))  # [B, W]
        local = torch.cat([local, torch.where(extra_lp > float("-inf"), extra_prefix, torch.full_like(extra_prefix, n_pre))], dim=1)
        step_row = torch.full((B, n_pre + 1), -1, dtype=torch.int64, device=history.device).scatter(
            1, local, torch.arange(rows_per, device=history.device).expand(B, rows_per))[:, :n_pre]
        at = step_row.gather(1, self.trie.leaf_prefix[cand])  # [B, K]
        C = self.level_sizes[L - 1]
        base = torch.cat([prefix_lp, extra_lp], dim=1).gather(1, at.clamp_min(0))
        last = last_lp.reshape(B, rows_per * C).gather(1, at.clamp_min(0) * C + self.trie.leaf_paths[:, L - 1][cand])
        cand_lp = torch.where(at >= 0, base + last, first_lp)
        cand_lp = torch.where(candidates >= 0, cand_lp, torch.full_like(cand_lp, float("-inf")))
        return rows, scores.to(torch.float32), cand_lp.to(torch.float32)

    def _extra_prefixes(self, candidates: torch.Tensor, code: torch.Tensor, scores: torch.Tensor, lp0: torch.Tensor,
                        M: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last step's M extra prefixes: those of the first candidates (by position) whose first
        code is not among the step-0 beam's codes (code, scores [B, W]), each prefix once ->
        (prefix index int64 [B, M] among depth L-1 nodes, its codes int64 [B, M, L - 1], its
        level-0 log-prob float [B, M]; -inf where fewer than M such prefixes exist)."""
        B, K = candidates.shape
        dev = candidates.device
        if M == 0:
            empty = candidates.new_zeros(B, 0)
            return empty, candidates.new_zeros(B, 0, max(self.n_levels - 1, 1)), lp0.new_zeros(B, 0)
        C0 = self.level_sizes[0]
        n_pre = self.trie.n_prefixes
        cand = candidates.clamp_min(0)
        first = self.trie.leaf_paths[:, 0][cand]  # [B, K]
        kept = torch.where(scores > float("-inf"), code, torch.full_like(code, C0))
        in_beam = torch.zeros(B, C0 + 1, dtype=torch.bool, device=dev).scatter(1, kept, torch.ones_like(kept, dtype=torch.bool))
        ok = (candidates >= 0) & ~in_beam.gather(1, first)
        prefix = self.trie.leaf_prefix[cand]  # [B, K]
        pos = torch.arange(K, device=dev).expand(B, K)
        first_pos = torch.full((B, n_pre + 1), K, dtype=torch.int64, device=dev).scatter_reduce(
            1, torch.where(ok, prefix, torch.full_like(prefix, n_pre)), pos, "amin")
        ok = ok & (first_pos.gather(1, prefix) == pos)  # the prefix's first candidate
        at = torch.topk(torch.where(ok, pos, pos + K), M, dim=1, largest=False).indices  # [B, M]
        valid = ok.gather(1, at)
        chosen = torch.where(valid, prefix.gather(1, at), torch.zeros_like(at))
        codes = self.trie.prefix_codes[chosen]  # [B, M, L - 1]
        first_lp = lp0.gather(1, codes[:, :, 0])
        return chosen, codes, torch.where(valid, first_lp, torch.full_like(first_lp, float("-inf")))

    def _mask(self, logprobs: torch.Tensor, child: torch.Tensor, alive: Optional[torch.Tensor]) -> torch.Tensor:
        """-inf where child [B, W', C] is not a valid node or (with a bitmask) has no passing item."""
        ok = child >= 0
        if alive is not None:
            B = child.shape[0]
            flat = child.clamp_min(0).reshape(B, -1)
            ok = ok & alive.gather(1, flat).reshape(child.shape)
        return logprobs.masked_fill(~ok, float("-inf"))

    def _advance(self, child: torch.Tensor, parent: torch.Tensor, code: torch.Tensor, scores: torch.Tensor, depth: int) -> torch.Tensor:
        """Node ids [B, W] of the selected (parent, code); dead beams get a valid placeholder node."""
        B, Wp, C = child.shape
        nodes = child.reshape(B, Wp * C).gather(1, parent * C + code)
        placeholder = torch.full_like(nodes, self.trie.level_base[depth])
        return torch.where(scores > float("-inf"), nodes, placeholder)
