"""GenerativeRetrieval (prefill once, staged shared/unshared KV, trie + bitmask masks, beam_topk)
vs the straightforward reference beam search; validity of results; reorder hazard; export."""

import subprocess
import sys
import textwrap

import pytest
import torch

from silverrec.generative.generative import GenerativeRetrieval, reorder_beams
from silverrec.bitmask import pack_bits
from silverrec.generative.trie import ValidPathTrie

from .reference_beam_search import random_decoder, random_histories, random_paths, reference_beam_search

SIZES = [8, 6, 5, 3]


@pytest.fixture(scope="module")
def pool():
    paths = random_paths(160, SIZES, seed=1)
    item_ids = torch.arange(paths.shape[0], dtype=torch.int64) * 10 + 7  # external ids != rows
    return paths, item_ids, ValidPathTrie(paths, SIZES)


def _module(pool, decoder, W, k):
    paths, item_ids, trie = pool
    return GenerativeRetrieval(decoder, trie, item_ids[trie.row_order], W, k).eval()


@pytest.mark.parametrize("W,k", [(1, 1), (4, 4), (16, 3), (24, 100), (300, 7)])
def test_matches_reference_float64(pool, W, k):
    paths, item_ids, _ = pool
    dec = random_decoder(SIZES, dtype=torch.float64, seed=W)
    hist = random_histories(paths, SIZES, 3, 5, seed=W)
    with torch.no_grad():
        ids, scores = _module(pool, dec, W, k)(hist)
    ref_ids, ref_scores = reference_beam_search(dec, hist, paths, item_ids, SIZES, W, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores, ref_scores.float(), atol=1e-6, rtol=1e-6)
    assert ids.shape == (3, W) and scores.dtype == torch.float32


@pytest.mark.parametrize("W,k,n_kv", [(8, 8, 2), (32, 5, 1), (20, 50, 4)])
def test_matches_reference_float32_with_bitmask(pool, W, k, n_kv):
    paths, item_ids, trie = pool
    dec = random_decoder(SIZES, n_heads=4, n_kv_heads=n_kv, seed=3)
    hist = random_histories(paths, SIZES, 4, 6, seed=4)
    allowed = torch.rand(4, paths.shape[0]) < torch.tensor([[0.02], [0.2], [0.6], [1.0]])
    bitmask = pack_bits(allowed[:, trie.row_order])
    with torch.no_grad():
        ids, scores = _module(pool, dec, W, k)(hist, bitmask)
    ref_ids, ref_scores = reference_beam_search(dec, hist, paths, item_ids, SIZES, W, k, allowed)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores, ref_scores, atol=2e-5, rtol=2e-5)
    # every returned item is real, unique per request and passes its request's filter
    for b in range(4):
        got = ids[b][ids[b] >= 0]
        assert got.unique().numel() == got.numel()
        ok = set(item_ids[allowed[b]].tolist())
        assert set(got.tolist()) <= ok
        assert torch.all(scores[b][ids[b] < 0] == float("-inf"))
        assert torch.all(scores[b][ids[b] >= 0] > float("-inf"))
        assert torch.all(scores[b][:-1] >= scores[b][1:])
    assert (ids[0] >= 0).sum() < W  # the 2% request has fewer than W items: padded


def test_empty_filter_returns_nothing(pool):
    paths, _, trie = pool
    dec = random_decoder(SIZES)
    hist = random_histories(paths, SIZES, 2, 3)
    bitmask = pack_bits(torch.zeros(2, trie.n_items, dtype=torch.bool))
    with torch.no_grad():
        ids, scores = _module(pool, dec, 6, 6)(hist, bitmask)
    assert torch.all(ids == -1) and torch.all(scores == float("-inf"))


def test_batch_independence(pool):
    """A request's answer does not depend on the other requests (padding, batch size)."""
    paths, _, _ = pool
    dec = random_decoder(SIZES)
    hist = random_histories(paths, SIZES, 3, 6, seed=9, min_items=1)
    m = _module(pool, dec, 12, 4)
    with torch.no_grad():
        ids, scores = m(hist)
        for b in range(3):
            row = hist[b : b + 1]
            row = row[:, (row != 0).nonzero()[0, 1] :]  # strip the left padding
            ids_b, scores_b = m(row)
            assert torch.equal(ids_b[0], ids[b])
            torch.testing.assert_close(scores_b[0], scores[b], atol=1e-5, rtol=1e-5)


