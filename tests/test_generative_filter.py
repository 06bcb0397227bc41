"""The generative decode's filter evaluated in the model (silverrec/generative/source.py).

References: the exact forward index (`ForwardIndex.evaluate`, pool order) for the allowed rows, the
host-side history encoder (`publish.semantic_ids.history_tokens`) for the decoder input,
and the plain reference beam search (tests/reference_beam_search.py, pool order, Python sets) for
the filtered decode. The pool, filters and histories are those of tests/rec_fixtures.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from silverrec.filtering.filter_program import compile_request
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.generative.source import GenerativeSource
from silverrec.publish.semantic_ids import history_tokens

from tests.rec_fixtures import rec_setup
from tests.reference_beam_search import reference_beam_search
from tests.test_hybrid import SIZES, decode_module, semantic_paths
from tests.test_rec_model import FILTERS as REC_FILTERS

FILTERS = [None, "cat = c99", "NOT cat = c99", "tags = t3", *REC_FILTERS]


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def source(rec):
    return GenerativeSource(decode_module(rec, beam_width=10, top_k=4), rec.built.parts.index.row_to_item)


def _canonical_to_pool(rec) -> np.ndarray:
    """pool row (items.parquet order) of each canonical row."""
    pool_row = {int(i): p for p, i in enumerate(rec.logs.item_ids.tolist())}
    return np.array([pool_row[int(i)] for i in rec.built.parts.index.row_to_item.tolist()])


def _exclude(rows_per_request: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows_per_request), width), -1, dtype=torch.int64)
    for b, r in enumerate(rows_per_request):
        r = sorted(r)
        if r:
            out[b, width - len(r):] = torch.tensor(r)
    return out


def test_allowed_rows_equal_the_exact_evaluator(rec, source):
    plan = rec.snap().rec_handler().plan
    fwd = ForwardIndex.from_lists(rec.logs.features)
    to_pool = _canonical_to_pool(rec)
    n = len(to_pool)
    rng = np.random.default_rng(0)
    excluded = [sorted(rng.choice(n, int(rng.integers(0, 30)), replace=False).tolist()) for _ in FILTERS]
    _, _, vops, vrows, _ = compile_request(FILTERS, plan)
    allowed = source.allowed_rows(rec.built.parts.index.bits, vops, vrows, _exclude(excluded, 32))
    assert allowed.shape == (len(FILTERS), n) and allowed.dtype == torch.bool
    for b, f in enumerate(FILTERS):
        want = fwd.evaluate(f).numpy()[to_pool]  # canonical order
        want[excluded[b]] = False
        assert np.array_equal(allowed[b].numpy(), want), f"filter {f!r}"
    assert not allowed[1].any() and allowed[0].sum() == n - len(excluded[0])


@pytest.mark.parametrize("max_items", [None, 3])
def test_history_tokens_equal_the_host_encoding(rec, source, max_items):
    """Canonical history rows -> decoder tokens as the host encoder makes them, the newest
    `max_items` items (the decoder's training history length) or as many as its RoPE table holds."""
    if max_items is not None:
        source = GenerativeSource(source.retrieval, rec.built.parts.index.row_to_item, max_items=max_items)
    row_to_item = rec.built.parts.index.row_to_item.to(torch.int64)
    tokens = source.canon_tokens  # checked below against the semantic paths directly
    paths = semantic_paths(len(row_to_item), SIZES)
    pool_row = {int(i): p for p, i in enumerate(rec.logs.item_ids.tolist())}
    offsets = torch.tensor(source.retrieval.level_offsets)
    want_tokens = torch.stack([paths[pool_row[int(i)]] + offsets for i in row_to_item])
    assert torch.equal(tokens, want_tokens)
    order = torch.argsort(row_to_item)
    histories = [[5, 9, 2], [], [7], list(range(40))]
    H = 40
    rows = torch.full((len(histories), H), -1, dtype=torch.int64)
    for b, h in enumerate(histories):
        if h:
            rows[b, H - len(h):] = torch.tensor(h)
    got = source.history_tokens(rows)
    ref = history_tokens([row_to_item[h].tolist() for h in histories], row_to_item[order].numpy(),
                         want_tokens[order].numpy(), source.max_items)
    width = max(got.shape[1], ref.shape[1])
    pad = lambda t: torch.cat([torch.zeros(t.shape[0], width - t.shape[1], dtype=t.dtype), t], dim=1)  # noqa: E731
    assert torch.equal(pad(got), pad(ref))


def test_filtered_decode_equals_the_reference_beam_search(rec, source):
    """Filter and exclude-history evaluated in the model give the decode the reference gets from
    the exact evaluator's allowed set (pool order, Python): same items, same scores."""
    handler = rec.snap().rec_handler()
    fwd = ForwardIndex.from_lists(rec.logs.features)
    users = [int(u) for u in rec.logs.user_ids[:len(FILTERS)]]
    hist_ids = [rec.logs.history(u)[-6:] for u in users]
    hist_rows = [handler.rows(h, "history").tolist() for h in hist_ids]
    _, _, vops, vrows, _ = compile_request(FILTERS, handler.plan)
    H = max(len(h) for h in hist_rows)
    history = _exclude([[] for _ in users], H)
    for b, h in enumerate(hist_rows):
        history[b, H - len(h):] = torch.tensor(h)  # oldest first
    allowed = source.allowed_rows(rec.built.parts.index.bits, vops, vrows, _exclude(hist_rows, H))
    rows, scores, _ = source(history, allowed, history[:, :0])
    ids = torch.where(rows >= 0, rec.built.parts.index.row_to_item[rows.clamp_min(0)].to(torch.int64), -1)

    paths = semantic_paths(len(rec.logs.item_ids), SIZES)  # pool order, as decode_module built them
    pool_allowed = torch.stack([fwd.evaluate(f) for f in FILTERS])
    for b, h in enumerate(hist_ids):
        pool_allowed[b] &= ~torch.from_numpy(np.isin(rec.logs.item_ids, h))
    ret = source.retrieval
    some = pool_allowed.any(dim=1)  # (the reference needs at least one allowed item)
    ref_ids, ref_scores = reference_beam_search(ret.decoder, source.history_tokens(history)[some], paths,
                                                torch.from_numpy(rec.logs.item_ids), SIZES, ret.beam_width, ret.top_k,
                                                pool_allowed[some])
    assert torch.equal(ids[some], ref_ids)
    torch.testing.assert_close(scores[some], ref_scores, atol=2e-5, rtol=2e-5)
    assert bool((ids[~some] < 0).all()) and bool((scores[~some] == float("-inf")).all())
    assert bool((ids[0] >= 0).all()) and not bool(some[1])  # no filter: W items; "cat = c99": none


def test_max_items_beyond_the_rope_table_is_an_error(rec, source):
    with pytest.raises(ValueError, match="max_items must be in"):
        GenerativeSource(source.retrieval, rec.built.parts.index.row_to_item, max_items=10**6)


def test_semantic_ids_must_cover_the_pool(rec, source):
    ids = rec.built.parts.index.row_to_item.to(torch.int64).clone()
    ids[5] = -77
    with pytest.raises(ValueError, match="item -77 of the pool has no semantic ID"):
        GenerativeSource(source.retrieval, ids)
    with pytest.raises(ValueError, match="semantic IDs must cover exactly the snapshot's pool"):
        GenerativeSource(source.retrieval, ids[:-1])
