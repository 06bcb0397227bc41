"""Bloom signatures and the bloom_filter op, against the exact forward index (MovieLens + random)."""

import math

import numpy as np
import pytest
import torch

from silverrec.filtering.bloom_hash import token_positions
from silverrec.filtering.filter_program import FilterPlan, compile_batch
from silverrec.bitmask import pack_bits, unpack_bits
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.kernels.constants import OP_AND, OP_FALSE, OP_NOP, OP_NOT, OP_OR, OP_PUSH, OP_TRUE
from silverrec.kernels.bloom_filter import (
    bloom_filter_counts_torch,
    bloom_filter_reference,
    popcount64,
    range_word_masks,
)
from silverrec.publish.bloom import BloomConfig, build_filter_bank, choose_config, estimate_fp_rate, sizing_rule
from silverrec.publish.movielens import load_movies


def test_token_hash_is_stable_and_in_range():
    # Golden values: publish and every predictor must agree forever (a change breaks old snapshots).
    assert token_positions("genre", "Drama", 1 << 20, 3, 0x5EED) == [771550, 413246, 152822]
    pos = token_positions("f", "v", 64, 40, 1)  # > 16 positions: several digest blocks
    assert len(pos) == 40 and all(0 <= p < 64 for p in pos) and len(set(pos)) > 20
    assert token_positions("a\x1fb", "c", 1 << 20, 5, 0) != token_positions("a", "b\x1fc", 1 << 20, 5, 0)
    assert token_positions("genre", "Drama", 1 << 20, 5, 1) != token_positions("genre", "Drama", 1 << 20, 5, 2)


def test_sizing_rule_and_estimate():
    assert sizing_rule(6, 7, 1.5) == 64  # 63 -> 64
    assert sizing_rule(184, 7, 1.5) == 1984
    counts = torch.full((1000,), 6)
    m, k = sizing_rule(6), 7
    est = estimate_fp_rate(counts, m, k)
    assert est == pytest.approx((1 - (1 - 1 / m) ** (k * 6)) ** k)
    assert est <= 0.01
    with pytest.raises(ValueError, match="multiple of 64"):
        BloomConfig(100, 3)


def _random_bank(r, w, gen):
    hi = torch.randint(-(1 << 31), 1 << 31, (r, w), generator=gen)
    lo = torch.randint(0, 1 << 32, (r, w), generator=gen)
    return (hi << 32) | lo  # all 64 bits, sign bit included


def _random_programs(b, length, width, rows, gen):
    """Valid random postfix programs of different lengths, NOP-padded."""
    ops = torch.zeros(b, length, dtype=torch.int64)
    for i in range(b):
        prog, depth = [], 0
        target = int(torch.randint(1, length + 1, (1,), generator=gen))
        while len(prog) < target:
            choices = [OP_PUSH, OP_PUSH, OP_FALSE, OP_TRUE] + ([OP_NOT] if depth >= 1 else []) + ([OP_AND, OP_OR] * 2 if depth >= 2 else [])
            if len(prog) + depth - 1 >= target and depth >= 2:
                choices = [OP_AND, OP_OR]
            op = choices[int(torch.randint(len(choices), (1,), generator=gen))]
            prog.append(op)
            depth += {OP_PUSH: 1, OP_FALSE: 1, OP_TRUE: 1, OP_NOT: 0, OP_AND: -1, OP_OR: -1}[op]
        while depth > 1:
            prog.append(OP_OR)
            depth -= 1
        prog = prog[:length] if len(prog) <= length else None
        if prog is None:
            prog = [OP_PUSH]
        ops[i, : len(prog)] = torch.tensor(prog)
    rows_t = torch.randint(-rows, rows, (b, length, width), generator=gen)
    return ops, rows_t


@pytest.mark.parametrize("b, p, n", [(1, 1, 1), (5, 3, 7), (19, 4, 2)])
def test_op_matches_reference_on_random_programs(b, p, n):
    gen = torch.Generator().manual_seed(b * 100 + p)
    r, w = 37, 23
    bits = _random_bank(r, w, gen)
    ops, rows = _random_programs(b, 12, 5, r, gen)
    starts = torch.randint(-1, w, (b, p), generator=gen)  # includes empty windows and windows past W
    got = torch.ops.silverrec.bloom_filter(bits, ops, rows, starts, n)
    want = bloom_filter_reference(bits, ops, rows, starts, n)
    assert torch.equal(got, want)
    assert (got[starts < 0] == 0).all()