def test_reorder_hazard():
    """Parents forming chains (beam j takes beam j-1's cache): a naive in-place row-by-row gather
    reads rows it already overwrote; the ping-pong `reorder_beams` matches an independent gather,
    and leaves its source intact."""
    B, W = 2, 5
    cache = torch.arange(2 * B * W * 3, dtype=torch.float32).reshape(2, B * W, 3)
    parent = torch.tensor([[0, 0, 1, 2, 3], [4, 1, 1, 0, 2]])
    expect = torch.stack([cache[:, b * W + parent[b]] for b in range(B)], dim=1).reshape(2, B * W, 3)
    naive = cache.clone()
    for b in range(B):
        for j in range(W):
            naive[:, b * W + j] = naive[:, b * W + int(parent[b, j])]
    assert not torch.equal(naive, expect)  # the hazard is real for this permutation
    before = cache.clone()
    spare = torch.full_like(cache, float("nan"))
    out = reorder_beams(cache, parent, spare)
    assert out is spare and torch.equal(out, expect)
    assert torch.equal(cache, before)
    assert torch.equal(reorder_beams(cache.clone(), parent, cache.clone()), expect)
    # chained reorders through the pair (as in the decode loop) compose like plain gathers
    parent2 = torch.tensor([[2, 2, 0, 4, 1], [0, 0, 3, 3, 1]])
    back = reorder_beams(out, parent2, cache.clone().fill_(float("nan")))
    expect2 = torch.stack([expect[:, b * W + parent2[b]] for b in range(B)], dim=1).reshape(2, B * W, 3)
    assert torch.equal(back, expect2)


def test_constructor_validation(pool):
    paths, item_ids, trie = pool
    dec = random_decoder([8, 6, 5, 4])
    with pytest.raises(ValueError, match="vocab_size"):
        GenerativeRetrieval(dec, trie, item_ids[trie.row_order], 4, 4)
    with pytest.raises(ValueError, match="row_to_item"):
        GenerativeRetrieval(random_decoder(SIZES), trie, item_ids[:5], 4, 4)


_LOAD = textwrap.dedent(
    """
    import sys, torch
    import silverrec.kernels  # registers torch.ops.silverrec.*
    d = sys.argv[1]
    hist, bm = torch.load(d + "/inputs.pt")
    ids, scores = torch.export.load(d + "/model.pt2").module()(hist, bm)
    ids2, scores2 = torch.jit.load(d + "/model.ts")(hist, bm)
    torch.save((ids, scores, ids2, scores2), d + "/out.pt")
    """
)


def test_export_round_trip(pool, tmp_path):
    from silverrec.snapshot import export_module

    paths, item_ids, trie = pool
    dec = random_decoder(SIZES, n_layers=1)
    m = _module(pool, dec, 8, 4)
    batch = torch.export.Dim("batch", min=1, max=4096)
    length = torch.export.Dim("length", min=2, max=dec.max_seq_len - len(SIZES))
    example = (random_histories(paths, SIZES, 2, 3, seed=1), pack_bits(torch.rand(2, trie.n_items) < 0.5))
    export_module(m, example, {"history": {0: batch, 1: length}, "item_bitmask": {0: batch}}, tmp_path)
    # other batch sizes (5, and 1: no padding to 2 rows) and history lengths than the example
    for B in (5, 1):
        hist = random_histories(paths, SIZES, B, 7, seed=2)
        bm = pack_bits(torch.rand(B, trie.n_items) < 0.7)
        torch.save((hist, bm), tmp_path / "inputs.pt")
        subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path)], check=True, timeout=300)
        ids, scores, ids_ts, scores_ts = torch.load(tmp_path / "out.pt")
        with torch.no_grad():
            ref_ids, ref_scores = m(hist, bm)
        assert ids.shape == (B, 8)
        assert torch.equal(ids, ref_ids) and torch.equal(ids_ts, ref_ids)
        torch.testing.assert_close(scores, ref_scores)
        torch.testing.assert_close(scores_ts, ref_scores)


