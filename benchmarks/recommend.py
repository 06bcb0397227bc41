"""End-to-end recommendation benchmark, one process: silverrec's one forward (`snap.recommend`) vs a
service-style pipeline of separate libraries doing the same steps; early-stage ranking from the
embedding cache vs recomputing the item tower; snapshot bytes per item.

    .venv/bin/python benchmarks/recommend.py                      # trains ~1.5 min on MovieLens, ~6 min in all
    .venv/bin/python benchmarks/recommend.py --checkpoint C.ckpt  # reuse a checkpoint (skips training)
    .venv/bin/python benchmarks/recommend.py --quick              # small training, fewer repeats, 1k/10k ranking, ~2 min

1. End to end, batch 1 / 16 / 64 requests of real MovieLens users (their whole training history,
   excluded from the answer), unfiltered and with FILTER. silverrec: `snap.recommend(requests, k=10)`
   on a published snapshot (torch.export program: int8 user tower -> filtered int8 IVF, K0 per task
   -> merge -> bf16 cache re-score -> OverArch pair score on its cached item side -> value model
   -> top-k; with --transitions M, the newest history row's M successors join the candidates and the
   value gains w * P, publish/transitions.py). Pipeline, with the copies
   between the libraries: id -> row lookup, `FeatureEncoder` + the float `UserTower` (eager, the
   same checkpoint) -> numpy -> Faiss `IndexIVFScalarQuantizer` SQ8 (inner product, the snapshot's
   nlist and nprobe, trained on the same item embeddings), K0 + the snapshot's overfetch per task,
   as silverrec asks -> per request and task: drop -1 and the newest exclude_limit history rows, best K0 by the task's exact float re-score; union of the tasks rank by rank, at most CANDIDATES (silverrec's K1) -> numpy gather of float embeddings + dense features -> torch
   OverArch (same weights) -> value formula in numpy (with --transitions: the same chain looked up per
   request, its successors filtered, excluded and merged, value + w * P) -> top-k. The filter: one pyroaring bitmap per
   (feature, value), built once; each call parses the request's filter and evaluates it by bitmap
   AND / OR / ANDNOT (once per distinct filter string of the batch), converts it into a Faiss
   `IDSelectorBitmap`, and probes nprobe / selectivity clusters (at most the snapshot's
   max_probe: what silverrec's selectivity-aware "auto" mode does), so both sides return K0
   filtered candidates per task. Agreement: top-10 overlap between the two sides and of each side
   with an exact reference (the pipeline with float brute-force retrieval).
2. Early-stage ranking of 1k / 10k / 100k / 200k items for one user, two pools:
   - MovieLens (9,742 items): `snap.rank(request, item_ids)` with item ids drawn with replacement
     (so 100k / 200k repeat items and the lookups stay in a 9,742-row table), against the checkpoint's
     item tower recomputed for the same ids + the same OverArch + the value formula.
   - synthetic 200k-item pool, distinct rows: an `ItemTower` over `UserFeatureSpec(num_items=200_000)`
     with the trained feature tables and MLP and a random item-id table (std of the trained one),
     item features and dense features copied from random MovieLens items; silverrec side =
     `EmbeddingCache` of its outputs + `RecModel.rank`'s stages (eager: cache gather + re-score,
     OverArch's pair score on the cached item side, compiled value model), pipeline side = that
     tower's forward on the rows + the same OverArch, whole + value. Both sides include the same
     float user tower.
   Also the embedding step alone (what the cache replaces: the embedding and feature lookups
   `rank` runs, `EmbeddingCache.lookup` without the OverArch's cached item side, vs the item
   tower's forward + the dense gather; the full `lookup` with that item side, and the masked
   `EmbeddingCache.gather`, beside it) and the whole OverArch alone. The
   target (cache >= 10x faster than recomputing the item tower at 10k items) is checked
   on the synthetic pool, both for the whole rank and for the embedding step alone.
3. Bytes per item by part (manifest `bytes_per_item`) and the int8 user tower against fp32
   (manifest `quantization_user_tower`), beside the pipeline's own stores.
4. With --other-checkpoint (a checkpoint of the other user tower, `user_tower = "sequence"` or
   `"bag"`): both snapshots' `recommend` end to end at batch 1 and 16, unfiltered, alternated call
   by call on the same requests (`towers` rows: `ratio` = this checkpoint's tower / the other's).

The two-tower model trains with `--tower` (default "bag", the default user tower; `silverrec train`'s
user_tower): the pipeline runs the same user tower, eager.

Timing: the two sides alternate call by call (A B B A ...) so that the load of this shared
machine falls on both alike (benchmarks/common.py's `alternate`); warm-up
calls excluded; median with p20 / p80 per side; `ratio` = pipeline median / silverrec median (> 1:
silverrec faster), `paired_ratio` = median of the per-round ratios. silverrec runs its forward with
`recommend(threads="auto")`: one thread up to batch 16 under PASSIVE, at batch 1 only under
--omp-default (serving/recommend.py's ONE_THREAD_MAX_BATCH); the pipeline runs on the process's 2
threads and, alternated with both, on one thread (torch and Faiss): `ratio_vs_pipeline_best` takes
the faster of the pipeline's two. `silverrec_process_threads_ms`: silverrec with threads=None (the
process's 2 threads).

Writes benchmarks/results/recommend.json and recommend.png (recommend_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
# sleep-waiting OpenMP threads on a shared 2-core machine (see ann.py), as `silverrec serve` and the
# CLI run (silverrec/threads.py); before torch / faiss load. --omp-default leaves OpenMP's default
# (spin a while, then sleep), what a Python process that loads torch before silverrec gets: both
# sides then run under it (PASSIVE wakes a sleeping thread for each parallel op, which costs a
# ~300-op forward on 2 threads ~45% at batch 16)
OMP_DEFAULT = "--omp-default" in sys.argv
if not OMP_DEFAULT:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import pyroaring  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

import silverrec  # noqa: E402
from silverrec.filtering.filter_lang import And, Not, Or, Term, parse  # noqa: E402
from silverrec.publish.movielens import write_logs  # noqa: E402
from silverrec.publish.rec import PublishConfig, publish_rec  # noqa: E402
from silverrec.publish.transitions import transition_tables  # noqa: E402
from silverrec.publish.train import TrainConfig, load_checkpoint, rebuild_item_tower, rebuild_user_tower, train  # noqa: E402
from silverrec.publish.two_tower import ItemTower  # noqa: E402
from silverrec.ranking.cache import EmbeddingCache  # noqa: E402
from silverrec.ranking.overarch import overarch_from_config  # noqa: E402
from silverrec.ranking.value_model import compile_value_model  # noqa: E402
from silverrec.candidates import rows_only  # noqa: E402
from silverrec.ranking.stages import PairOverArch, RowOverArch, ValueStage  # noqa: E402
from silverrec.retrieval.item_ids import ItemRows  # noqa: E402
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec  # noqa: E402

FILTER = "genre = Comedy AND NOT decade = '1990s'"
TASKS = [{"name": "interacted"}, {"name": "liked", "label": "rating", "min": 4.0}]
VALUE_MODEL = {"weights": {"interacted": 1.0, "liked": 0.5}}
OVERARCH = "mol"
CANDIDATES = 256  # K1, as the demo publishes: the tasks' union (mean 245, p90 279 on MovieLens) capped rank by rank
K = 10
K0 = 200
BATCHES = (1, 16, 64)
RANK_SIZES = (1_000, 10_000, 100_000, 200_000)
SYNTH_ITEMS = 200_000
CHECKPOINTS = Path(__file__).resolve().parents[1] / "out" / "bench_recommend"


# ------------------------------------------------------------------------------- the pipeline


class RoaringFilter:
    """One roaring bitmap per (feature, value) over pool rows; a filter AST evaluated by bitmap
    AND / OR / ANDNOT (NOT alone = complement in [0, N))."""

    def __init__(self, item_features: dict[str, list], n: int):
        rows: dict[tuple[str, str], list[int]] = {}
        for f, lists in item_features.items():
            for r, vals in enumerate(lists):
                for v in [vals] if isinstance(vals, str) else vals:
                    rows.setdefault((f, str(v)), []).append(r)
        self.maps = {key: pyroaring.BitMap(np.asarray(r, dtype=np.uint32)) for key, r in rows.items()}
        self.universe = pyroaring.BitMap(np.arange(n, dtype=np.uint32))
        self.n = n

    def bytes(self) -> int:
        return sum(len(m.serialize()) for m in self.maps.values())

    def evaluate(self, node) -> pyroaring.BitMap:
        if isinstance(node, Term):
            maps = [self.maps[(node.feature, v)] for v in node.values if (node.feature, v) in self.maps]
            return pyroaring.BitMap.union(*maps) if maps else pyroaring.BitMap()
        if isinstance(node, Not):
            return self.universe - self.evaluate(node.child)
        if isinstance(node, Or):
            return pyroaring.BitMap.union(*[self.evaluate(c) for c in node.children])
        assert isinstance(node, And)
        pos = [self.evaluate(c) for c in node.children if not isinstance(c, Not)]
        out = pyroaring.BitMap.intersection(*pos) if pos else self.universe.copy()
        for c in node.children:
            if isinstance(c, Not):
                out = out - self.evaluate(c.child)  # ANDNOT
        return out


class Pipeline:
    """The service-style pipeline (see the module docstring). `retrieval="exact"` swaps Faiss for
    float brute force with the exact filter: the reference both sides are compared with."""

    def __init__(self, ckpt: dict, manifest: dict):
        self.item_ids = ckpt["item_ids"].numpy().astype(np.int64)
        self.item_rows = ItemRows(self.item_ids)  # a dense id -> row table, as silverrec's request encoder (kernels/csrc/request.h) keeps
        self.spec = UserFeatureSpec.from_json(ckpt["spec"])
        self.encoder = FeatureEncoder(self.spec, ckpt["item_features"])
        self.user_tower = rebuild_user_tower(ckpt)
        entry = ckpt["overarch"][OVERARCH]
        self.overarch = overarch_from_config(OVERARCH, entry["config"])
        self.overarch.load_state_dict(entry["state"])
        self.overarch.eval()
        self.emb = np.ascontiguousarray(ckpt["item_embeddings"].numpy().astype(np.float32))
        self.dense = np.ascontiguousarray(ckpt["item_dense"].numpy().astype(np.float32))
        self.n, self.d = self.emb.shape
        self.tasks = [t["name"] for t in ckpt["tasks"]]
        self.w = np.asarray([VALUE_MODEL["weights"].get(t, 0.0) for t in self.tasks], dtype=np.float32)
        self.nlist = int(manifest["nlist"])
        self.nprobe = int(manifest["default_nprobe"])
        self.max_probe = int(manifest["search"]["default_max_probe"])
        self.exclude_limit = int(manifest["exclude_limit"])
        self.overfetch = int(manifest["spec"]["overfetch"])
        t0 = time.perf_counter()
        quant = faiss.IndexFlatIP(self.d)
        self.index = faiss.IndexIVFScalarQuantizer(quant, self.d, self.nlist, faiss.ScalarQuantizer.QT_8bit,
                                                   faiss.METRIC_INNER_PRODUCT)
        self.index.cp.min_points_per_centroid = 1  # 9,742 points for 395 lists: no "too few points" warning
        self.index.train(self.emb)
        self.index.add(self.emb)
        self.index.nprobe = self.nprobe
        self._quant = quant
        self.roaring = RoaringFilter(ckpt["item_features"], self.n)
        self.build_seconds = time.perf_counter() - t0
        self.candidates: list[float] = []  # mean OverArch candidates per request, per call (silverrec: CANDIDATES slots)
        # the next-item transitions' service, where the snapshot has them: the same chain over pool rows, the
        # snapshot's weight (a key-value lookup of the newest history row's successors)
        self.chain = None
        if manifest.get("transitions"):
            offsets = np.asarray(ckpt["users"]["offsets"], dtype=np.int64)
            rows = self.item_rows.rows_or_minus_one(np.asarray(ckpt["users"]["item_ids"], dtype=np.int64))
            t = manifest["transitions"]
            nxt, prob = transition_tables(offsets, rows, self.n, int(t["per_item"]), int(t["window"]), float(t["decay"]))
            self.chain = (nxt.numpy(), prob.numpy().astype(np.float32), float(manifest["transitions"]["weight"]))

    def rows(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        rows = self.item_rows.rows_or_minus_one(ids)
        if (rows < 0).any():
            raise KeyError(f"unknown item id {int(ids[rows < 0][0])}")
        return rows

    def user(self, histories: list[np.ndarray]) -> torch.Tensor:
        with torch.inference_mode():
            return self.user_tower(*self.encoder.encode(histories))  # [B, T, D]

    def retrieve(self, q: np.ndarray, k: int, filt: str | None, exact: bool) -> np.ndarray:
        """q float32 [Q, D] -> pool rows int64 [Q, k], -1 = none."""
        bm = None if filt is None else self.roaring.evaluate(parse(filt))
        if exact:
            s = q @ self.emb.T
            if bm is not None:
                allowed = np.zeros(self.n, dtype=bool)
                allowed[np.frombuffer(bm.to_array(), dtype=np.uint32)] = True
                s[:, ~allowed] = -np.inf
            kk = min(k, self.n)
            top = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
            return np.where(np.isfinite(np.take_along_axis(s, top, 1)), top, -1)
        if bm is None:
            return self.index.search(q, k)[1]
        bits = np.zeros(self.n, dtype=bool)
        bits[np.frombuffer(bm.to_array(), dtype=np.uint32)] = True
        packed = np.packbits(bits, bitorder="little")
        frac = max(len(bm), 1) / self.n
        nprobe = min(self.max_probe, max(self.nprobe, math.ceil(self.nprobe / frac)))
        sel = faiss.IDSelectorBitmap(self.n, faiss.swig_ptr(packed))
        return self.index.search(q, k, params=faiss.SearchParametersIVF(sel=sel, nprobe=nprobe))[1]

    def recommend(self, requests: list[dict], k: int = K, exact: bool = False) -> np.ndarray:
        """-> item ids int64 [B, k] (-1 = none)."""
        B, T = len(requests), len(self.tasks)
        hist = [self.rows(r["history"]) for r in requests]
        u = self.user(hist)
        un = np.ascontiguousarray(u.numpy())  # torch -> numpy
        q = un.reshape(B * T, self.d)
        excl = [newest_unique(h, self.exclude_limit) for h in hist]  # what silverrec excludes
        kk = K0 + self.overfetch
        found = np.full((B * T, kk), -1, dtype=np.int64)
        groups: dict[str | None, list[int]] = {}
        for b, r in enumerate(requests):
            groups.setdefault(r.get("filter"), []).append(b)
        for filt, bs in groups.items():
            qrows = (np.asarray(bs)[:, None] * T + np.arange(T)).reshape(-1)
            found[qrows] = self.retrieve(q[qrows], kk, filt, exact)
        # each task's best K0 by its own exact re-score, best first: one batched re-score of every
        # (request, task) list, missing and excluded rows at -inf (the exclusions are per request)
        ok = found >= 0
        for b in range(B):
            ok[b * T:(b + 1) * T] &= ~np.isin(found[b * T:(b + 1) * T], excl[b])
        s = np.matmul(self.emb[found.clip(min=0)], q[:, :, None])[:, :, 0]  # [B*T, kk]
        s[~ok] = -np.inf
        best = np.argsort(-s, axis=1, kind="stable")[:, :K0]
        per_task = np.where(np.take_along_axis(ok, best, 1), np.take_along_axis(found, best, 1), -1).reshape(B, T, -1)
        cands = []
        for b in range(B):
            # the union rank by rank (every task's first row, then every second, ...), each row once,
            # at most CANDIDATES: what silverrec's merge ranks
            inter = per_task[b].T.reshape(-1)
            inter = inter[inter >= 0]
            cands.append(inter[np.sort(np.unique(inter, return_index=True)[1])][:CANDIDATES])
        probs = [np.zeros(c.size, dtype=np.float32) for c in cands]
        if self.chain is not None:  # the newest history row's successors: filtered, not excluded, not found
            nxt, prob, _ = self.chain
            passing: dict[str, pyroaring.BitMap] = {}  # once per distinct filter of the batch
            for b, r in enumerate(requests):
                if not hist[b].size:
                    continue
                succ, p = nxt[hist[b][-1]], prob[hist[b][-1]]
                probs[b] = (cands[b][:, None] == succ[None, :]).astype(np.float32) @ p
                keep = (succ >= 0) & ~np.isin(succ, excl[b]) & ~np.isin(succ, cands[b])
                if r.get("filter") is not None:
                    bm = passing.setdefault(r["filter"], self.roaring.evaluate(parse(r["filter"])))
                    keep &= np.fromiter((j >= 0 and int(j) in bm for j in succ), dtype=bool, count=succ.size)
                cands[b] = np.concatenate([cands[b], succ[keep]])
                probs[b] = np.concatenate([probs[b], p[keep]])
        self.candidates.append(float(np.mean([c.size for c in cands])))
        C = max(k, max(c.size for c in cands))
        cand = np.full((B, C), -1, dtype=np.int64)
        chain_p = np.zeros((B, C), dtype=np.float32)
        for b, c in enumerate(cands):
            cand[b, : c.size] = c
            chain_p[b, : c.size] = probs[b]
        valid = cand >= 0
        idx = cand.clip(min=0)
        ce = self.emb[idx] * valid[:, :, None]  # numpy gathers
        cf = self.dense[idx] * valid[:, :, None]
        with torch.inference_mode():
            scores = self.overarch(u, torch.from_numpy(ce), torch.from_numpy(cf)).numpy()  # [B, C, T]
        value = np.where(valid, scores @ self.w, -np.inf)
        if self.chain is not None:
            value = value + self.chain[2] * chain_p
        top = np.argpartition(-value, k - 1, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(value, top, 1), axis=1, kind="stable"), 1)
        rows = np.take_along_axis(cand, top, 1)
        ok = np.isfinite(np.take_along_axis(value, top, 1)) & (rows >= 0)
        return np.where(ok, self.item_ids[rows.clip(min=0)], -1)

    def rank_recompute(self, tower: ItemTower, dense: np.ndarray, request: dict, rows: np.ndarray,
                       ids_to_rows: bool) -> np.ndarray:
        """Early-stage ranking by recomputing the item tower: values float32 [C] (+ w P(row | the newest
        history row) with the snapshot's transitions, rows of the pool: ids_to_rows)."""
        hist = self.rows(request["history"])
        u = self.user([hist])
        r = self.rows(rows) if ids_to_rows else rows
        with torch.inference_mode():
            v = tower(torch.from_numpy(r))[None]  # [1, C, D]
            scores = self.overarch(u, v, torch.from_numpy(dense[r])[None]).numpy()
        value = scores[0] @ self.w
        if self.chain is not None and ids_to_rows and hist.size:
            nxt, prob, w = self.chain
            succ, p = nxt[hist[-1]], prob[hist[-1]]
            value = value + w * ((r[:, None] == succ[None, :]).astype(np.float32) @ p)
        return value


@contextlib.contextmanager
def one_thread():
    """torch and Faiss on one thread inside the block (the pipeline's side of silverrec's small-batch
    setting, RecHandler.recommend threads="auto"); both restored after it."""
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        faiss.omp_set_num_threads(before[1])


def newest_unique(rows: np.ndarray, limit: int) -> np.ndarray:
    """The newest `limit` distinct rows of a history (oldest first): silverrec's exclusion slots."""
    rev = rows[::-1]
    first = np.sort(np.unique(rev, return_index=True)[1])
    return rev[first][:limit]


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / K for x, y in zip(a, b)]))


