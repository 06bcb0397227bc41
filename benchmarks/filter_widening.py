"""How many matching items must the probed route collect for filtered recall@100 >= 0.95?

    .venv/bin/python benchmarks/filter_widening.py [--n 1000000] [--queries 64]

The probed route of the filtered search widens a query's probe list until its probed clusters hold
target(d) matching items, d = the filter's match density (silverrec/retrieval/filtered_ivf.py,
kernels/csrc/plan.cpp). This measures the matches actually needed, on benchmarks/filter.py's
conjunction pool (1M x 96 Gaussian mixture, 1,024 clusters, three categorical features whose values
each hold 4-30% of the items): for filters from ~0.5% to ~40% and two query sets -- near items (an
item + 0.3 noise: benchmarks/filter.py's queries) and held-out draws of the mixture (points of the
same distribution that are not in the pool) -- mode "probed" at nprobe 16..512 gives recall@100
against the exact filtered answer and the matches in the probed clusters; the fewest matches with
recall >= 0.95 is each cell's need. The auto route's choice (clusters probed, recall) is recorded
beside it. Writes benchmarks/results/filter_widening.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

os.environ.setdefault("SILVERREC_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faiss  # noqa: E402
from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402
from filter import (CONJ_FEATURES, BloomConfig, ForwardIndex, RoaringIndex, cluster_major_layout,  # noqa: E402
                    filter_index, gaussian_mixture, recall, search_model, search_routes)

from silverrec.retrieval.filtered_search import search_index  # noqa: E402

NPROBES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FILTERS = ("country = c0", "country = c2", "lang = l1", "category = c3", "lang = l6",
           "category = c9 AND country = c0", "country = c1 AND lang = l0", "category = c0 AND lang = l2",
           "country IN (c0, c1) AND NOT lang IN (l0, l1, l2, l3, l4, l5, l6)", "NOT country = c0")
K = 100


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    n, d, nlist, B = args.n, 96, 1024, 16
    both = gaussian_mixture(n + args.queries, d, rng)
    x, held_out = both[:n], both[n:]
    feats = {}
    for name, card in CONJ_FEATURES.items():
        w = 1.0 / np.arange(1, card + 1) ** 0.7
        feats[name] = ([f"{name[0]}{i}" for i in range(card)], rng.choice(card, size=n, p=w / w.sum()).astype(np.int32))
    km = faiss.Kmeans(d, nlist, niter=10, seed=1, max_points_per_centroid=64)
    km.train(x)
    quant = faiss.IndexFlatIP(d)
    quant.add(km.centroids)
    _, assign = quant.search(x, 1)
    assign = assign[:, 0]
    ivf = cluster_major_layout(torch.from_numpy(x), torch.arange(n), torch.from_numpy(km.centroids), torch.from_numpy(assign).long())
    module, meta = filter_index(ivf, ForwardIndex.from_codes(feats).permute(ivf.row_to_item), BloomConfig(bits=512, hashes=7))
    module.eval()
    snap = SimpleNamespace(path="bench", module=torch.jit.script(search_model(module)), index=module, config={
        "nlist": nlist, "default_nprobe": 16, "filter": meta,
        "search": {"default_max_probe": 128, "match_factor": module.match_factor, "exact_cost_ratio": module.exact_cost_ratio}})
    roar = RoaringIndex(feats, n)
    query_sets = {"near items": x[rng.integers(0, n, args.queries)] + 0.3 * rng.normal(size=(args.queries, d)).astype(np.float32),
                  "held-out draws": held_out}
    cscore_order = {}
    rows = []
    for qname, q in query_sets.items():
        order = np.argsort(-(q @ km.centroids.T), axis=1)  # each query's clusters, nearest first (as the plan)
        cscore_order[qname] = order
        for f in FILTERS:
            t0 = time.perf_counter()
            match = np.asarray(roar.evaluate(f).to_array(), dtype=np.int64)
            dens = match.size / n
            per_cluster = np.bincount(assign[match], minlength=nlist)
            s = x[match] @ q.T
            truth = [match[np.argsort(-s[:, b])[:K]] for b in range(q.shape[0])]
            cells = []
            for npb in NPROBES:
                found = np.concatenate([search_index(snap, torch.from_numpy(q[i:i + B]), K, nprobe=npb, filter=f, mode="probed",
                                                     max_probe=max(npb, 128))[1].numpy() for i in range(0, q.shape[0], B)])
                matches = float(per_cluster[order[:, :npb]].sum(axis=1).mean())
                cells.append({"nprobe": npb, "recall": round(recall(found, truth), 4), "matches_probed": round(matches, 1)})
            auto = np.concatenate([search_index(snap, torch.from_numpy(q[i:i + B]), K, nprobe=16, filter=f)[1].numpy()
                                   for i in range(0, q.shape[0], B)])
            routes = search_routes(snap, torch.from_numpy(q[:B]), K, 16, f)
            need = next((c for c in cells if c["recall"] >= 0.95), None)
            row = {"queries": qname, "filter": f, "density": round(dens, 5), "probed": cells,
                   "need_nprobe": need and need["nprobe"], "need_matches": need and need["matches_probed"],
                   "auto": {"recall": round(recall(auto, truth), 4), **routes}}
            rows.append(row)
            print(f"{qname:<15} d {dens:7.3%}  need nprobe {row['need_nprobe']} ({row['need_matches']} matches) | auto: "
                  f"{row['auto']}  [{f}] {time.perf_counter() - t0:.0f}s", flush=True)
    write_results("filter_widening", {"n": n, "dim": d, "nlist": nlist, "k": K, "queries": args.queries, "nprobes": NPROBES,
                                      "match_factor": module.match_factor}, rows)
    replot("filter_widening", plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Per query set: recall@k of the probed route against the matching items in its probed clusters,
    one line per filter (its density in the legend)."""
    rows, panels = payload["rows"], []
    for qname in dict.fromkeys(r["queries"] for r in rows):
        mine = [r for r in rows if r["queries"] == qname]
        panels.append(Panel(f"queries: {qname}", "matching items in the probed clusters", f"recall@{payload['config']['k']}",
                            {f"{r['filter']} ({r['density']:.1%})": ([c["matches_probed"] for c in r["probed"]],
                                                                    [c["recall"] for c in r["probed"]]) for r in mine},
                            logx=True, ref=0.95, ref_label="recall 0.95"))
    c = payload["config"]
    save_plot(path, panels, f"how many matches the probed route needs, {c['n']:,} x {c['dim']}, nlist {c['nlist']}", height=5.5)


if __name__ == "__main__" and not plot_only(plot, "filter_widening"):
    raise SystemExit(main())
