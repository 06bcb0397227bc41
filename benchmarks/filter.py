"""Filtering benchmark, one process: Bloom (silverrec) vs roaring inverted index vs forward index, and
end-to-end filtered ANN: co-designed selectivity-aware search vs Faiss IVF-SQ8 + IDSelectorBitmap
(fed by the roaring bitmap) vs a numpy filter-then-exact scan, against the exact filtered answer.

    .venv/bin/python benchmarks/filter.py            # 1M (+10M filter-only at M=512), ~15 min
    .venv/bin/python benchmarks/filter.py --quick    # 200k items, a couple of minutes
    .venv/bin/python benchmarks/filter.py --part noisy [--quick]   # calibrated defaults on a noisy pool (noisy_part)
    .venv/bin/python benchmarks/filter.py --part conjunctions [--quick]   # part C only: ANDs of frequent values
                                                   # (ours: snap.search on a written and loaded snapshot)

Writes benchmarks/results/filter.json (filter_quick.json with --quick).

    python3 benchmarks/filter.py --device cuda [--quick]   # on a GPU: results/filter_cuda[_quick].json

--device cuda: the filtered search of a pure-ANN snapshot's root module moved with `.to("cuda")`
(1M x 96, 200k with --quick; conjunctions of frequent values at 0.01%..50% selectivity, batch 16,
k 100 and 4096) through the public search path (compile, estimate, one forward on the device) vs
the floor: the filter's exact mask precomputed on the device (not timed), then
topk(masked q @ x.T) on the GPU (Faiss GPU IVF has no IDSelector bitmap: no Faiss row). Records
recall against the exact filtered answer, CUDA-event times alternated call by call, and
torch.cuda.max_memory_allocated during one search vs B x N x 4 bytes (a [B, N] float32 matrix).
Needs neither faiss nor pyroaring.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
# numpy's OpenBLAS pool spin-waits between calls: on a shared 2-core machine the exact baseline's
# small float GEMMs ran many times slower with 2 threads than with one, so the baseline gets one BLAS
# thread (override with OPENBLAS_NUM_THREADS).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/ann.py: torch's and Faiss's pools sleep-wait

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cuda_common import cuda_alternate, cuda_info, peak_bytes, require_device  # noqa: E402
from common import Panel, plot_only, replot, save_plot  # noqa: E402

try:  # the CPU benchmark's baselines; --device cuda needs neither
    import faiss
    import pyroaring
except ImportError as _missing:
    faiss = pyroaring = None
    _MISSING = _missing

import silverrec  # noqa: E402
from silverrec.filtering.filter_lang import And, Not, Term, parse  # noqa: E402
from silverrec.filtering.filter_program import FilterPlan, compile_batch, compile_request  # noqa: E402
from silverrec.kernels.constants import (MODE_AUTO, MODE_PROBED, MODE_UNPROBED, ROUTE_POSTING, ROUTE_PROBED,  # noqa: E402
                                         ROUTE_WHOLE_POOL)
from silverrec.bitmask import unpack_bits  # noqa: E402
from silverrec.filtering.forward_index import ForwardIndex  # noqa: E402
from silverrec.publish.bloom import BloomConfig, build_filter_bank, choose_config  # noqa: E402
from silverrec.publish.filtered_ivf import filter_index, search_model  # noqa: E402
from silverrec.publish.ivf import cluster_major_layout, residual_helps  # noqa: E402
from silverrec.publish.postings import build_postings, default_limit  # noqa: E402

FEATURES = {  # name -> (cardinality, zipf exponent or 0 = uniform)
    "country": (10, 0.0),
    "genre": (20, 1.0),
    "age": (50, 0.0),
    "lang": (100, 0.0),
    "brand": (500, 1.1),
    "topic": (1000, 0.0),
}
MIX = [  # realistic query mix: AND of ORs, some NOT
    "country IN (c1, c2) AND genre IN (g0, g3, g5)",
    "lang IN (l1, l2, l3, l4) AND NOT genre = g0",
    "(brand IN (b0, b1, b2) OR topic IN (t5, t6)) AND age IN (a1, a2, a3, a4, a5)",
    "country = c3 AND (lang = l7 OR lang = l8) AND NOT brand = b0",
    "genre IN (g1, g2) AND NOT (country = c0 OR age IN (a0, a1))",
    "topic IN (t1, t2, t3, t4, t5, t6, t7, t8) OR brand = b3",
    "age = a9 AND genre = g4",
    "NOT country IN (c0, c1, c2) AND lang IN (l10, l11)",
]
NEARLY_FREE = ["country = c1", "brand = b1"]  # ~10% and ~8% of the pool
ROUTE_NAMES = {ROUTE_PROBED: "probed", ROUTE_WHOLE_POOL: "whole_pool", ROUTE_POSTING: "posting_lists"}
SELECTIVE = {  # filters with a designed selectivity, for the end-to-end ANN part
    "10%": "country = c1 AND NOT genre = g0",
    "1%": "lang = l5 AND NOT age = a0",
    "0.03%": "topic = t7 AND country IN (c1, c2, c3)",
}



def layout(x: torch.Tensor, centroids: torch.Tensor, assignment: torch.Tensor):
    """The int8 IVF layout as publish builds it (residual codes where `residual_helps`, IVFConfig's "auto")."""
    return cluster_major_layout(x, torch.arange(x.shape[0]), centroids, assignment,
                                residual=residual_helps(x, centroids, assignment))

def timeit(fn, repeat=5, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"median_ms": 1e3 * statistics.median(ts), "p20_ms": 1e3 * ts[len(ts) // 5], "p80_ms": 1e3 * ts[min(len(ts) - 1, 4 * len(ts) // 5)]}


def make_features(n: int, rng) -> dict:
    out = {}
    for name, (card, zipf) in FEATURES.items():
        p = np.ones(card) if zipf == 0 else 1.0 / np.arange(1, card + 1) ** zipf
        codes = rng.choice(card, size=n, p=p / p.sum()).astype(np.int32)
        out[name] = ([f"{name[0]}{i}" for i in range(card)], codes)
    return out


# ---------------------------------------------------------------------------------------- roaring


class RoaringIndex:
    """Inverted index: one roaring bitmap per (feature, value); NOT = complement in [0, N)."""

    def __init__(self, feats: dict, n: int):
        self.n = n
        self.maps = {}
        for name, (vocab, codes) in feats.items():
            order = np.argsort(codes, kind="stable")
            bounds = np.searchsorted(codes[order], np.arange(len(vocab) + 1))
            for v in range(len(vocab)):
                self.maps[(name, vocab[v])] = pyroaring.BitMap(order[bounds[v] : bounds[v + 1]].astype(np.uint32))
        self.universe = pyroaring.BitMap(np.arange(n, dtype=np.uint32))

    def bytes(self) -> int:
        return sum(len(m.serialize()) for m in self.maps.values())

    def evaluate(self, node):
        if isinstance(node, str):
            node = parse(node)
        if isinstance(node, Term):
            maps = [self.maps[(node.feature, v)] for v in node.values if (node.feature, v) in self.maps]
            return pyroaring.BitMap.union(*maps) if maps else pyroaring.BitMap()
        if isinstance(node, Not):
            return self.universe - self.evaluate(node.child)
        parts = [self.evaluate(c) for c in node.children]
        return pyroaring.BitMap.intersection(*parts) if isinstance(node, And) else pyroaring.BitMap.union(*parts)


def roaring_to_faiss_bitmap(bm: pyroaring.BitMap, n: int) -> np.ndarray:
    bits = np.zeros(n, dtype=bool)
    bits[np.asarray(bm.to_array(), dtype=np.int64)] = True
    return np.packbits(bits, bitorder="little")


# ------------------------------------------------------------------------------ part A: filtering


def filter_part(n: int, ms: list[int], batches: list[int], rng, nlist: int, nprobe: int) -> list[dict]:
    rows = []
    feats = make_features(n, rng)
    t0 = time.perf_counter()
    fwd = ForwardIndex.from_codes(feats)
    roar = RoaringIndex(feats, n)
    print(f"[{n:,} items] forward + roaring built in {time.perf_counter() - t0:.1f}s", flush=True)
    fwd_bytes = sum(t.numel() * t.element_size() for t in (fwd.token_ids, fwd.offsets, fwd.token_rows))
    roar_bytes = roar.bytes()
    post_rows, post_off, _ = build_postings(fwd, default_limit(n))
    post_bytes = int(post_rows.numel() * 4 + post_off.numel() * 8)  # silverrec's posting lists (selective tokens)
    del post_rows, post_off
    # synthetic cluster layout for the co-designed (probed-window) evaluation: equal clusters
    off = torch.linspace(0, n, nlist + 1).round().to(torch.int64)
    for m in ms:
        t0 = time.perf_counter()
        bank, meta = build_filter_bank(fwd, BloomConfig(bits=m, hashes=7) if m else choose_config(fwd))
        plan = FilterPlan.from_config(meta)
        m_eff = meta["bloom"]["bits"]
        print(f"  M={m_eff}: bank {bank.numel() * 8 / 2**20:.0f} MiB built in {time.perf_counter() - t0:.1f}s", flush=True)
        # FP rate of the Bloom-only programs on the mix, against the exact answer
        ops, prow = compile_batch(MIX, plan)
        words = torch.ops.silverrec.bloom_filter(bank, ops, prow, torch.zeros(len(MIX), 1, dtype=torch.int64), bank.shape[1])
        got = unpack_bits(words[:, 0], n)
        want = fwd.evaluate_batch(MIX)
        fn = int((want & ~got).sum())
        fp = float((got & ~want).sum()) / float((~want).sum())
        single = [f"{f} = {v[0]}{i}" for f, (card, _) in FEATURES.items() for i in range(0, card, max(1, card // 10)) for v in [f]]
        o1, r1 = compile_batch(single, plan)
        g1 = unpack_bits(torch.ops.silverrec.bloom_filter(bank, o1, r1, torch.zeros(len(single), 1, dtype=torch.int64), bank.shape[1])[:, 0], n)
        w1 = fwd.evaluate_batch(single)
        fp_term = float((g1 & ~w1).sum()) / float((~w1).sum())
        del got, want, g1, w1
        for b in batches:
            filters = [MIX[i % len(MIX)] for i in range(b)]
            ops, prow = compile_batch(filters, plan)
            whole = torch.zeros(b, 1, dtype=torch.int64)
            probes = torch.from_numpy(rng.choice(nlist, size=(b, nprobe), replace=True))
            starts = off[probes] >> 6
            wc = int((((off[1:] + 63) >> 6) - (off[:-1] >> 6)).max())
            rows.append({
                "part": "filter", "n": n, "M": m_eff, "K": 7, "batch": b,
                "bloom_whole_pool": timeit(lambda: torch.ops.silverrec.bloom_filter(bank, ops, prow, whole, bank.shape[1]), repeat=3),
                "bloom_probed": timeit(lambda: torch.ops.silverrec.bloom_filter(bank, ops, prow, starts, wc)),
                "compile_plan": timeit(lambda: compile_batch(filters, plan)),  # LRU hit (repeated filters)
                "compile_plan_uncached": timeit(lambda: compile_batch(filters, plan, cache=False)),
                "roaring_whole_pool": timeit(lambda: [roar.evaluate(f) for f in filters], repeat=3),
                "forward_index": timeit(lambda: fwd.evaluate_batch(filters), repeat=1, warmup=0) if b <= 16 else None,
                "probed_fraction": nprobe / nlist,
                "bytes": {"bloom_bank": int(bank.numel() * 8), "bloom_only": int(m_eff * bank.shape[1] * 8), "roaring": roar_bytes, "forward_index": fwd_bytes, "posting_lists": post_bytes},
                "fp_rate_mix": fp, "fp_rate_single_term": fp_term, "estimated_fp_term": meta["stats"]["estimated_fp_rate"],
                "false_negatives_mix": fn,
            })
            r = rows[-1]
            print(
                f"    B={b:3d} bloom whole {r['bloom_whole_pool']['median_ms']:8.2f} ms | probed {r['bloom_probed']['median_ms']:7.3f} ms "
                f"| roaring {r['roaring_whole_pool']['median_ms']:8.2f} ms | forward {r['forward_index']['median_ms'] if r['forward_index'] else float('nan'):8.1f} ms "
                f"| FP mix {fp:.2e} term {fp_term:.2e} (est {meta['stats']['estimated_fp_rate']:.2e}) FN {fn}",
                flush=True,
            )
        del bank
        gc.collect()
    return rows


# ------------------------------------------------------------------------- part B: filtered ANN


def gaussian_mixture(n, d, rng, centers=1024):
    c = rng.normal(size=(centers, d)).astype(np.float32)
    x = np.empty((n, d), dtype=np.float32)
    for s in range(0, n, 1 << 18):
        e = min(n, s + (1 << 18))
        x[s:e] = c[rng.integers(0, centers, e - s)] + 0.4 * rng.normal(size=(e - s, d)).astype(np.float32)
    return x


def recall(ids: np.ndarray, truth: list[np.ndarray]) -> float:
    return float(np.mean([len(set(ids[b].tolist()) & set(t.tolist())) / max(1, len(t)) for b, t in enumerate(truth)]))


def ann_part(n: int, d: int, nlist: int, ks: list[int], rng, bloom_bits: int) -> list[dict]:
    rows = []
    x = gaussian_mixture(n, d, rng)
    feats = make_features(n, rng)
    t0 = time.perf_counter()
    km = faiss.Kmeans(d, nlist, niter=10, seed=1, spherical=False, max_points_per_centroid=64)
    km.train(x)
    quant = faiss.IndexFlatIP(d)
    quant.add(km.centroids)
    _, assign = quant.search(x, 1)
    ivf = layout(torch.from_numpy(x), torch.from_numpy(km.centroids), torch.from_numpy(assign[:, 0]).long())
    order = ivf.row_to_item  # item id == pool row
    fwd_pool = ForwardIndex.from_codes(feats)
    module, meta = filter_index(ivf, fwd_pool.permute(order), BloomConfig(bits=bloom_bits, hashes=7))
    module.eval()
    plan = FilterPlan.from_config(meta)
    faiss_ix = faiss.IndexIVFScalarQuantizer(quant, d, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    faiss_ix.train(x[rng.choice(n, min(n, 100_000), replace=False)])
    faiss_ix.add(x)
    roar = RoaringIndex(feats, n)
    print(f"[ANN {n:,} x {d}] built in {time.perf_counter() - t0:.1f}s (nlist {nlist}, M={bloom_bits})", flush=True)
    B = 16
    q = x[rng.integers(0, n, B)] + 0.3 * rng.normal(size=(B, d)).astype(np.float32)
    qt = torch.from_numpy(q)

    def ours(filters, k, nprobe, max_probe, mode):
        inputs = compile_request(filters, plan)  # the predictor's compile (LRU hits for repeated filters)
        with torch.inference_mode():
            return module(qt, k, nprobe, *inputs, max_probe, torch.full((B,), mode, dtype=torch.int64))

    def routes(filters, k, nprobe, max_probe, mode):
        with torch.inference_mode():
            route = module.plan_probes(qt, list(compile_request(filters, plan)), torch.full((B,), mode, dtype=torch.int64),
                                       k, nprobe, max_probe)[2]
        return {name: int((route == r).sum()) for r, name in ROUTE_NAMES.items()}

    for k in ks:
        # unfiltered reference point: plain IVF at the same nprobe
        # "country = c1" runs on exact value-code planes (4 rows), "brand = b1" on Bloom rows (K = 7)
        for f in NEARLY_FREE:
            for nprobe in (16, 32):
                base = timeit(lambda: ivf(qt, k, nprobe), repeat=15)
                none = timeit(lambda: ours([None] * B, k, nprobe, nprobe, MODE_PROBED), repeat=15)  # same op, no filter
                filt = timeit(lambda: ours([f] * B, k, nprobe, nprobe, MODE_PROBED), repeat=15)
                rows.append({"part": "nearly_free", "n": n, "k": k, "nprobe": nprobe, "filter": f, "fraction": len(roar.evaluate(f)) / n,
                             "unfiltered_ms": base["median_ms"], "unfiltered_same_op_ms": none["median_ms"], "filtered_probed_ms": filt["median_ms"],
                             "ratio": filt["median_ms"] / base["median_ms"], "ratio_same_op": filt["median_ms"] / none["median_ms"]})
                print(f"  k={k} nprobe={nprobe}: unfiltered {base['median_ms']:.2f} ms (filtered op, no filter: {none['median_ms']:.2f}), "
                      f"filtered ({f!r}, co-designed) {filt['median_ms']:.2f} ms, ratio {rows[-1]['ratio']:.2f} (same op {rows[-1]['ratio_same_op']:.2f})", flush=True)
        for sel, f in SELECTIVE.items():
            bm = roar.evaluate(f)
            allowed = np.asarray(bm.to_array(), dtype=np.int64)
            frac = len(allowed) / n

            def numpy_scan():
                idx = np.asarray(roar.evaluate(f).to_array(), dtype=np.int64)
                s = x[idx] @ q.T  # [M, B]
                kk = min(k, len(idx))
                part = np.argpartition(-s, kk - 1, axis=0)[:kk] if kk < len(idx) else np.arange(len(idx))[:, None].repeat(B, 1)
                return [idx[part[:, b][np.argsort(-s[part[:, b], b])]] for b in range(B)]

            truth = numpy_scan()
            t_np = timeit(numpy_scan, repeat=9)
            rows.append({"part": "ann", "system": "numpy_filter_then_scan", "n": n, "k": k, "selectivity": sel, "fraction": frac, "recall": 1.0, "median_ms": t_np["median_ms"]})
            # Faiss IVF-SQ8 + IDSelectorBitmap fed by the roaring bitmap (bitmap conversion timed too)
            faiss_best = None
            for nprobe in (8, 32, 128, 512, nlist):
                def faiss_search():
                    sel_bits = roaring_to_faiss_bitmap(roar.evaluate(f), n)
                    params = faiss.SearchParametersIVF(sel=faiss.IDSelectorBitmap(n, faiss.swig_ptr(sel_bits)), nprobe=nprobe)
                    return faiss_ix.search(q, k, params=params)[1]
                r = recall(faiss_search(), truth)
                t = timeit(faiss_search, repeat=3)
                rows.append({"part": "ann", "system": "faiss_ivfsq8_bitmap", "n": n, "k": k, "selectivity": sel, "fraction": frac, "nprobe": nprobe, "recall": r, "median_ms": t["median_ms"]})
                print(f"  k={k} {sel:>6} ({frac:.4%}) faiss nprobe={nprobe:5d} recall {r:.3f} {t['median_ms']:9.2f} ms", flush=True)
                if r >= 0.95 and faiss_best is None:
                    faiss_best = rows[-1]
            for nprobe in (8, 32):
                for mode, name in ((MODE_PROBED, "silverrec_fixed_nprobe"), (MODE_AUTO, "silverrec_selectivity_aware")):
                    max_probe = nprobe if mode == MODE_PROBED else min(nlist, max(64, 8 * nprobe))
                    ids = ours([f] * B, k, nprobe, max_probe, mode)[1].numpy()
                    r = recall(ids, truth)
                    t = timeit(lambda: ours([f] * B, k, nprobe, max_probe, mode), repeat=9)
                    rt = routes([f] * B, k, nprobe, max_probe, mode)
                    rows.append({"part": "ann", "system": name, "n": n, "k": k, "selectivity": sel, "fraction": frac, "nprobe": nprobe, "max_probe": max_probe, "recall": r, "median_ms": t["median_ms"], "routes": rt})
                    print(f"  k={k} {sel:>6} {name:28s} nprobe={nprobe:3d} recall {r:.3f} {t['median_ms']:9.2f} ms routes {rt}", flush=True)
            print(f"  k={k} {sel:>6} numpy filter-then-scan: {t_np['median_ms']:.2f} ms; faiss at recall>=0.95: "
                  f"{faiss_best['median_ms'] if faiss_best else float('nan'):.2f} ms (nprobe {faiss_best['nprobe'] if faiss_best else '-'})", flush=True)
    # co-design pays: 16 filters on the probed clusters vs roaring over the whole pool
    filters = [MIX[i % len(MIX)] for i in range(16)]
    program = list(compile_request(filters, plan))
    ops, prow = program[:2]
    probes = module.plan_probes(qt, program, torch.full((B,), MODE_PROBED), 100, 32, 32)[0]
    lo = module.cluster_offsets[probes.clamp_min(0)]
    hi = module.cluster_offsets[probes.clamp_min(0) + 1]
    # what the forward runs: the filter on each probed cluster's rows, with per-cluster counts
    t_co = timeit(lambda: torch.ops.silverrec.bloom_filter_counts(module.bits, ops, prow, lo, hi, module.window_words))
    t_co_fixed = timeit(lambda: torch.ops.silverrec.bloom_filter(module.bits, ops, prow, lo >> 6, module.window_words))
    t_ro = timeit(lambda: [roar.evaluate(f) for f in filters], repeat=3)
    rows.append({"part": "codesign", "n": n, "nprobe": 32, "nlist": nlist, "bloom_probed_ms": t_co["median_ms"], "bloom_probed_fixed_window_ms": t_co_fixed["median_ms"], "roaring_whole_ms": t_ro["median_ms"], "speedup": t_ro["median_ms"] / t_co["median_ms"]})
    print(f"  co-design: 16 filters on 32 probed clusters {t_co['median_ms']:.3f} ms vs roaring whole pool {t_ro['median_ms']:.2f} ms: {rows[-1]['speedup']:.1f}x", flush=True)
    return rows


# ----------------------------------------------------- part C: conjunctions of frequent values


CONJ_FEATURES = {"country": 6, "lang": 10, "category": 16}  # every value held by 4-30% of the items


FAISS_NPROBES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768)  # + nlist: the conjunction part's Faiss grid
# "equal recall": Faiss's recall within this of ours. 16 queries x k 100 are 1,600 neighbours, and a few
# of them flip with either side's int8 rounding: at 8.6% Faiss's nprobe 16 found 0.99375 against our
# 0.99438 (one neighbour), and at 67% SQ8's recall stops at 0.98375 for every nprobe up to nlist.
EQUAL_RECALL_SLACK = 0.005


def conjunction_family(feats: dict, n: int, rng, count: int = 40) -> list[tuple[str, float]]:
    """Random ANDs of 2-3 single frequent values (one per feature): the most common filter shape in
    recommendation; plus filters for the ends of the measured range (0.01% to 50%) that random ANDs of
    these features miss: the three least frequent values (0.014%), and broad filters (~9%, ~35%, ~67%)."""
    out = []
    names = list(feats)
    for _ in range(count):
        chosen = rng.choice(names, size=int(rng.integers(2, 4)), replace=False)
        terms = [f"{f} = {f[0]}{int(rng.integers(0, len(feats[f][0])))}" for f in chosen]
        out.append(" AND ".join(terms))
    out += ["category = c15 AND country = c5 AND lang = l9",
            "country IN (c0, c1) AND NOT lang IN (l0, l1, l2, l3, l4, l5, l6)", "country IN (c1, c2)", "NOT country = c0"]
    return out


def conjunction_part(n: int, d: int, nlist: int, ks: list[int], rng, repeat: int) -> list[dict]:
    """silverrec (the public API: the index written as a snapshot, `silverrec.load(DIR).search(q, k,
    nprobe=..., filter=...)`, as benchmarks/ann.py; compile LRU + estimate + one forward) vs roaring AND + exact
    float scan of the survivors (timed together) vs Faiss IVF-SQ8 + IDSelectorBitmap fed by the
    roaring AND (bitmap built per call; at equal recall: the smallest nprobe of `FAISS_NPROBES` + nlist
    whose recall reaches ours less `EQUAL_RECALL_SLACK`, and, as a second figure, the smallest reaching
    0.95), batch 16, sides
    alternated in blocks (an untimed call at each switch, then two timed; Faiss last, the other two
    swapping places each round, so that each follows Faiss's full scan equally often), same repeat count, each
    filter evaluated per call on every side and
    parsed once on every side (silverrec's compile LRU; the roaring side gets the parsed tree).

    silverrec's nprobe is fixed per k, not per filter: the unfiltered nprobe that reaches recall
    0.95 at that k on this pool (16 for k = 100; 256 for k = 4096, where nprobe 16 reaches 0.81),
    as a user would set it; Faiss's is chosen per filter."""
    import tempfile
    from types import SimpleNamespace

    from silverrec.publish.filtered_ivf import search_section, write_index

    rows = []
    x = gaussian_mixture(n, d, rng)
    feats = {}
    for name, card in CONJ_FEATURES.items():
        p = 1.0 / np.arange(1, card + 1) ** 0.7
        feats[name] = ([f"{name[0]}{i}" for i in range(card)], rng.choice(card, size=n, p=p / p.sum()).astype(np.int32))
    t0 = time.perf_counter()
    km = faiss.Kmeans(d, nlist, niter=10, seed=1, max_points_per_centroid=64)
    km.train(x)
    quant = faiss.IndexFlatIP(d)
    quant.add(km.centroids)
    _, assign = quant.search(x, 1)
    ivf = layout(torch.from_numpy(x), torch.from_numpy(km.centroids), torch.from_numpy(assign[:, 0]).long())
    module, meta = filter_index(ivf, ForwardIndex.from_codes(feats).permute(ivf.row_to_item), BloomConfig(bits=512, hashes=7))
    module.eval()
    nprobe = 16  # the snapshot's default; ours_nprobe below per k
    # the index published as `silverrec publish --pool` writes it (publish/filtered_ivf.py write_index: the root
    # module, its tensors in tensors.pt) and loaded as a user loads it: what `snap.search` serves from
    cfg = {"dim": d, "nlist": nlist, "default_nprobe": nprobe, "filter": meta, "search": search_section(module, nprobe)}
    snap_dir = tempfile.TemporaryDirectory(prefix="silverrec_conj_")
    write_index(module, cfg, Path(snap_dir.name) / "snapshot", torchscript=True)
    snap = silverrec.load(Path(snap_dir.name) / "snapshot")
    print(f"[conjunctions] snapshot written and loaded (backend {snap.backend})", flush=True)
    faiss_ix = faiss.IndexIVFScalarQuantizer(quant, d, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    faiss_ix.train(x[rng.choice(n, min(n, 100_000), replace=False)])
    faiss_ix.add(x)
    roar = RoaringIndex(feats, n)
    planes = [r for f in meta["features"].values() for r in f["planes"] if r >= 0]
    mem = {"value_planes": int(meta["stats"]["value_planes_bytes"]), "roaring_same_values": int(sum(len(m.serialize()) for m in roar.maps.values())),
           "planes": len(planes)}
    print(f"[conjunctions {n:,} x {d}] built in {time.perf_counter() - t0:.1f}s; value planes {mem['value_planes'] / 2**20:.2f} MiB "
          f"vs roaring {mem['roaring_same_values'] / 2**20:.2f} MiB for the same {len(planes)} values", flush=True)
    rows.append({"part": "conj_memory", "n": n, **mem})
    B = 16
    q = x[rng.integers(0, n, B)] + 0.3 * rng.normal(size=(B, d)).astype(np.float32)
    qt = torch.from_numpy(q)
    family = conjunction_family(feats, n, rng)
    fractions = {f: len(roar.evaluate(f)) / n for f in family}
    # a spread of selectivities: 0.01% .. 50%
    picked, seen = [], set()
    for f in sorted(family, key=lambda f: fractions[f]):
        bucket = round(math.log10(max(fractions[f], 1e-6)) * 2)
        if fractions[f] >= 5e-5 and bucket not in seen:
            seen.add(bucket)
            picked.append(f)
    for k in ks:
        ours_nprobe = 16 if k <= 100 else 256
        for f in picked:
            frac = fractions[f]
            tree = parse(f)  # parsed once, as silverrec's compile LRU holds the compiled filter

            def exact_scan():  # roaring AND + exact float scan of the survivors
                idx = np.asarray(roar.evaluate(tree).to_array(), dtype=np.int64)
                s_ = x[idx] @ q.T
                kk = min(k, len(idx))
                part = np.argpartition(-s_, kk - 1, axis=0)[:kk] if kk < len(idx) else np.arange(len(idx))[:, None].repeat(B, 1)
                return [idx[part[:, b][np.argsort(-s_[part[:, b], b])]] for b in range(B)]

            def ours():
                return snap.search(qt, k, nprobe=ours_nprobe, filter=f).item_ids

            truth = exact_scan()
            r_ours = recall(ours().numpy(), truth)

            def faiss_at(fp):
                def faiss_search():
                    sel_bits = roaring_to_faiss_bitmap(roar.evaluate(tree), n)
                    params = faiss.SearchParametersIVF(sel=faiss.IDSelectorBitmap(n, faiss.swig_ptr(sel_bits)), nprobe=fp)
                    return faiss_ix.search(q, k, params=params)[1]
                return faiss_search

            # Faiss's nprobe: the smallest of a fine grid whose recall reaches ours less EQUAL_RECALL_SLACK
            # (equal recall, the target's comparison; all nlist when none does), and the smallest reaching 0.95
            grid = sorted({p for p in FAISS_NPROBES if p < nlist} | {nlist})
            faiss_recall = {}
            for fp in grid:
                faiss_recall[fp] = recall(faiss_at(fp)(), truth)
                if faiss_recall[fp] >= r_ours - EQUAL_RECALL_SLACK:
                    break
            equal = next((fp for fp in grid if faiss_recall.get(fp, 0.0) >= r_ours - EQUAL_RECALL_SLACK), nlist)
            at95 = next((fp for fp in grid if faiss_recall.get(fp, 0.0) >= 0.95), equal)
            best = (equal, faiss_at(equal))
            sides = {"silverrec": ours, "roaring_and_exact_scan": exact_scan, "faiss_ivfsq8_bitmap": best[1]}
            if at95 != equal:
                sides["faiss_ivfsq8_bitmap_recall_0.95"] = faiss_at(at95)
            ts = {name: [] for name in sides}
            # the side right after Faiss's full-pool scan runs slower (roaring and silverrec alike, measured),
            # and a fixed order gave that slot to silverrec
            # every round: the Faiss sides go last and the other two swap places each round, so each follows
            # Faiss in every other round
            pair = [n for n in sides if not n.startswith("faiss")]
            last = [n for n in sides if n.startswith("faiss")]
            for rnd in range(repeat):  # alternate the sides in blocks: one untimed call at each switch
                for name in (pair if rnd % 2 == 0 else pair[::-1]) + last:  # (torch's, Faiss's and
                    fn = sides[name]  # numpy's thread pools hand the cores over there), then two timed calls
                    fn()
                    for _ in range(2):
                        t0 = time.perf_counter()
                        fn()
                        ts[name].append(1e3 * (time.perf_counter() - t0))
            med = {name: statistics.median(v) for name, v in ts.items()}
            med.setdefault("faiss_ivfsq8_bitmap_recall_0.95", med["faiss_ivfsq8_bitmap"])
            baseline = min(med["roaring_and_exact_scan"], med["faiss_ivfsq8_bitmap"])
            baseline95 = min(med["roaring_and_exact_scan"], med["faiss_ivfsq8_bitmap_recall_0.95"])
            routes = search_routes(SimpleNamespace(config=snap.config, index=module), qt, k, ours_nprobe, f)
            rows.append({"part": "conjunction", "n": n, "k": k, "filter": f, "fraction": frac, "recall": r_ours, "nprobe": ours_nprobe,
                         "faiss_nprobe": best[0], "faiss_recall": faiss_recall.get(best[0]), "faiss_nprobe_recall_0.95": at95,
                         "faiss_recall_by_nprobe": faiss_recall, "load_avg": os.getloadavg()[0],
                         "median_ms": med, "ratio_vs_best": med["silverrec"] / baseline,
                         "ratio_vs_best_faiss_recall_0.95": med["silverrec"] / baseline95, "routes": routes, "repeat": repeat})
            print(f"  k={k:4d} {frac:8.4%} silverrec {med['silverrec']:7.3f} ms (recall {r_ours:.3f}, {routes}) | roaring AND + exact "
                  f"{med['roaring_and_exact_scan']:7.3f} ms | faiss SQ8+bitmap at equal recall nprobe {best[0]:4d} "
                  f"(recall {faiss_recall.get(best[0], float('nan')):.3f}) {med['faiss_ivfsq8_bitmap']:8.3f} ms, at 0.95 nprobe {at95:4d} "
                  f"{med['faiss_ivfsq8_bitmap_recall_0.95']:8.3f} ms | ratio {rows[-1]['ratio_vs_best']:.2f} "
                  f"(vs Faiss at 0.95: {rows[-1]['ratio_vs_best_faiss_recall_0.95']:.2f})  [{f}]", flush=True)
    snap_dir.cleanup()
    return rows


def search_routes(snap, qt, k, nprobe, f) -> dict:
    """How the public search path routes a batch of one filter (predictor's estimate, then filter_plan)."""
    from silverrec.filtering.filter_program import compile_estimates
    from silverrec.retrieval.filtered_search import filter_plan, whole_pool_by_estimate

    plan, cfg, m = filter_plan(snap), snap.config, snap.index
    B = qt.shape[0]
    whole = whole_pool_by_estimate(compile_estimates([f] * B, plan), k, nprobe, m.num_items, m.nlist, m.match_factor, m.exact_cost_ratio)
    modes = torch.where(torch.from_numpy(whole), MODE_UNPROBED, MODE_AUTO)
    max_probe = max(nprobe, min(m.nlist, cfg["search"]["default_max_probe"]))  # as search_index
    with torch.inference_mode():
        probes, _, route = m.plan_probes(qt, list(compile_request([f] * B, plan)), modes, k, nprobe, max_probe)
    out = {name: int((route == r).sum()) for r, name in ROUTE_NAMES.items() if (route == r).any()}
    if (route == ROUTE_PROBED).any():
        out["mean_clusters_probed"] = float((probes[route == ROUTE_PROBED] >= 0).sum(dim=1).float().mean())
    return out


def cuda_setup(quick: bool, dev: torch.device):
    """The --device cuda benchmark's index, queries and filters (module docstring), shared with
    benchmarks/profile_cuda.py -> namespace(snap, qt, qd, xd, picked, masks, n, d, nlist, B)."""
    from types import SimpleNamespace

    from silverrec.publish.kmeans import kmeans
    from silverrec.serving.cuda_graphs import GraphedForward, capture_cuda_graph, capture_eager

    torch.set_num_threads(os.cpu_count() or 1)  # the CPU-side build and request compilation
    rng = np.random.default_rng(0)
    n, d, nlist, B = (200_000, 96, 256, 16) if quick else (1_000_000, 96, 1024, 16)
    x = gaussian_mixture(n, d, rng)
    feats = {}
    for name, card in CONJ_FEATURES.items():
        p = 1.0 / np.arange(1, card + 1) ** 0.7
        feats[name] = ([f"{name[0]}{i}" for i in range(card)], rng.choice(card, size=n, p=p / p.sum()).astype(np.int32))
    xt = torch.from_numpy(x)
    km = kmeans(xt, nlist, niter=10, seed=1, max_points_per_centroid=64)
    ivf = layout(xt, km.centroids, km.assignment)
    fwd = ForwardIndex.from_codes(feats)  # pool rows (item id == pool row)
    module, meta = filter_index(ivf, fwd.permute(ivf.row_to_item), BloomConfig(bits=512, hashes=7))
    root = search_model(module.eval()).to(dev)

    graphed = GraphedForward(root, capture=capture_cuda_graph if dev.type == "cuda" else capture_eager)

    def on_device(fn):  # the predictor's call, its request tensors moved to the device
        return lambda *a: fn(*[t.to(dev) if isinstance(t, torch.Tensor) else t for t in a])

    config = {
        "nlist": nlist, "default_nprobe": 16, "filter": meta,
        "search": {"default_max_probe": min(nlist, 128), "match_factor": module.match_factor, "exact_cost_ratio": module.exact_cost_ratio},
    }
    snap = SimpleNamespace(path="bench", module=on_device(root), index=module, config=config)
    # the forward replayed from CUDA graphs, as silverrec.load(path, device="cuda") serves it
    snap_graphed = SimpleNamespace(path="bench", module=on_device(graphed), index=module, config=config)
    q = x[rng.integers(0, n, B)] + 0.3 * rng.normal(size=(B, d)).astype(np.float32)
    qt, xd = torch.from_numpy(q), xt.to(dev)
    qd = qt.to(dev)
    family = conjunction_family(feats, n, rng)
    masks = {f: fwd.evaluate(f) for f in family}
    picked, seen = [], set()
    for f in sorted(family, key=lambda f: float(masks[f].float().mean())):
        frac = float(masks[f].float().mean())
        bucket = round(math.log10(max(frac, 1e-6)) * 2)
        if frac >= 5e-5 and bucket not in seen:
            seen.add(bucket)
            picked.append(f)
    return SimpleNamespace(snap=snap, snap_graphed=snap_graphed, qt=qt, qd=qd, xd=xd, picked=picked, masks=masks, n=n,
                           d=d, nlist=nlist, B=B)


def cuda_part(args, dev: torch.device) -> int:
    """The --device cuda benchmark (module docstring); writes filter_cuda[_quick].json."""
    from silverrec.retrieval.filtered_search import search_index

    c = cuda_setup(args.quick, dev)
    snap, qt, qd, xd, picked, masks, n, d, nlist, B = (c.snap, c.qt, c.qd, c.xd, c.picked, c.masks, c.n, c.d,
                                                       c.nlist, c.B)
    rows = []
    with torch.inference_mode():
        for k in (100, 4096):
            nprobe = 16 if k <= 100 else 256
            for f in picked:
                mask = masks[f].to(dev)
                frac = float(masks[f].float().mean())

                def floor(mask=mask, k=k):
                    return torch.topk((qd @ xd.T).masked_fill(~mask, float("-inf")), min(k, int(masks[f].sum())), dim=1)

                def ours(f=f, k=k, nprobe=nprobe, snap=snap):
                    return search_index(snap, qt, k, nprobe=nprobe, filter=f)

                def ours_graphed(f=f, k=k, nprobe=nprobe):
                    return ours(f, k, nprobe, c.snap_graphed)

                truth = [r[torch.isfinite(s)].cpu().numpy() for s, r in zip(*floor())]
                found = ours()[1].cpu().numpy()
                graphed_same = bool(np.array_equal(ours_graphed()[1].cpu().numpy(), found))
                t = cuda_alternate({"silverrec": ours, "silverrec_graphed": ours_graphed, "torch_masked_topk_floor": floor},
                                   5 if args.quick else 20)
                peak = peak_bytes(ours)
                rows.append({"k": k, "filter": f, "fraction": frac, "nprobe": nprobe, "recall": recall(found, truth),
                             "median_ms": {name: v["median_ms"] for name, v in t.items()}, "timing": t,
                             "ratio_floor_over_silverrec": t["torch_masked_topk_floor"]["median_ms"] / t["silverrec"]["median_ms"],
                             "ratio_floor_over_silverrec_graphed": t["torch_masked_topk_floor"]["median_ms"] / t["silverrec_graphed"]["median_ms"],
                             "graphed_items_equal_eager": graphed_same,
                             "peak_bytes": peak, "b_n_4_bytes": B * n * 4,
                             "peak_over_b_n_4": None if peak is None else peak / (B * n * 4)})
                r = rows[-1]
                print(f"k={k:4d} {frac:8.4%} silverrec {r['median_ms']['silverrec']:8.3f} ms (recall {r['recall']:.3f}) | "
                      f"graphed {r['median_ms']['silverrec_graphed']:8.3f} ms (same items: {graphed_same}) | "
                      f"masked topk floor {r['median_ms']['torch_masked_topk_floor']:8.3f} ms | ratio {r['ratio_floor_over_silverrec']:.2f} "
                      f"| peak {peak} B = {r['peak_over_b_n_4']} x B*N*4  [{f}]", flush=True)
    out = Path(__file__).parent / "results" / ("filter_cuda" + ("_quick" if args.quick else "") + ("_dry_run" if dev.type == "cpu" else "") + ".json")
    out.write_text(json.dumps({"gpu": cuda_info(), "n": n, "dim": d, "nlist": nlist, "batch": B, "rows": rows,
                               "reference": "exact filtered scores, mask precomputed on the device, torch.topk (a [B, N] floor)"}, indent=1))
    print(f"wrote {out}")
    replot(out.stem, plot)
    return 0


NOISY_SELECTIVITIES = (1e-4, 1e-3, 1e-2, 0.066, 0.2, 0.45, 0.7)  # the benchmark's filters (noisy_part)
FAISS_AT = 0.95  # noisy_part times Faiss at the smallest nprobe reaching min(our recall, this)


def noisy_part(n: int, queries: int, reps: int) -> dict:
    """The pool whose default probe is too shallow (benchmarks/noisy_pool.py, three categorical features),
    published with the defaults; filters of the pool's own values at NOISY_SELECTIVITIES (drawn with
    another seed than publish's calibration), each asked with the same held-out queries (fresh draws
    from the pool's mixture): recall@100 against the exact filtered answer of the default search before
    calibration (the fixed default nprobe and max_probe, as `--no-calibration` publishes them) and after
    (the calibrated defaults); Faiss IVF-SQ8 as a Faiss user builds it (`index_factory`, same nlist) with
    an IDSelectorBitmap of the filter's exact answer (built before timing, not timed) at the smallest
    nprobe reaching our calibrated recall or FAISS_AT, the lower (an exact route's recall, ~0.99, is
    out of its reach below a full scan); latency per batch of 16 alternated in blocks
    (ann.py `timed_alternating`)."""
    import tempfile

    from ann import FAISS_NPROBES, timed_alternating
    from noisy_pool import faiss_ivf_sq8, noisy_pool, publish_noisy, smallest_reaching
    from silverrec.publish.calibrate import exact_top, sample_filters
    from silverrec.publish.filtered_ivf import default_max_probe
    from silverrec.publish.ivf import default_nprobe

    k, B = 100, 16
    pool = noisy_pool(n)
    work = tempfile.TemporaryDirectory(prefix="filter-noisy-")
    snap, publish_s = publish_noisy(pool, Path(work.name) / "snap", features=True)
    cfg = snap.config
    nlist = int(cfg["nlist"])
    before = default_nprobe(nlist)
    before_opts = {"nprobe": before, "max_probe": default_max_probe(nlist, before)}
    print(f"[noisy {n:,}] published in {publish_s:.1f} s; default nprobe {before} -> {cfg['default_nprobe']}, "
          f"probe exponent {cfg['search']['probe_exponent']}, max probe factor {cfg['search']['max_probe_factor']}", flush=True)
    sq8, faiss_s = faiss_ivf_sq8(pool.x, nlist)
    q = torch.from_numpy(pool.queries(queries, seed=3))
    qn = q.numpy()
    filters = sample_filters(ForwardIndex.from_codes(pool.features), NOISY_SELECTIVITIES, seed=1)
    _, truths = exact_top(pool.x, q, k, [(torch.arange(queries), mask) for _, mask in filters])
    grid = [p for p in FAISS_NPROBES if p <= nlist]
    rows = []
    for (f, mask), truth in zip(filters, truths):
        truth = truth.numpy()
        allowed = [set(t[t >= 0].tolist()) for t in truth]
        bits = np.packbits(mask.numpy(), bitorder="little")
        sel = faiss.IDSelectorBitmap(n, faiss.swig_ptr(bits))

        def faiss_search(b, p):
            return sq8.search(b, k, params=faiss.SearchParametersIVF(sel=sel, nprobe=p))[1]

        def rec(found):
            return float(np.mean([len(set(fi[fi >= 0].tolist()) & a) / max(1, len(a)) for fi, a in zip(found, allowed)]))

        def ours(**opts):
            return rec(np.concatenate([snap.search(q[i:i + B], k, filter=f, **opts).item_ids.numpy()
                                       for i in range(0, queries, B)]))

        r_after, r_before = ours(), ours(**before_opts)
        p, r_faiss, seen = smallest_reaching(lambda p: rec(faiss_search(qn, p)), grid, min(r_after, FAISS_AT))
        fns = {"after": lambda b: snap.search(b, k, filter=f), "before": lambda b: snap.search(b, k, filter=f, **before_opts),
               "faiss": lambda b: faiss_search(b.numpy(), p)}
        with torch.inference_mode():
            _, lat = timed_alternating(fns, [q[i:i + B] for i in range(0, 2 * B, B)], reps)
        row = {"part": "noisy", "n": n, "k": k, "filter": f, "selectivity": float(mask.double().mean()),
               "recall_before": r_before, "recall_after": r_after, "ms_before": lat["before"], "ms_after": lat["after"],
               "faiss_nprobe": p, "faiss_recall": r_faiss, "faiss_ms": lat["faiss"], "faiss_sweep": seen,
               "latency_ratio": lat["after"]["median"] / lat["faiss"]["median"]}
        rows.append(row)
        print(f"  {row['selectivity']:>8.4%}: recall before {r_before:.4f} ({lat['before']['median']:.2f} ms), after "
              f"{r_after:.4f} ({lat['after']['median']:.2f} ms) | Faiss IVF-SQ8 nprobe {p} {r_faiss:.4f} "
              f"({lat['faiss']['median']:.2f} ms), ratio {row['latency_ratio']:.2f}  {f}", flush=True)
    worst = min(r["recall_after"] for r in rows)
    print(f"[{'met' if worst >= 0.95 else 'NOT met'}] defaults only: filtered recall@100 >= 0.95 at every selectivity "
          f"({min(r['selectivity'] for r in rows):.4%} .. {max(r['selectivity'] for r in rows):.0%}): worst {worst:.4f}")
    return {"n": n, "nlist": nlist, "publish_s": publish_s, "faiss_build_s": faiss_s, "queries": queries,
            "calibration": cfg["calibration"], "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200k items, fewer settings")
    ap.add_argument("--skip-10m", action="store_true")
    ap.add_argument("--part", choices=["all", "conjunctions", "noisy"], default="all",
                    help="conjunctions: only part C (1M x 96, or 200k with --quick); noisy: the calibrated defaults "
                         "on a noisy long-tailed pool (`noisy_part`, 1M x 96 or 200k)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (module docstring)")
    ap.add_argument("--name", default=None, help="results file stem (default: filter_conj / filter / their _quick forms), "
                    "e.g. for a run under another OMP_WAIT_POLICY")
    args = ap.parse_args(argv)
    if args.device != "cpu":
        return cuda_part(args, require_device(args.device))
    if faiss is None:
        raise SystemExit(f"the CPU filter benchmark needs faiss-cpu and pyroaring (pip install faiss-cpu pyroaring): {_MISSING}")
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    rng = np.random.default_rng(0)
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0]},
        "versions": {"torch": torch.__version__, "faiss": faiss.__version__, "pyroaring": pyroaring.__version__, "silverrec": silverrec.__version__},
        "mix": MIX, "selective": SELECTIVE, "features": FEATURES, "rows": [],
        "env": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY")},
    }
    if args.part == "noisy":
        noisy = noisy_part(200_000 if args.quick else 1_000_000, 256, 3 if args.quick else 10)
        results["rows"] += noisy.pop("rows")
        results["noisy"] = noisy
        out = Path(__file__).parent / "results" / f"{args.name or ('filter_noisy_quick' if args.quick else 'filter_noisy')}.json"
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
        replot(out.stem, plot)
        return 0
    if args.part == "conjunctions":
        n = 200_000 if args.quick else 1_000_000
        results["rows"] += conjunction_part(n, 96, 256 if args.quick else 1024, [100, 4096], rng, 5 if args.quick else 15)
        out = Path(__file__).parent / "results" / f"{args.name or ('filter_conj_quick' if args.quick else 'filter_conj')}.json"
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
        replot(out.stem, plot)
        return 0
    if args.quick:
        results["rows"] += filter_part(200_000, [512, 0], [1, 16, 64], rng, nlist=1800, nprobe=32)
        results["rows"] += ann_part(200_000, 64, 512, [100, 4096], rng, 512)
    else:
        results["rows"] += filter_part(1_000_000, [512, 1024, 2048, 0], [1, 4, 16, 64], rng, nlist=4000, nprobe=32)
        if not args.skip_10m:
            results["rows"] += filter_part(10_000_000, [512], [1, 16, 64], rng, nlist=12600, nprobe=32)
        results["rows"] += ann_part(1_000_000, 64, 1024, [100, 4096], rng, 512)
    out = Path(__file__).parent / "results" / f"{args.name or ('filter_quick' if args.quick else 'filter')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    replot(out.stem, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Whichever parts the results hold: filter evaluation alone (Bloom vs roaring vs forward index),
    filtered ANN (recall vs latency per system), conjunctions (latency vs selectivity), CUDA (eager,
    graphed and the masked floor vs selectivity)."""
    rows, panels = payload["rows"], []
    noisy = [r for r in rows if r.get("part") == "noisy"]
    if noisy:
        sels = [f"{r['selectivity']:.3%}" for r in noisy]
        panels.append(Panel(f"noisy pool {noisy[0]['n']:,} x 96: the defaults' misses", "filter selectivity",
                            "1 - recall@100 (held-out queries)",
                            {"before calibration": (sels, [1 - r["recall_before"] for r in noisy]),
                             "calibrated": (sels, [1 - r["recall_after"] for r in noisy]),
                             "Faiss IVF-SQ8 (timed point)": (sels, [1 - r["faiss_recall"] for r in noisy])},
                            kind="bar", logy=True, ref=0.05, ref_label="recall 0.95"))
        panels.append(Panel("latency per batch of 16", "filter selectivity", "ms (median)",
                            {"before calibration": (sels, [r["ms_before"]["median"] for r in noisy]),
                             "calibrated": (sels, [r["ms_after"]["median"] for r in noisy]),
                             "Faiss IVF-SQ8 at min(our recall, 0.95)": (sels, [r["faiss_ms"]["median"] for r in noisy])},
                            kind="bar", logy=True))
    evals = [r for r in rows if r.get("part") == "filter"]
    if evals:
        cat = lambda r: f"{r['n'] / 1e6:g}M, M {r['M']}, batch {r['batch']}"  # noqa: E731
        panels.append(Panel("filter evaluation alone", "pool, Bloom bits, batch", "ms per batch (median)",
                            {name.replace("_", " "): ([cat(r) for r in evals if r.get(name)], [r[name]["median_ms"] for r in evals if r.get(name)])
                             for name in ("bloom_whole_pool", "bloom_probed", "roaring_whole_pool", "forward_index")},
                            kind="barh", logy=True))
    ann = [r for r in rows if r.get("part") == "ann"]
    for sel, k in dict.fromkeys((r["selectivity"], r["k"]) for r in ann):
        pts = [r for r in ann if r["selectivity"] == sel and r["k"] == k]
        systems = dict.fromkeys(r["system"] for r in pts)
        panels.append(Panel(f"filtered ANN, {pts[0]['n']:,} items, filter {sel} ({pts[0]['fraction']:.2%}), k {k}",
                            "ms per batch (median)", f"recall@{k}",
                            {s: ([r["median_ms"] for r in pts if r["system"] == s], [r["recall"] for r in pts if r["system"] == s])
                             for s in systems}, logx=True))
    conj = [r for r in rows if r.get("part") == "conjunction"]
    for k in dict.fromkeys(r["k"] for r in conj):
        pts = sorted((r for r in conj if r["k"] == k), key=lambda r: r["fraction"])
        x = [r["fraction"] * 100 for r in pts]
        panels.append(Panel(f"ANDs of frequent values, {pts[0]['n']:,} items, k {k}", "items passing the filter, %",
                            "ms per batch of 16 (median)",
                            {"silverrec (snap.search)": (x, [r["median_ms"]["silverrec"] for r in pts]),
                             "roaring AND + exact scan": (x, [r["median_ms"]["roaring_and_exact_scan"] for r in pts]),
                             "Faiss IVF-SQ8 + bitmap, equal recall": (x, [r["median_ms"]["faiss_ivfsq8_bitmap"] for r in pts])},
                            logx=True, logy=True))
    if conj:
        panels.append(Panel("silverrec time / best peer time at equal recall (< 1: faster)", "items passing the filter, %",
                            "ratio", {f"k {k}": ([r["fraction"] * 100 for r in sorted(conj, key=lambda r: r["fraction"]) if r["k"] == k],
                                                 [r["ratio_vs_best"] for r in sorted(conj, key=lambda r: r["fraction"]) if r["k"] == k])
                                      for k in dict.fromkeys(r["k"] for r in conj)}, logx=True, ref=1.0))
    cuda = [r for r in rows if "ratio_floor_over_silverrec" in r]
    for k in dict.fromkeys(r["k"] for r in cuda):
        pts = sorted((r for r in cuda if r["k"] == k), key=lambda r: r["fraction"])
        x = [r["fraction"] * 100 for r in pts]
        panels.append(Panel(f"k {k}", "items passing the filter, %", "ms per batch (median, CUDA events)",
                            {name: (x, [r["median_ms"][name] for r in pts]) for name in pts[0]["median_ms"]},
                            logx=True, logy=True))
    if "gpu" in payload:
        title = f"filtered search on {payload['gpu'].get('gpu')}, {payload['n']:,} x {payload['dim']}, batch {payload['batch']}"
    else:
        env = ", ".join(f"{k}={v}" for k, v in (payload.get("env") or {}).items() if v)
        title = f"filtered search on the CPU ({payload.get('machine', {}).get('cores')} cores{', ' + env if env else ''})"
    save_plot(path, panels, title)


if __name__ == "__main__" and not plot_only(plot, "filter"):
    sys.exit(main())