# ------------------------------------------------------------------------------------ the parts


def end_to_end(snap, pipe: Pipeline, users: list[list[int]], repeats: dict[int, int]) -> list[dict]:
    rows = []
    for filt in (None, FILTER):
        for B in BATCHES:
            nb = repeats[B]
            batches = [[{"history": users[(i * B + j) % len(users)]} | ({"filter": filt} if filt else {})
                        for j in range(B)] for i in range(nb)]
            state = {"ours": 0, "theirs": 0}  # each side walks through the same batches in the same order

            def ours():
                batch = batches[state["ours"] % nb]
                state["ours"] += 1
                return snap.recommend(batch, k=K)

            def theirs():
                batch = batches[state["theirs"] % nb]
                state["theirs"] += 1
                return pipe.recommend(batch, k=K)

            def theirs_one_thread():  # the pipeline with silverrec's small-batch thread setting (fairness check)
                batch = batches[state["theirs1"] % nb]
                state["theirs1"] += 1
                with one_thread():
                    return pipe.recommend(batch, k=K)

            def ours_process_threads():  # silverrec on the process's 2 threads (what threads="auto" chose against)
                batch = batches[state["ours2"] % nb]
                state["ours2"] += 1
                return snap.recommend(batch, k=K, threads=None)

            state["theirs1"] = state["ours2"] = 0
            t_ours, t_pipe, t_pipe1, t_ours2 = alternate([ours, theirs, theirs_one_thread, ours_process_threads], nb,
                                                         warmup=2)
            a = np.concatenate([snap.recommend(bt, k=K).item_ids.numpy() for bt in batches])
            pipe.candidates.clear()
            p = np.concatenate([pipe.recommend(bt, k=K) for bt in batches])
            cand = float(np.mean(pipe.candidates))
            x = np.concatenate([pipe.recommend(bt, k=K, exact=True) for bt in batches])
            row = {
                "part": "end_to_end", "filter": filt or "none", "batch": B, "requests_compared": int(a.shape[0]),
                "silverrec": t_ours, "pipeline": t_pipe, "pipeline_one_thread": t_pipe1,
                "silverrec_ms": t_ours["median_ms"], "pipeline_ms": t_pipe["median_ms"],
                "ratio": t_pipe["median_ms"] / t_ours["median_ms"], "paired_ratio": t_pipe["paired_ratio_median"],
                "pipeline_one_thread_ms": t_pipe1["median_ms"],
                "silverrec_process_threads": t_ours2, "silverrec_process_threads_ms": t_ours2["median_ms"],
                "ratio_vs_pipeline_best": min(t_pipe["median_ms"], t_pipe1["median_ms"]) / t_ours["median_ms"],
                "silverrec_qps": B / t_ours["median_ms"] * 1e3, "pipeline_qps": B / t_pipe["median_ms"] * 1e3,
                "pipeline_candidates_per_request": cand, "silverrec_candidate_slots": CANDIDATES,
                "top10_overlap": overlap(a, p), "silverrec_vs_exact": overlap(a, x), "pipeline_vs_exact": overlap(p, x),
            }
            rows.append(row)
            print(f"  {row['filter'][:14]:>14} B={B:2d}: silverrec {row['silverrec_ms']:8.2f} ms  pipeline {row['pipeline_ms']:8.2f} ms"
                  f"  ratio {row['ratio']:.2f} (silverrec threads=None {row['silverrec_process_threads_ms']:.2f} ms; "
                  f"pipeline on 1 thread {row['pipeline_one_thread_ms']:.2f} ms: ratio to the "
                  f"pipeline's best {row['ratio_vs_pipeline_best']:.2f})  top-10 overlap {row['top10_overlap']:.3f} (vs exact: silverrec "
                  f"{row['silverrec_vs_exact']:.3f}, pipeline {row['pipeline_vs_exact']:.3f})", flush=True)
    return rows