def test_export_takes_batch_one_in_process(pool):
    """The exported decode answers a single request (batch 1, with and without a bitmask in the
    same program's signature) exactly like the eager module: no batch != 1 guard."""
    from silverrec.snapshot import export_program

    paths, _, trie = pool
    m = _module(pool, random_decoder(SIZES, n_layers=1, seed=4), 6, 2)
    batch = torch.export.Dim("batch", min=1, max=4096)
    length = torch.export.Dim("length", min=2, max=m.decoder.max_seq_len - len(SIZES))
    example = (random_histories(paths, SIZES, 2, 3, seed=1), pack_bits(torch.ones(2, trie.n_items, dtype=torch.bool)))
    program = export_program(m, example, {"history": {0: batch, 1: length}, "item_bitmask": {0: batch}}).module()
    for seed in range(3):
        hist = random_histories(paths, SIZES, 1, 2 + 3 * seed, seed=10 + seed)
        bm = pack_bits(torch.rand(1, trie.n_items) < 0.5)
        with torch.no_grad():
            got, ref = program(hist, bm), m(hist, bm)
        assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])


def test_top_k_below_beam_width_keeps_w_beams_at_step_0():
    """top_k cuts each beam's candidates, but step 0 has one start beam: it keeps W codes, else a
    one-level pool would return only top_k items. With two levels, W = 8 and top_k = 2 the result
    is 8 items, the same as the reference, not the 2 x 2 = 4 a top_k cut at step 0 would leave."""
    sizes = [12, 3]
    paths = random_paths(30, sizes, seed=3)
    item_ids = torch.arange(paths.shape[0], dtype=torch.int64) + 100
    trie = ValidPathTrie(paths, sizes)
    dec = random_decoder(sizes, seed=2)
    hist = random_histories(paths, sizes, 2, 4, seed=5)
    m = GenerativeRetrieval(dec, trie, item_ids[trie.row_order], 8, 2).eval()
    with torch.no_grad():
        ids, scores = m(hist)
    ref_ids, ref_scores = reference_beam_search(dec, hist, paths, item_ids, sizes, 8, 2)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores, ref_scores)
    assert torch.all(ids >= 0)  # 8 items each: 8 distinct level-0 codes expanded by 1 to 2 codes
    one = [paths.shape[0]]
    p1 = torch.arange(one[0])[:, None]
    m1 = GenerativeRetrieval(random_decoder(one, seed=1), ValidPathTrie(p1, one), torch.arange(one[0]), 5, 1).eval()
    with torch.no_grad():
        assert bool((m1(hist[:, :1].clamp(max=1))[0] >= 0).all())  # 5 items from a single level, top_k 1


def test_bf16_weights(pool):
    """bf16 weights (bf16 matmuls, float32 attention state and scores): valid, sorted results that
    agree with the float32 model on most items."""
    paths, item_ids, trie = pool
    dec = random_decoder(SIZES, seed=5)
    hist = random_histories(paths, SIZES, 3, 6, seed=6)
    with torch.no_grad():
        ids32, _ = _module(pool, dec, 16, 16)(hist)
        ids16, scores16 = _module(pool, random_decoder(SIZES, seed=5).to(torch.bfloat16), 16, 16)(hist)
    assert scores16.dtype == torch.float32
    assert torch.all(scores16[:, :-1] >= scores16[:, 1:])
    assert set(ids16[ids16 >= 0].tolist()) <= set(item_ids.tolist())
    for b in range(3):
        assert len(set(ids16[b].tolist()) & set(ids32[b].tolist())) >= 12