def test_identical_queries_match_reference():
    """Queries repeating an earlier query's program and windows (evaluated once) get the same rows."""
    gen = torch.Generator().manual_seed(11)
    r, w = 21, 30
    bits = _random_bank(r, w, gen)
    ops, rows = _random_programs(3, 8, 3, r, gen)
    idx = torch.tensor([0, 1, 0, 2, 1, 0])
    ops, rows = ops[idx], rows[idx]
    starts = torch.tensor([[0, 4], [3, -1], [0, 4], [1, 1], [3, -1], [0, 5]])
    got = torch.ops.silverrec.bloom_filter(bits, ops, rows, starts, 6)
    assert torch.equal(got, bloom_filter_reference(bits, ops, rows, starts, 6))


def test_large_output_with_few_live_queries_is_zero_elsewhere():
    """Outputs >= 1 MiB with few live queries come from fresh zero pages (no memset): same values."""
    gen = torch.Generator().manual_seed(12)
    bits = _random_bank(3, 40_000, gen)
    ops = torch.tensor([[OP_PUSH, OP_PUSH, OP_OR]] * 5)
    rows = torch.tensor([[[0, 1], [~2, 2], [0, 0]]] * 5)
    starts = torch.tensor([[-1], [0], [-1], [-1], [-1]])
    for _ in range(2):  # allocate / free twice
        got = torch.ops.silverrec.bloom_filter(bits, ops, rows, starts, 40_000)
        assert torch.equal(got[[0, 2, 3, 4]], torch.zeros(4, 1, 40_000, dtype=torch.int64))
        assert torch.equal(got[1, 0], (bits[0] & bits[1]) | (~bits[2] & bits[2]))
    none = torch.ops.silverrec.bloom_filter(bits, ops, rows, torch.full((5, 1), -1), 40_000)
    assert int(none.abs().sum()) == 0


def _counts_case(seed, b=6, p=4, n=5):
    gen = torch.Generator().manual_seed(seed)
    r, w = 19, 12
    bits = _random_bank(r, w, gen)
    ops, rows = _random_programs(b, 10, 4, r, gen)
    ops[-1], rows[-1] = ops[0], rows[0]  # a repeated query
    n_items = 64 * w - 17
    lo = torch.randint(0, n_items, (b, p), generator=gen)
    hi = lo + torch.randint(-3, 64 * n + 40, (b, p), generator=gen)  # empty, partial, longer than the window
    hi = hi.clamp(max=n_items)
    lo[0, 1] = -1  # empty window
    lo[1] = -1  # query without windows
    lo[-1], hi[-1] = lo[0], hi[0]
    return bits, ops, rows, lo, hi, n


def _counts_reference(bits, ops, rows, lo, hi, n):
    return bloom_filter_counts_torch(bits, ops, rows, lo, hi, n, bloom=bloom_filter_reference)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_counts_op_matches_reference(seed):
    bits, ops, rows, lo, hi, n = _counts_case(seed)
    mask, counts = torch.ops.silverrec.bloom_filter_counts(bits, ops, rows, lo, hi, n)
    want_mask, want_counts = _counts_reference(bits, ops, rows, lo, hi, n)
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    # every set bit lies in [lo, hi); counts are the popcounts; the rest equals bloom_filter
    starts = torch.where(lo >= 0, lo >> 6, torch.full_like(lo, -1))
    plain = torch.ops.silverrec.bloom_filter(bits, ops, rows, starts, n)
    assert torch.equal(mask & ~plain, torch.zeros_like(mask))
    assert torch.equal(counts, popcount64(mask).sum(dim=2))
    assert (counts[lo < 0] == 0).all() and (counts[hi <= lo] == 0).all()
    for b in range(lo.shape[0]):
        for p in range(lo.shape[1]):
            if lo[b, p] < 0:
                continue
            got_rows = unpack_bits(mask[b, p], 64 * n) & True
            idx = torch.arange(64 * n) + 64 * int(lo[b, p] >> 6)
            in_range = (idx >= lo[b, p]) & (idx < hi[b, p])
            assert not (got_rows & ~in_range).any()


def test_counts_triton_interpreter_equals_reference():
    from silverrec.kernels.bloom_filter_triton import bloom_filter_counts_triton

    bits, ops, rows, lo, hi, n = _counts_case(4, b=3, p=3, n=20)  # 20 words > one 16-word block
    got_mask, got_counts = bloom_filter_counts_triton(bits, ops, rows, lo, hi, n)
    want_mask, want_counts = _counts_reference(bits, ops, rows, lo, hi, n)
    assert torch.equal(got_mask, want_mask) and torch.equal(got_counts, want_counts)


def test_op_rejects_malformed_programs():
    bits = torch.zeros(4, 2, dtype=torch.int64)
    starts = torch.zeros(1, 1, dtype=torch.int64)
    for prog in ([OP_AND], [OP_PUSH, OP_PUSH], [OP_NOT, OP_PUSH], [OP_NOP]):
        ops = torch.tensor([prog])
        with pytest.raises(ValueError, match="malformed"):
            torch.ops.silverrec.bloom_filter(bits, ops, torch.zeros(1, len(prog), 1, dtype=torch.int64), starts, 1)
    with pytest.raises(ValueError, match="outside the bank"):
        torch.ops.silverrec.bloom_filter(bits, torch.tensor([[OP_PUSH]]), torch.tensor([[[9]]]), starts, 1)