def towers_part(snap, other, users: list[list[int]], repeats: dict[int, int], kinds: tuple[str, str]) -> list[dict]:
    """`recommend` of two snapshots (two user towers) on the same requests, alternated: batch 1 and 16."""
    rows = []
    for B in BATCHES[:2]:
        nb = repeats[B]
        batches = [[{"history": users[(i * B + j) % len(users)]} for j in range(B)] for i in range(nb)]
        state = [0, 0]

        def call(which, s):
            def fn():
                batch = batches[state[which] % nb]
                state[which] += 1
                return s.recommend(batch, k=K)
            return fn

        t_a, t_b = alternate([call(0, snap), call(1, other)], nb, warmup=2)
        row = {"part": "towers", "batch": B, "tower": kinds[0], "other_tower": kinds[1], "silverrec": t_a, "other": t_b,
               "silverrec_ms": t_a["median_ms"], "other_ms": t_b["median_ms"], "ratio": t_a["median_ms"] / t_b["median_ms"],
               "paired_ratio": 1.0 / t_b["paired_ratio_median"]}
        rows.append(row)
        print(f"  B={B:2d}: {kinds[0]} tower {row['silverrec_ms']:.3f} ms, {kinds[1]} tower {row['other_ms']:.3f} ms, "
              f"ratio {row['ratio']:.2f} (paired {row['paired_ratio']:.2f})", flush=True)
    return rows