def test_matches_hf_constrained_beam_search(pool):
    """With top_k = W the decode is ordinary constrained beam search: same items and scores as
    transformers' `generate(num_beams=W, prefix_allowed_tokens_fn=trie)` on the equivalent Llama."""
    from silverrec.generative.decoder import paths_to_tokens, to_llama

    paths, item_ids, _ = pool
    dec = random_decoder(SIZES, seed=11)
    hist = random_histories(paths, SIZES, 1, 6, seed=12, min_items=6)  # unpadded row
    W = 8
    with torch.no_grad():
        ids, scores = _module(pool, dec, W, W)(hist)
    tokens = paths_to_tokens(paths, SIZES).tolist()
    children = {}
    for p in tokens:
        for d in range(len(SIZES)):
            children.setdefault(tuple(p[:d]), set()).add(p[d])
    T = hist.shape[1]
    out = to_llama(dec).generate(
        hist, num_beams=W, num_return_sequences=W, max_new_tokens=len(SIZES), min_new_tokens=len(SIZES),
        do_sample=False, length_penalty=0.0, pad_token_id=0, eos_token_id=None,
        prefix_allowed_tokens_fn=lambda b, x: sorted(children.get(tuple(x[T:].tolist()), [0])),
        output_scores=True, return_dict_in_generate=True,
    )
    item_of = {tuple(p): int(i) for p, i in zip(tokens, item_ids.tolist())}
    hf_ids = [item_of[tuple(s)] for s in out.sequences[:, T:].tolist()]
    assert ids[0].tolist() == hf_ids
    torch.testing.assert_close(scores[0], out.sequences_scores.float(), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def _first_codes_kept(dec, hist_row, trie, W):
    """The step-0 beam's first codes, the plain way: the W best valid first codes by log-prob."""
    lp = torch.log_softmax(dec(hist_row[None])[0, -1].float(), dim=-1)[2 : 2 + trie.level_sizes[0]]
    lp = lp.masked_fill(~trie.first_mask, float("-inf"))
    return set(torch.sort(lp, descending=True, stable=True).indices[:W].tolist())


@torch.no_grad()
@pytest.mark.parametrize("sizes,W,k,extra", [([8, 6], 3, 2, 16), ([8, 6], 3, 2, 0), ([8, 6, 5, 3], 4, 3, 6),
                                             ([12], 4, 4, 3)])
def test_candidate_log_probs_are_exact_or_a_first_code_bound(sizes, W, k, extra):
    """decode_rows' candidate log-probs against teacher forcing (reference_log_prob): exact for the
    rows the beam found, for every candidate whose first code the step-0 beam kept when L = 2 (the
    last step extends all their prefixes), for the first `extra` distinct prefixes of the other
    candidates in candidate order; otherwise the first code's log-prob, an upper bound; -inf at -1."""
    from .reference_beam_search import reference_log_prob

    paths = random_paths(90, sizes, seed=5)
    trie = ValidPathTrie(paths, sizes)
    dec = random_decoder(sizes, seed=6)
    module = GenerativeRetrieval(dec, trie, torch.arange(paths.shape[0]), W, k).eval()
    hist = random_histories(paths, sizes, 3, 4, seed=7)
    N = trie.n_items
    g = torch.Generator().manual_seed(8)
    cand = torch.stack([torch.randperm(N, generator=g)[:30] for _ in range(3)])
    cand[:, 5::7] = -1
    rows, scores, lp = module.decode_rows(hist, torch.ones(3, N, dtype=torch.bool), cand, extra)
    L = len(sizes)
    off = [2]
    for s in sizes[:-1]:
        off.append(off[-1] + s)
    n_exact = n_bound = 0
    for b in range(3):
        kept = _first_codes_kept(dec, hist[b], trie, W)
        found = {int(r): float(s) for r, s in zip(rows[b], scores[b]) if r >= 0}
        extras: list[tuple] = []
        for r in cand[b].tolist():
            if r >= 0 and int(trie.leaf_paths[r, 0]) not in kept:
                p = tuple(trie.leaf_paths[r, : L - 1].tolist())
                if p not in extras and len(extras) < extra:
                    extras.append(p)
        for j, r in enumerate(cand[b].tolist()):
            if r < 0:
                assert lp[b, j] == float("-inf")
                continue
            path = trie.leaf_paths[r]
            exact = reference_log_prob(dec, hist[b], path, sizes)
            first = float(torch.log_softmax(dec(hist[b][None])[0, -1].float(), dim=-1)[2 + int(path[0])])
            must_be_exact = (L == 1 or r in found or tuple(path[: L - 1].tolist()) in extras
                             or (L == 2 and int(path[0]) in kept))
            if must_be_exact or abs(float(lp[b, j]) - exact) < 1e-4:
                assert float(lp[b, j]) == pytest.approx(exact, abs=1e-4), (b, r)
                n_exact += 1
            else:
                assert float(lp[b, j]) == pytest.approx(first, abs=1e-5) and first >= exact, (b, r)
                n_bound += 1
            if r in found:
                assert float(lp[b, j]) == pytest.approx(found[r], abs=1e-5)
    assert n_exact > 0
    if L == 2 and extra >= sizes[0] or L == 1:
        assert n_bound == 0, "the extra prefixes cover every candidate the beam's codes miss"
    elif L == 2 and extra == 0 or L > 2:
        assert n_bound > 0, "some candidates are left at the bound: the test tells exact from bound"