def test_triton_interpreter_equals_reference():
    from silverrec.kernels.bloom_filter_triton import bloom_filter_triton

    gen = torch.Generator().manual_seed(3)
    r, w = 20, 40
    bits = _random_bank(r, w, gen)
    ops, rows = _random_programs(3, 9, 4, r, gen)
    starts = torch.tensor([[0, 5, -1], [38, 2, 2], [-1, -1, 17]])
    got = bloom_filter_triton(bits, ops, rows, starts, 20)  # 20 words > one 16-word block
    assert torch.equal(got, bloom_filter_reference(bits, ops, rows, starts, 20))


def test_popcount_and_range_masks_against_python():
    gen = torch.Generator().manual_seed(0)
    x = _random_bank(7, 9, gen)
    want = torch.tensor([[bin(v & ((1 << 64) - 1)).count("1") for v in row] for row in x.tolist()])
    assert torch.equal(popcount64(x), want)
    lo = torch.tensor([0, 5, 64, 130, 200])
    hi = torch.tensor([64, 70, 64, 250, 201])
    starts = lo >> 6
    masks = range_word_masks(lo, hi, starts, 4)
    for i in range(5):
        bits = unpack_bits(masks[i], 256)
        rows = torch.arange(256) + 64 * int(starts[i])
        assert torch.equal(bits, (rows >= lo[i]) & (rows < hi[i]))


def test_pack_unpack_round_trip():
    m = torch.rand(3, 130) < 0.5
    m[:, 63] = True  # sign bit
    assert torch.equal(unpack_bits(pack_bits(m), 130), m)


# --------------------------------------------------------------------------- real data: MovieLens


@pytest.fixture(scope="module")
def movielens():
    movies = load_movies()
    feats = {"genre": movies.genres, "decade": [[d] for d in movies.decade], "tag": movies.tags}
    return ForwardIndex.from_lists(feats)


def _all_single_terms(fwd):
    return [f"{f} = {_q(v)}" for f, voc in zip(fwd.features, fwd.vocabs) for v in voc]


def _q(v):
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _token_truth(fwd):
    """bool [num_tokens, N]: exact answer of every single-token term, in _all_single_terms order."""
    want = torch.zeros(sum(len(v) for v in fwd.vocabs), fwd.size, dtype=torch.bool)
    want[fwd.token_ids.long(), fwd.token_rows.long()] = True
    return want


def _whole_pool(bank, plan, filters):
    ops, rows = compile_batch(filters, plan)
    starts = torch.zeros(len(filters), 1, dtype=torch.int64)
    return torch.ops.silverrec.bloom_filter(bank, ops, rows, starts, bank.shape[1])[:, 0]


def test_default_bloom_on_movielens_no_false_negatives_and_fp_below_one_percent(movielens):
    fwd = movielens
    cfg = choose_config(fwd)
    bank, meta = build_filter_bank(fwd, cfg)
    plan = FilterPlan.from_config(meta)
    assert cfg.bits == sizing_rule(int(fwd.token_counts().max()))
    assert meta["features"]["tag"]["exact"] is None  # 173 tags x 11 bits: too wide for exact planes
    assert meta["features"]["genre"]["exact"] is not None
    filters = _all_single_terms(fwd)
    got = unpack_bits(_whole_pool(bank, plan, filters), fwd.size)
    want = _token_truth(fwd)
    assert torch.equal(want[::97], fwd.evaluate_batch(filters[::97]))  # the shortcut is the evaluator
    assert not (want & ~got).any(), "a positive term dropped an item that has the value"
    fp = (got & ~want).sum().item() / (~want).sum().item()
    est = meta["stats"]["estimated_fp_rate"]
    print(f"MovieLens default M={cfg.bits} K={cfg.hashes}: measured FP {fp:.2e}, estimated {est:.2e}")
    assert fp <= 0.01
    pairs = (~want).sum().item()
    assert (got & ~want).sum().item() <= est * pairs + 5 * math.sqrt(est * pairs) + 5


def test_fp_rate_within_estimate_when_small(movielens):
    """A deliberately small Bloom (M=128, K=3): the FP rate is large enough to compare to the estimate."""
    fwd = movielens
    cfg = BloomConfig(bits=128, hashes=3)
    bank, meta = build_filter_bank(fwd, cfg)
    plan = FilterPlan.from_config(meta)
    filters = _all_single_terms(fwd)
    got = unpack_bits(_whole_pool(bank, plan, filters), fwd.size)
    want = _token_truth(fwd)
    assert not (want & ~got).any()
    fp = (got & ~want).sum().item() / (~want).sum().item()
    est = meta["stats"]["estimated_fp_rate"]
    print(f"MovieLens M=128 K=3: measured FP {fp:.4f}, estimated {est:.4f}")
    assert 0.5 * est <= fp <= 1.5 * est