def synthetic_pool(ckpt: dict, n: int, rng) -> tuple[ItemTower, np.ndarray, torch.Tensor]:
    """(item tower over n synthetic items, dense float32 [n, F], embeddings float32 [n, D])."""
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    src = rng.integers(0, spec.num_items, n)  # every synthetic item copies a random MovieLens item's features
    feats = {f: [v[i] for i in src] for f, v in ckpt["item_features"].items()}
    synth = UserFeatureSpec(num_items=n, history_len=spec.history_len, recent_len=spec.recent_len,
                            item_vocabs=spec.item_vocabs)
    tower = ItemTower(synth, feats, **ckpt["item_tower_args"])
    state = dict(ckpt["item_tower"])
    table = "ebc.embedding_bags.item_id.weight"
    g = torch.Generator().manual_seed(1)
    state[table] = torch.randn(n, state[table].shape[1], generator=g) * float(state[table].std())
    for key in [k for k in state if k.startswith(("offsets_", "codes_"))]:
        state[key] = getattr(tower, key)  # the synthetic items' feature CSR
    tower.load_state_dict(state)
    tower.eval()
    emb = tower.embed_all(n)
    return tower, ckpt["item_dense"].numpy()[src].astype(np.float32), emb


def early_stage(snap, pipe: Pipeline, ckpt: dict, request: dict, sizes, repeats: int, rng) -> list[dict]:
    rows = []
    item_tower = rebuild_item_tower(ckpt)
    tasks = pipe.tasks
    names = ckpt["item_feature_names"]

    def rep(n):
        return repeats if n <= 10_000 else 3

    # (a) the MovieLens snapshot through the public API, ids drawn with replacement
    for n in sizes:
        ids = pipe.item_ids[rng.integers(0, pipe.n, n)]
        t_ours, t_pipe = alternate([lambda: snap.rank(request, item_ids=ids),
                                    lambda: pipe.rank_recompute(item_tower, pipe.dense, request, ids, True)], rep(n), warmup=1)
        rows.append({"part": "early_stage", "pool": "movielens_9742_ids_with_replacement", "what": "rank (user tower + embeddings + OverArch + value)",
                     "items": n, "silverrec": t_ours, "pipeline": t_pipe, "silverrec_ms": t_ours["median_ms"],
                     "pipeline_ms": t_pipe["median_ms"], "ratio": t_pipe["median_ms"] / t_ours["median_ms"],
                     "paired_ratio": t_pipe["paired_ratio_median"]})
        if n <= 10_000:  # agreement of the values (bf16 cache vs float recompute); skipped where a call takes seconds
            a = snap.rank(request, item_ids=ids).scores[0].numpy()
            b = pipe.rank_recompute(item_tower, pipe.dense, request, ids, True)
            rows[-1] |= {"max_abs_value_diff": float(np.abs(a - b).max()), "top100_overlap": _rank_agreement(a, b)}
        _print_rank(rows[-1])
    # (b) a synthetic pool of 200k distinct items, in-process modules
    t0 = time.perf_counter()
    n_syn = max(sizes)
    tower, dense, emb = synthetic_pool(ckpt, n_syn, rng)
    # as publish builds it: the OverArch's item side computed once per item, kept beside the embeddings
    cache = EmbeddingCache(emb, torch.from_numpy(dense), names).with_ranker(pipe.overarch.item_side)
    vm = compile_value_model(VALUE_MODEL, tasks, names)
    # RecModel.rank's stages over this cache: the OverArch stage and the value stage
    scores_stage = (RowOverArch if hasattr(pipe.overarch, "score_rows") else PairOverArch)(cache, pipe.overarch)
    value_stage = ValueStage(vm, cache)
    print(f"  synthetic pool of {n_syn:,} items built in {time.perf_counter() - t0:.1f}s", flush=True)
    hist = pipe.rows(request["history"])

    def ours_syn(r):
        u = pipe.user([hist])
        with torch.inference_mode():
            cand = rows_only(torch.from_numpy(r)[None])
            return value_stage(scores_stage(u, cand), cand)[0]

    for n in sizes:
        r = rng.choice(n_syn, n, replace=False).astype(np.int64)
        fns = [lambda: ours_syn(r), lambda: pipe.rank_recompute(tower, dense, request, r, False)]
        if n <= 10_000:  # where the time goes: the whole OverArch alone (item side + pair score, as the pipeline runs it)
            with torch.inference_mode():
                u1 = pipe.user([hist])
                e1, f1 = cache.gather(torch.from_numpy(r)[None])

            def overarch_alone():
                with torch.inference_mode():
                    return pipe.overarch(u1, e1, f1)

            fns.append(overarch_alone)
        t_ours, t_pipe, *t_oa = alternate(fns, rep(n), warmup=1)
        rows.append({"part": "early_stage", "pool": f"synthetic_{n_syn}_distinct_rows", "what": "rank (user tower + embeddings + OverArch + value)",
                     "items": n, "silverrec": t_ours, "pipeline": t_pipe, "silverrec_ms": t_ours["median_ms"],
                     "pipeline_ms": t_pipe["median_ms"], "ratio": t_pipe["median_ms"] / t_ours["median_ms"],
                     "paired_ratio": t_pipe["paired_ratio_median"]})
        if n <= 10_000:
            a = ours_syn(r).numpy()
            b = pipe.rank_recompute(tower, dense, request, r, False)
            rows[-1] |= {"max_abs_value_diff": float(np.abs(a - b).max()), "top100_overlap": _rank_agreement(a, b)}
        _print_rank(rows[-1])
        if t_oa:
            t_oa = t_oa[0]
            rows.append({"part": "early_stage", "pool": f"synthetic_{n_syn}_distinct_rows", "what": "whole OverArch alone (the pipeline's; silverrec runs only its pair score)",
                         "items": n, "silverrec": t_oa, "silverrec_ms": t_oa["median_ms"], "overarch": OVERARCH,
                         "share_of_silverrec_rank": t_oa["paired_ratio_median"]})
            print(f"  {'':>36} OverArch {OVERARCH} alone {n:>7,}: {t_oa['median_ms']:9.2f} ms "
                  f"({t_oa['paired_ratio_median']:.0%} of silverrec's rank; the pipeline runs it whole)", flush=True)
        # the embedding step alone: the cache lookups rank runs vs the item tower's forward (+ the
        # dense gather); the masked gather (zeros at padding, used by bring-your-own publishing) beside
        rt = torch.from_numpy(r)
        def item_tower_outputs():  # lookup's embeddings and features (rank's lookups of the item tower's outputs)
            return cache.embeddings(rt[None]), cache.features(rt[None])

        with torch.inference_mode():
            t_c, t_t, t_g, t_l = alternate([item_tower_outputs, lambda: (tower(rt), dense[r]),
                                            lambda: cache.gather(rt[None]), lambda: cache.lookup(rt[None])],
                                           rep(n), warmup=1)
        rows.append({"part": "early_stage", "pool": f"synthetic_{n_syn}_distinct_rows",
                     "what": "embeddings only (cache lookups of the item tower's outputs vs the item tower)",
                     "items": n, "silverrec": t_c, "pipeline": t_t, "silverrec_ms": t_c["median_ms"],
                     "pipeline_ms": t_t["median_ms"], "ratio": t_t["median_ms"] / t_c["median_ms"],
                     "paired_ratio": t_t["paired_ratio_median"],
                     "masked_gather": t_g, "ratio_tower_vs_masked_gather": t_t["median_ms"] / t_g["median_ms"],
                     "lookup_with_overarch_item_side": t_l})
        _print_rank(rows[-1])
        print(f"  {'':>36} masked EmbeddingCache.gather {n:>7,}: {t_g['median_ms']:9.2f} ms "
              f"(item tower / gather = {rows[-1]['ratio_tower_vs_masked_gather']:.1f}x); lookup with the "
              f"OverArch's item side {t_l['median_ms']:.2f} ms", flush=True)
    return rows