def test_not_semantics_on_movielens(movielens):
    fwd = movielens
    bank, meta = build_filter_bank(fwd, choose_config(fwd))
    plan = FilterPlan.from_config(meta)
    positive = ["genre = Drama AND decade IN (1990s, 2000s)", "tag = 'pixar' OR genre = Animation"]
    exact_not = ["NOT genre = Drama", "genre = Comedy AND NOT genre IN (Romance, Drama)", "NOT (decade = 1990s OR genre = Horror)"]
    approx_not = ["NOT tag = 'funny'", "genre = Comedy AND NOT tag IN ('funny', 'romance')"]
    filters = positive + exact_not + approx_not
    got = unpack_bits(_whole_pool(bank, plan, filters), fwd.size)
    want = fwd.evaluate_batch(filters)
    for i, f in enumerate(filters):
        if f in approx_not:
            # NOT over a Bloom term: may drop true matches (Bloom false positives of the tag), never adds
            assert not (got[i] & ~want[i]).any() or "genre = Comedy" not in f
        else:
            assert not (want[i] & ~got[i]).any(), f"false negative for {f!r}"
    # exact planes make these exactly right (they are all-negated or genre/decade only at FP ~0)
    for i in range(len(positive), len(positive) + len(exact_not)):
        assert not (want[i] & ~got[i]).any()
    assert plan.approximate_not == ["tag"]


def test_exact_planes_alone_are_exact(movielens):
    """Every negated genre/decade value is evaluated exactly by the value-code planes."""
    fwd = movielens
    bank, meta = build_filter_bank(fwd, BloomConfig(bits=64, hashes=1))  # a terrible Bloom on purpose
    plan = FilterPlan.from_config(meta)
    filters = [f"NOT {f} = {_q(v)}" for f, voc in zip(fwd.features, fwd.vocabs) if f != "tag" for v in voc]
    got = unpack_bits(_whole_pool(bank, plan, filters), fwd.size)
    assert torch.equal(got, fwd.evaluate_batch(filters))


def test_forward_index_permute_and_codes():
    feats = {"a": [["x"], ["y", "x"], []], "b": [["1"], ["2"], ["1"]]}
    fwd = ForwardIndex.from_lists(feats)
    perm = fwd.permute(torch.tensor([2, 0, 1]))
    assert torch.equal(perm.evaluate("a = x"), torch.tensor([False, True, True]))
    assert torch.equal(perm.evaluate("NOT a = x AND b = 1"), torch.tensor([True, False, False]))
    codes, slots = fwd.feature_codes("a")
    assert slots == 2 and codes.tolist() == [[1, 0], [2, 1], [0, 0]]
    coded = ForwardIndex.from_codes({"a": (["x", "y"], np.array([0, 1, -1])), "b": (["1", "2"], np.array([0, 1, 0]))})
    assert torch.equal(coded.evaluate("a = x OR b = 2"), torch.tensor([True, True, False]))


_STACK_BARRIERS_SM90 = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from silverrec.kernels.bloom_filter_triton import _bloom_filter_kernel

sig = {name: '*i64' for name in ('bits_ptr', 'ops_ptr', 'rows_ptr', 'start_ptr', 'out_ptr', 'scratch_ptr')}
sig.update({name: 'i32' for name in 'W L T P NW'.split()})
src = ASTSource(fn=_bloom_filter_kernel, signature={**sig, 'BLOCK_W': 'constexpr'}, constexprs={'BLOCK_W': 64})
ptx = compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx']
stack_stores = ptx.count('st.global') - 1  # all but the output's store
assert stack_stores == 4 and ptx.count('bar.sync') >= 2 * stack_stores, (stack_stores, ptx.count('bar.sync'))
print('compiled')
"""


def test_program_stack_stores_sit_between_barriers():
    """The filter program's stack slots are stored by one warp and read by every warp holding the lane
    (64 lanes in 4 warps: twice), so each store needs a CTA barrier before and after it
    (bloom_filter_triton.py `_stack_store`). Without them an H200 returned other rows from run to run;
    the interpreter runs programs one at a time and cannot show it, so this checks the compiled sm_90
    code: four stack stores (PUSH, AND / OR, NOT, FALSE / TRUE), at least eight barriers."""
    from tests.helpers import compile_in_clean_process

    compile_in_clean_process(_STACK_BARRIERS_SM90)