def _rank_agreement(a: np.ndarray, b: np.ndarray, k: int = 100) -> float:
    """Overlap of the top-k items by value of the two sides (positions in the given list)."""
    k = min(k, a.size)
    return len(set(np.argsort(-a)[:k].tolist()) & set(np.argsort(-b)[:k].tolist())) / k


def _print_rank(r: dict) -> None:
    print(f"  {r['pool'][:36]:>36} {r['what'][:12]:>12} {r['items']:>7,}: silverrec {r['silverrec_ms']:9.2f} ms  "
          f"recompute {r['pipeline_ms']:9.2f} ms  ratio {r['ratio']:6.2f}", flush=True)


def sizes_part(manifest: dict, pipe: Pipeline) -> list[dict]:
    cfg = manifest
    bpi = dict(cfg["bytes_per_item"])
    q = dict(cfg["quantization_user_tower"])
    n = pipe.n
    faiss_bytes = int(faiss.serialize_index(pipe.index).size)
    pipe_parts = {
        "faiss_ivf_sq8": round(faiss_bytes / n, 2),
        "roaring_bitmaps": round(pipe.roaring.bytes() / n, 2),
        "float_embeddings_and_dense": round((pipe.emb.nbytes + pipe.dense.nbytes) / n, 2),
        "user_tower_fp32": round(sum(t.numel() * t.element_size() for t in pipe.user_tower.state_dict().values()) / n, 2),
    }
    pipe_parts["total"] = round(sum(pipe_parts.values()), 2)
    row = {"part": "bytes", "items": n, "silverrec_bytes_per_item": bpi, "pipeline_bytes_per_item": pipe_parts,
           "user_tower": q, "user_tower_int8_vs_fp32": (q["int8_bytes"] / q["fp32_bytes"]) if "int8_bytes" in q else None}
    print("  silverrec bytes per item: " + ", ".join(f"{k} {v:.2f}" for k, v in bpi.items()))
    print("  pipeline  bytes per item: " + ", ".join(f"{k} {v:.2f}" for k, v in pipe_parts.items()))
    if "int8_bytes" in q:
        print(f"  user tower: {q['tables']} tables ({q['mlp']} MLP) in the snapshot; int8 {q['int8_bytes']:,} B vs fp32 "
              f"{q['fp32_bytes']:,} B = {q['int8_bytes'] / q['fp32_bytes']:.3f}x (top-100 overlap {q.get('int8_top100_overlap')}, "
              f"cosine {q.get('int8_cosine')})")
    return [row]


def plot(payload: dict, path: Path) -> None:
    """End-to-end latency per batch of both sides (median, p20-p80) and early-stage ranking against
    the items ranked; for `--sources` results, each retrieval source alone against the hybrid."""
    rows, panels = payload["rows"], []
    for filt in dict.fromkeys(r["filter"] for r in rows if r["part"] == "end_to_end"):
        e2e = [r for r in rows if r["part"] == "end_to_end" and r["filter"] == filt]
        series = {}
        for side, label in (("silverrec", "silverrec (one forward)"), ("pipeline", "pipeline (torch + Faiss + roaring + numpy)")):
            med = [r[side]["median_ms"] for r in e2e]
            series[label] = ([r["batch"] for r in e2e], med, [[m - r[side]["p20_ms"] for m, r in zip(med, e2e)],
                                                            [r[side]["p80_ms"] - m for m, r in zip(med, e2e)]])
        panels.append(Panel(f"end-to-end recommend, {'unfiltered' if filt == 'none' else 'filter ' + filt}", "batch (requests)",
                            "ms per batch (median, p20-p80)", series, logx=True, logy=True))
    early = {}
    for pool in ("movielens", "synthetic"):
        er = [r for r in rows if r["part"] == "early_stage" and r["pool"].startswith(pool) and r["what"].startswith("rank")]
        if er:
            early[f"cache + OverArch ({pool})"] = ([r["items"] for r in er], [r["silverrec_ms"] for r in er])
            early[f"item tower + OverArch ({pool})"] = ([r["items"] for r in er], [r["pipeline_ms"] for r in er])
    emb = [r for r in rows if r["part"] == "early_stage" and r["what"].startswith("embeddings")]
    if emb:
        early["embeddings only: cache lookup"] = ([r["items"] for r in emb], [r["silverrec_ms"] for r in emb])
        early["embeddings only: item tower"] = ([r["items"] for r in emb], [r["pipeline_ms"] for r in emb])
    if early:
        panels.append(Panel("early-stage ranking", "items ranked for one user", "ms (median)", early, logx=True, logy=True))
    for filt in dict.fromkeys(r["filter"] for r in rows if r["part"] == "sources"):
        src = [r for r in rows if r["part"] == "sources" and r["filter"] == filt]
        cats = [f"batch {r['batch']}" for r in src]
        panels.append(Panel(f"retrieval sources, {'unfiltered' if filt == 'none' else 'filter ' + filt}", "batch",
                            "ms per batch (median)", {"ANN only": (cats, [r["ann_ms"] for r in src]),
                                                      "generative only": (cats, [r["generative_ms"] for r in src]),
                                                      "hybrid (both, one forward)": (cats, [r["hybrid_ms"] for r in src])},
                            kind="bar", logy=True))
    threads = payload["config"].get("threads", 2)
    save_plot(path, panels, f"the recommendation model on MovieLens, CPU, {threads} threads")


# ------------------------------------------------------------------------------------------ main


def _git_state() -> dict:
    """The commit measured and the files of the code under test that differed from it (this checkout
    is shared with other engineers' uncommitted work)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=30).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "silverrec", "publish", "kernels").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes_in": dirty}


# ------------------------------------------------------------------ retrieval sources

SOURCE_BEAM = 64  # the decode's beam width in the hybrid benchmark (= its candidates per request)


class _DecodeOnly(torch.nn.Module):
    """The generative source alone, as the hybrid runs it: the filter program over the whole bank,
    the exclusions, the beam decode (silverrec/generative/source.py), rows -> item ids."""

    def __init__(self, model):
        super().__init__()
        self.decode = model.sources.decode  # the hybrid's DecodeSource

    def forward(self, exclude: torch.Tensor, vops: torch.Tensor, vrows: torch.Tensor, history: torch.Tensor):
        on = torch.ones_like(exclude[:, :1], dtype=torch.bool)
        rows, scores, _ = self.decode.candidates(history, vops, vrows, exclude, on, history[:, :0])  # no ANN rows to score
        return self.decode.row_to_item[rows.clamp_min(0)], scores


def sources_part(ckpt_path: Path, gen_ckpt_path: Path, users: list[list[int]], repeats: dict[int, int]) -> list[dict]:
    """ANN only (the one-source RecModel), generative only (filter + exclusions + decode) and hybrid
    (both, merged and ranked: the two-source RecModel) on the same requests, TorchScript, batch 1 and 16, without
    and with FILTER, alternated call by call. Target: hybrid <= 1.1 x (ANN only + generative only)."""
    import dataclasses

    from silverrec.compose import compose
    from silverrec.filtering.filter_program import compile_request
    from silverrec.generative.source import SOURCES, request_tensors
    from silverrec.publish.rec import build_rec_model
    from silverrec.publish.rec_files import scriptable
    from silverrec.serving.recommend import RecHandler, RecRequest

    pcfg = PublishConfig(checkpoint=str(ckpt_path), overarch=OVERARCH, value_model=VALUE_MODEL, k0=K0,
                         candidates=CANDIDATES, sources=list(SOURCES), generative_checkpoint=str(gen_ckpt_path),
                         beam_width=SOURCE_BEAM)
    built = build_rec_model(pcfg)
    hybrid = built.model
    plain = compose(built.spec.replace(sources=("ann",), generative_weight=0.0, source_priority="none"),
                    dataclasses.replace(built.parts, decode=None))
    programs = {"ann": scriptable(plain), "generative": torch.jit.script(_DecodeOnly(hybrid).eval()), "hybrid": scriptable(hybrid)}
    handler = RecHandler(built.manifest, hybrid, built.row_to_item, built.item_csr, built.users)
    cfg = built.manifest
    nprobe, max_probe = int(cfg["default_nprobe"]), max(int(cfg["default_nprobe"]), int(cfg["search"]["default_max_probe"]))
    rows = []
    for filt in (None, FILTER):
        for batch in (1, 16):
            reqs = [RecRequest(history=h, filter=filt) for h in users[:batch]]
            values, lengths, dense, exclude = handler.encode(reqs, True, int(cfg["exclude_limit"]))
            ops, prog, vops, vrows, lists = compile_request([filt] * batch, handler.plan)
            modes = torch.full((batch,), 1 if filt is None else 0, dtype=torch.int64)  # probed / auto, as the predictor
            history, flags = request_tensors([handler.rows(h, "history") for h in users[:batch]], [None] * batch, SOURCES)
            base = (values, lengths, dense, exclude, ops, prog, vops, vrows, lists, modes)
            ints = (K, K0, nprobe, max_probe)
            no_history, ann_on = torch.full((batch, 1), -1, dtype=torch.int64), torch.ones(batch, 2, dtype=torch.bool)
            calls = {
                "ann": lambda: programs["ann"](*base, no_history, ann_on, *ints),
                "generative": lambda: programs["generative"](exclude, vops, vrows, history),
                "hybrid": lambda: programs["hybrid"](*base, history, flags, *ints),
            }
            with torch.inference_mode():
                found = programs["hybrid"](*base, history, flags, *ints)[4]
                stats = alternate(list(calls.values()), repeats[batch], warmup=2)
            by = {name: s for name, s in zip(calls, stats)}
            both = by["ann"]["median_ms"] + by["generative"]["median_ms"]
            row = {"part": "sources", "filter": "none" if filt is None else filt, "batch": batch,
                   **{f"{name}_ms": round(s["median_ms"], 3) for name, s in by.items()},
                   "hybrid_over_sum": round(by["hybrid"]["median_ms"] / both, 3),
                   "found_by_in_top_k": {name: int(((found & bit) != 0).sum()) for name, bit in (("ann", 1), ("generative", 2))},
                   "stats": by, "load_1min": os.getloadavg()[0]}
            print(f"  {row['filter'][:20]:>20} batch {batch:>2}: ann {row['ann_ms']:.2f} ms, generative {row['generative_ms']:.2f} ms, "
                  f"hybrid {row['hybrid_ms']:.2f} ms = {row['hybrid_over_sum']:.2f} x (ann + generative); top-{K} found by "
                  f"{row['found_by_in_top_k']} (load {row['load_1min']:.1f})", flush=True)
            rows.append(row)
    return rows


def sources_quality(ckpt_path: Path, gen_ckpt_path: Path, logs: Path, seed: int = 0, batch: int = 32,
                    validation: tuple[Path, Path] | None = None) -> dict[str, dict]:
    """Leave-one-out HR / NDCG (stage test, full ranking, every known item excluded) of the hybrid
    model asked for ANN only, generative only and both (RecRequest.sources), one request per eval
    user as publish/quality.py serves them (`batch` per call, exclusion slots = the batch's longest
    history), on the logs and split (`seed`: the timestamp tie-break) both checkpoints trained on.
    `validation`: the stage-"valid" two-tower and generative checkpoints publish chooses the fusion
    with (publish/fusion.py; out["fusion"] is the manifest's entry), else PublishConfig's default.
    out["test_grid"]: every fusion of publish/fusion.py's grid on the test split (fusion_grid over the
    test users: what each choice would have given; diagnostic, never used to choose)."""
    from silverrec.generative.source import SOURCES
    from silverrec.publish.evaluate import metrics_from_ranks, ranks_from_topk
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.quality import K_EVAL, handler_for
    from silverrec.publish.rec import build_rec_model

    pcfg = PublishConfig(checkpoint=str(ckpt_path), overarch=OVERARCH, value_model=VALUE_MODEL, k0=K0,
                         candidates=CANDIDATES, sources=list(SOURCES), generative_checkpoint=str(gen_ckpt_path),
                         beam_width=SOURCE_BEAM, **({} if validation is None else {
                             "validation_checkpoint": str(validation[0]),
                             "validation_generative_checkpoint": str(validation[1])}))
    built = build_rec_model(pcfg)
    handler = handler_for(built)
    split = leave_one_out(read_logs(logs / "interactions.parquet", logs / "items.parquet", None, seed=seed))
    ids = split.logs.item_ids
    targets, hists = ids[split.targets("test")], split.histories(split.eval_users, "test")
    out = {}
    for name, src in (("ann", ["ann"]), ("generative", ["generative"]), ("hybrid", list(SOURCES))):
        t, ranks, from_gen = time.perf_counter(), [], 0
        for s in range(0, len(hists), batch):
            hs = hists[s:s + batch]
            res = handler.recommend([{"history": ids[h], "sources": src} for h in hs], k=K_EVAL,
                                    exclude_limit=max(1, max(len(np.unique(h)) for h in hs)))
            ranks.append(ranks_from_topk(res.item_ids, torch.from_numpy(targets[s:s + batch])))
            from_gen += int(((res.found_by[:, :10] & 2) != 0).sum())
        out[name] = metrics_from_ranks(torch.cat(ranks)) | {"top10_from_generative": from_gen / (10 * len(targets)),
                                                            "seconds": round(time.perf_counter() - t, 1)}
        print(f"  {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in out[name].items()), flush=True)
    from silverrec.publish.fusion import fusion_grid, union_tensors

    out["fusion"] = built.manifest["generative"]["fusion"]
    chosen = (handler.module.generative_weight, handler.module.tiers.clone())
    handler.module.generative_weight, handler.module.tiers = 0.0, torch.zeros(4)  # the neutral fusion
    out["test_grid"] = fusion_grid(union_tensors(handler, split, "test", batch))
    handler.module.generative_weight, handler.module.tiers = chosen
    return out


def sources_main(args) -> int:
    """`--sources GEN_CKPT --checkpoint CKPT`: only the retrieval-source rows (`sources_part`)."""
    if not args.checkpoint:
        raise SystemExit("--sources needs --checkpoint (a two-tower checkpoint over the same items as GEN_CKPT)")
    torch.set_num_threads(2)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    ckpt = load_checkpoint(args.checkpoint)
    off, hist_ids = ckpt["users"]["offsets"], ckpt["users"]["item_ids"]
    order = np.random.default_rng(args.seed).permutation(len(off) - 1)
    users = [hist_ids[off[u]:off[u + 1]].tolist() for u in order if off[u + 1] > off[u]]
    repeats = {1: 10, 16: 4} if args.quick else {1: 30, 16: 10}
    print("retrieval sources: ANN only, generative only, hybrid (TorchScript, latency per batch):", flush=True)
    rows = sources_part(Path(args.checkpoint), Path(args.sources), users, repeats)
    if args.sources_quality:
        print(f"quality (leave-one-out on {args.sources_quality}):", flush=True)
        rows.append({"part": "sources_quality", **sources_quality(Path(args.checkpoint), Path(args.sources),
                                                                  Path(args.sources_quality), args.seed)})
    config = {"checkpoint": str(args.checkpoint), "generative_checkpoint": str(args.sources), "beam_width": SOURCE_BEAM,
              "k": K, "k0": K0, "candidates": CANDIDATES, "filter": FILTER, "repeats": repeats, "threads": 2,
              "backend": "torchscript", "target": "hybrid <= 1.1 x (ann + generative) at batch 1",
              "seconds": round(time.perf_counter() - t_start, 1),
              "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()}, "git": _git_state()}
    replot(write_results("recommend_sources_quick" if args.quick else "recommend_sources", config, rows).stem, plot)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small training (0.3 + 0.15 min), fewer repeats, ranking 1k / 10k items")
    ap.add_argument("--checkpoint", help="reuse a checkpoint from silverrec train (with a 'mol' OverArch) instead of training")
    ap.add_argument("--minutes", type=float, default=None, help="two-tower training budget (default 1.0, quick 0.3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--omp-default", action="store_true", help="OpenMP's default wait policy instead of PASSIVE "
                    "(read before torch loads; results in recommend[_quick]_omp_default.*)")
    ap.add_argument("--sources", metavar="GEN_CKPT", help="only the retrieval-source rows (ANN only, generative only, "
                    "hybrid) with this generative checkpoint and --checkpoint")
    ap.add_argument("--sources-quality", metavar="LOGS", help="with --sources: also HR / NDCG of each source on the "
                    "interactions.parquet / items.parquet in LOGS (the logs both checkpoints were trained on)")
    ap.add_argument("--end-to-end-only", action="store_true", help="only part 1 (results in recommend[_quick]_e2e.*)")
    ap.add_argument("--transitions", type=int, default=0, help="next-item transitions per item in the snapshots "
                    "(publish.toml's `transitions`; 0 = none); the pipeline then looks the same chain up")
    ap.add_argument("--tower", default="bag", choices=["bag", "sequence"], help="the user tower trained (no --checkpoint)")
    ap.add_argument("--other-checkpoint", dest="other_checkpoint", help="part 4: a checkpoint with the other user tower, "
                    "published and timed against this one")
    args = ap.parse_args(argv)
    if args.sources:
        return sources_main(args)
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    name = ("recommend_quick" if args.quick else "recommend") + ("_omp_default" if OMP_DEFAULT else "") + \
        ("_e2e" if args.end_to_end_only else "") + ("_towers" if args.other_checkpoint else "") + \
        ("_transitions" if args.transitions else "")
    minutes = args.minutes if args.minutes is not None else (0.3 if args.quick else 1.0)
    overarch_minutes = 0.15 if args.quick else 0.5
    repeats = {1: 10, 16: 5, 64: 3} if args.quick else {1: 60, 16: 20, 64: 8}  # more rounds: a shared, loaded machine
    rank_repeats = 3 if args.quick else 7

    with tempfile.TemporaryDirectory(prefix="silverrec-bench-") as tmp:
        tmp = Path(tmp)
        if args.checkpoint:
            ckpt_path = Path(args.checkpoint)
            train_cfg = {"checkpoint": str(ckpt_path)}
            print(f"reusing checkpoint {ckpt_path}")
        else:
            inter, items = write_logs(tmp / "logs")
            cfg = TrainConfig(interactions=str(inter), items=str(items), tasks=TASKS, minutes=minutes,
                              overarch_minutes=overarch_minutes, overarch=[OVERARCH], seed=args.seed, user_tower=args.tower)
            CHECKPOINTS.mkdir(parents=True, exist_ok=True)
            ckpt_path = CHECKPOINTS / f"{name}.ckpt"
            t = time.perf_counter()
            train(cfg, ckpt_path, quiet_eval=True)
            train_cfg = {"minutes": minutes, "overarch_minutes": overarch_minutes, "seed": args.seed,
                         "seconds": round(time.perf_counter() - t, 1), "checkpoint": str(ckpt_path)}
            print(f"trained in {train_cfg['seconds']}s -> {ckpt_path} (pass --checkpoint {ckpt_path} to reuse)", flush=True)
        ckpt = load_checkpoint(ckpt_path)
        if OVERARCH not in ckpt["overarch"]:
            raise SystemExit(f"checkpoint {ckpt_path} has no {OVERARCH!r} OverArch (it has {sorted(ckpt['overarch'])})")
        t = time.perf_counter()
        pcfg = PublishConfig(checkpoint=str(ckpt_path), overarch=OVERARCH, value_model=VALUE_MODEL, k0=K0,
                             candidates=CANDIDATES, seed=args.seed, transitions=args.transitions)
        snap_dir = publish_rec(pcfg, tmp / "snapshot")
        publish_seconds = time.perf_counter() - t
        snap = silverrec.load(snap_dir)
        manifest = snap.config
        pipe = Pipeline(ckpt, manifest)
        print(f"published in {publish_seconds:.1f}s; pipeline (faiss IVF-SQ8 nlist {pipe.nlist}, roaring) built in "
              f"{pipe.build_seconds:.1f}s; nprobe {pipe.nprobe}, max_probe {pipe.max_probe}, K0 {K0}, k {K}; "
              f"silverrec runs its {snap.backend} program (load backend auto: {manifest.get('backend')})", flush=True)
        off, hist_ids = ckpt["users"]["offsets"], ckpt["users"]["item_ids"]
        order = rng.permutation(len(off) - 1)
        users = [hist_ids[off[u]:off[u + 1]].tolist() for u in order if off[u + 1] > off[u]]
        lens = np.asarray([len(h) for h in users])
        bm = pipe.roaring.evaluate(parse(FILTER))
        print(f"{len(users)} MovieLens users, history length median {np.median(lens):.0f}, p90 {np.percentile(lens, 90):.0f}, "
              f"max {lens.max()}; filter {FILTER!r} keeps {len(bm) / pipe.n:.1%} of {pipe.n:,} items", flush=True)

        print("\n1. end to end (snap.recommend vs the pipeline), latency per batch:", flush=True)
        rows = end_to_end(snap, pipe, users, repeats)
        rank_sizes = [] if args.end_to_end_only else RANK_SIZES[:2] if args.quick else RANK_SIZES
        if not args.end_to_end_only:
            print("\n2. early-stage ranking for one user (silverrec = cache + OverArch; recompute = item tower + OverArch):", flush=True)
            request = {"history": users[0]}
            rows += early_stage(snap, pipe, ckpt, request, rank_sizes, rank_repeats, rng)
            print("\n3. bytes per item:", flush=True)
            rows += sizes_part(manifest, pipe)
        if args.other_checkpoint:
            other_cfg = PublishConfig(checkpoint=args.other_checkpoint, overarch=OVERARCH, value_model=VALUE_MODEL, k0=K0,
                                      candidates=CANDIDATES, seed=args.seed, transitions=args.transitions)
            other = silverrec.load(publish_rec(other_cfg, tmp / "other_snapshot"))
            kinds = (manifest["spec"]["tower"], other.config["spec"]["tower"])
            print(f"\n4. recommend with the {kinds[0]} tower against the {kinds[1]} tower ({args.other_checkpoint}):", flush=True)
            rows += towers_part(snap, other, users, repeats, kinds)

    print("\nend to end (pipeline / silverrec latency ratio; > 1 = silverrec faster):")
    e2e = [r for r in rows if r["part"] == "end_to_end"]
    print_table([{**r, "filter": "none" if r["filter"] == "none" else "filtered"} for r in e2e],
                ["filter", "batch", "silverrec_ms", "pipeline_ms", "ratio", "paired_ratio", "pipeline_one_thread_ms",
                 "ratio_vs_pipeline_best", "silverrec_qps", "pipeline_qps", "top10_overlap", "silverrec_vs_exact",
                 "pipeline_vs_exact"])
    es = [r for r in rows if r["part"] == "early_stage"]
    if es:
        print("\nearly-stage ranking (recompute / cache latency ratio):")
        print_table([{**r, "pool": r["pool"].split("_")[0], "what": r["what"].split(" ")[0]} for r in es],
                    ["pool", "what", "items", "silverrec_ms", "pipeline_ms", "ratio", "paired_ratio"])
        print("(what: rank = user tower + embeddings + OverArch + value; embeddings = cache lookup vs item tower forward; "
          "OverArch = the whole OverArch alone, as the pipeline runs it)")
    for r in es:
        if "masked_gather" in r:
            print(f"  {r['items']:>7,} items: cache lookups of the item tower's outputs {r['silverrec_ms']:.2f} ms, the "
                  f"masked gather {r['masked_gather']['median_ms']:.2f} ms, lookup with the OverArch's item side "
                  f"{r['lookup_with_overarch_item_side']['median_ms']:.2f} ms, item tower {r['pipeline_ms']:.2f} ms")
    ten = [r for r in es if r["items"] == 10_000 and r["pool"].startswith("synthetic") and "ratio" in r]
    for r in ten:
        print(f"target cache >= 10x faster than recomputing the item tower at 10k items, {r['what']}: "
              f"{r['ratio']:.1f}x -> {'met' if r['ratio'] >= 10 else 'NOT met'}")

    towers = [r for r in rows if r["part"] == "towers"]
    if towers:
        print("\nrecommend, one tower against the other (ratio > 1: the first is slower):")
        print_table(towers, ["tower", "other_tower", "batch", "silverrec_ms", "other_ms", "ratio", "paired_ratio"])
    config = {
        "versions": {"silverrec": silverrec.__version__, "faiss": faiss.__version__, "pyroaring": pyroaring.__version__,
                     "numpy": np.__version__, "torch": torch.__version__},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "threads": 2, "quick": args.quick,
        "training": train_cfg, "publish_seconds": round(publish_seconds, 1), "other_checkpoint": args.other_checkpoint,
        "snapshot": {**{k: manifest.get(k) for k in ("nlist", "default_nprobe", "default_k0")},
                     **{k: manifest["spec"].get(k) for k in ("tower", "overarch", "value_model", "merge", "tasks")}}
        | {"max_probe": pipe.max_probe, "quantization_user_tower": manifest.get("quantization_user_tower"),
           "training_stats": manifest.get("training"),
           "transitions": {k: v for k, v in (manifest.get("transitions") or {}).items()
                           if k in ("per_item", "window", "decay", "weight")}},
        "k": K, "k0": K0, "filter": FILTER, "filter_fraction": len(bm) / pipe.n, "batches": list(BATCHES),
        "repeats": repeats, "rank_repeats": rank_repeats, "rank_sizes": list(rank_sizes), "users": len(users),
        "history_length": {"median": float(np.median(lens)), "p90": float(np.percentile(lens, 90)), "max": int(lens.max())},
        "pipeline": "float torch UserTower (eager) -> faiss IndexIVFScalarQuantizer QT_8bit IP (same nlist/nprobe; filtered: "
                    "pyroaring bitmap -> IDSelectorBitmap, nprobe / selectivity up to max_probe) -> numpy union/exclude/re-score "
                    "-> numpy gather float emb + dense -> torch OverArch -> numpy value -> top-k",
        "early_stage_pools": {
            "movielens_9742_ids_with_replacement": "snap.rank on the MovieLens snapshot; item ids drawn with replacement; "
                                                   "pipeline = checkpoint item tower on the same ids + OverArch + value",
            f"synthetic_{SYNTH_ITEMS}_distinct_rows": "ItemTower over UserFeatureSpec(num_items=200000): trained feature tables "
                                                      "and MLP, random item-id table (std of the trained one), features copied "
                                                      "from random MovieLens items; silverrec = EmbeddingCache of its outputs + "
                                                      "RecModel.rank's stages (eager); pipeline = tower forward + OverArch + value",
        },
        "seconds": round(time.perf_counter() - t_start, 1),
        "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()},
        "git": _git_state(),
    }
    replot(write_results(name, config, rows).stem, plot)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__" and not plot_only(plot, "recommend"):
    sys.exit(main())
