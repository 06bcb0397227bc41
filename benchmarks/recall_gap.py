"""Where the recall@100 gap to Faiss IVF-SQ8 at equal nprobe comes from, measured piece by piece.

    .venv/bin/python benchmarks/recall_gap.py [--n 200000] [--queries 1000] [--nprobes 8,32,128,512]

On the noisy long-tailed pool of benchmarks/noisy_pool.py (held-out queries from the same mixture),
silverrec's index built as publish builds it (`build_ivf`: k-means, residual or direct codes) and
Faiss IndexIVFScalarQuantizer (QT_8bit, by_residual) on the SAME centroids and item-to-list assignment
(`add_preassigned`). At each nprobe, recall@100 against float brute force of:

- faiss_sq8 / faiss_flat: Faiss IVF-SQ8 and IVFFlat (the float ceiling of this probe);
- ours_served: the search op as a snapshot runs it (int8 query scan, re-score of the top k + margin rows
  with the float query; margin `rescore_margin(k)`), and the same op with other margins (re-score depth)
  and with none (the int8 scan's own ranking: the query quantisation);
- exact rankings of every probed row (no scan, no depth limit) by the float query against: our codes
  (`decode`), Faiss's codes (its reconstructions), our codes re-encoded with Faiss's trained ranges and
  with clipped ranges (the residual ranges), and the float items;
- probes: the share of queries whose probed cluster set equals Faiss's quantiser's (the centroid
  ranking), and the share of true neighbours inside the probed clusters (ours, Faiss's);
- the clustering itself (what a same-centroid comparison leaves out): Faiss IVF-SQ8 trained by Faiss
  (`index_factory("IVF<nlist>,SQ8", METRIC_INNER_PRODUCT)`: its own k-means, spherical for inner
  product, and assignment), Faiss IVF-SQ8 on our centroids with its own assignment (each item in the
  list of its best centroid by inner product), our served search on our centroids with each item on
  its nearest centroid (`kmeans.assign`, instead of the two-level build's grouped assignment), and our
  served search built with the other k-means (`IVFConfig.spherical` the opposite of what publish's
  "auto" picks for the pool: mean centroids for this normalised pool).

Writes benchmarks/results/recall_gap.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402
from noisy_pool import noisy_pool  # noqa: E402

from silverrec.kernels.common import cluster_of_rows, quantize_queries  # noqa: E402
from silverrec.kernels.rescore_rows import rescore_margin  # noqa: E402
from silverrec.publish.ivf import IVFConfig, build_ivf, cluster_major_layout  # noqa: E402
from silverrec.publish.kmeans import assign  # noqa: E402
from silverrec.publish.pool import Pool  # noqa: E402
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex  # noqa: E402

K = 100


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(f[f >= 0], t).size / truth.shape[1] for f, t in zip(found, truth)]))


def served(index: FilteredIVFIndex, q: torch.Tensor, k: int, nprobe: int, margin: int) -> np.ndarray:
    """The pure-ANN search op as a snapshot runs it (`Int8IVFIndex.search`), with re-score margin `margin`
    (0 = none): rows int64 [Q, k]."""
    return torch.cat([index.search(q[i : i + 16], k, nprobe, rescore_margin=margin, rescore_max_k=1 << 20,
                                   item_ids=False)[1] for i in range(0, q.shape[0], 16)]).numpy()


def exact_in_probes(score_fn, probes: dict[int, torch.Tensor], cluster: torch.Tensor, n_queries: int,
                    chunk: int = 32) -> dict[int, np.ndarray]:
    """Top-K rows among each query's probed clusters, ranked by score_fn(query rows) -> float [b, N]:
    {nprobe: rows int64 [Q, K]}."""
    out = {p: [] for p in probes}
    nlist = int(cluster.max()) + 1
    for i in range(0, n_queries, chunk):
        s = score_fn(slice(i, i + chunk))
        for p, pr in probes.items():
            member = torch.zeros(s.shape[0], nlist, dtype=torch.bool)
            member.scatter_(1, pr[i : i + chunk], True)
            masked = torch.where(member.gather(1, cluster.expand(s.shape[0], -1)), s, float("-inf"))
            out[p].append(torch.topk(masked, K, dim=1).indices)
    return {p: torch.cat(v).numpy() for p, v in out.items()}


def reencode(resid: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Residuals quantised to 256 levels over [lo, hi] per dimension (cluster_major_layout's rounding), decoded."""
    scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    offset = lo + 128.0 * scale
    return ((resid - offset) / scale).round().clamp(-128, 127) * scale + offset


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--nprobes", default="8,32,128,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="recall_gap")
    args = p.parse_args()
    import faiss
    from faiss.contrib.ivf_tools import add_preassigned

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    nprobes = [int(v) for v in args.nprobes.split(",")]
    pool = noisy_pool(args.n)
    xn = pool.x
    qn = pool.queries(args.queries)
    x, q = torch.from_numpy(xn), torch.from_numpy(qn)
    n, d = x.shape
    ivf, km = build_ivf(Pool(np.arange(n, dtype=np.int64), xn.copy()), IVFConfig())
    index = FilteredIVFIndex.from_ivf(ivf, torch.zeros(0, (n + 63) // 64, dtype=torch.int64))
    nlist = index.nlist
    nprobes = [v for v in nprobes if v <= nlist]
    print(f"N={n} D={d} nlist={nlist} residual codes: {index.residual}, spherical k-means: {km.spherical}", flush=True)
    perm = index.row_to_item.long()  # row -> pool item
    xr = x[perm]  # items in row order
    rows = torch.arange(n)
    cluster = cluster_of_rows(index.cluster_offsets, rows)
    truth_items = torch.cat([torch.topk(q[i : i + 64] @ x.T, K, dim=1).indices for i in range(0, q.shape[0], 64)])
    inv = torch.empty_like(perm)
    inv[perm] = rows
    truth = inv[truth_items].numpy()  # rows

    quant = faiss.IndexFlatIP(d)
    quant.add(km.centroids.numpy())
    sq8 = faiss.IndexIVFScalarQuantizer(quant, d, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    sq8.train(xn[: min(n, 200_000)])
    add_preassigned(sq8, xn, km.assignment.numpy())
    flat = faiss.IndexIVFFlat(quant, d, nlist, faiss.METRIC_INNER_PRODUCT)
    flat.is_trained = True
    add_preassigned(flat, xn, km.assignment.numpy())
    sq8.make_direct_map()
    recon_faiss = torch.from_numpy(sq8.reconstruct_n(0, n))[perm]  # rows
    trained = faiss.vector_to_array(sq8.sq.trained)
    f_lo, f_hi = torch.from_numpy(trained[:d]), torch.from_numpy(trained[:d] + trained[d:])

    centre = index.centroids[cluster]
    resid = xr - centre if index.residual else xr
    base = centre if index.residual else 0.0
    lo_q, hi_q = torch.quantile(resid[:200_000], 1e-4, dim=0), torch.quantile(resid[:200_000], 1 - 1e-4, dim=0)
    ours = index.decode(rows)
    reps = {"ours_codes_float_query": ours,
            "faiss_codes_float_query": recon_faiss,
            "ours_codes_faiss_ranges": base + reencode(resid, f_lo, f_hi) if index.residual else None,
            "ours_codes_quantile_ranges": base + reencode(resid, lo_q, hi_q),
            "float_items": xr}
    folded_codes = index.codes.float()
    const_q = q @ index.dim_offset
    qc, qs = quantize_queries((q * index.dim_scale).contiguous())
    cbias = q @ index.centroids.T if index.residual else torch.zeros(q.shape[0], nlist)

    def int8_query(sl):  # the scan's integer scores (exact ranking of every probed row, no re-score)
        return (qc[sl].float() @ folded_codes.T) * qs[sl, None] + const_q[sl, None] + cbias[sl][:, cluster]

    probes = {pr: index.probe(q, pr) for pr in nprobes}
    faiss_probes = {pr: torch.from_numpy(quant.search(qn, pr)[1]) for pr in nprobes}
    res = {}
    for name, rep in reps.items():
        if rep is not None:
            res[name] = exact_in_probes(lambda sl, rep=rep: q[sl] @ rep.T, probes, cluster, q.shape[0])
            print(f"  exact ranking: {name} done", flush=True)
    res["ours_int8_query_exact_ranking"] = exact_in_probes(int8_query, probes, cluster, q.shape[0])
    res["faiss_codes_in_faiss_probes"] = exact_in_probes(lambda sl: q[sl] @ recon_faiss.T, faiss_probes, cluster, q.shape[0])
    range_width = {"ours": float((index.dim_scale * 255).mean()), "faiss": float((f_hi - f_lo).mean()),
                   "quantile_1e-4": float((hi_q - lo_q).mean())}
    print(f"mean range width per dimension: {range_width}", flush=True)
    # the clustering: Faiss's own training; Faiss's assignment on our centroids; ours with exact assignment
    own = faiss.index_factory(d, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    own.train(xn)
    own.add(xn)
    ipa = faiss.IndexIVFScalarQuantizer(quant, d, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    ipa.train(xn[: min(n, 200_000)])
    ipa.add(xn)
    own_ivf = faiss.extract_index_ivf(own)
    own_quant = own_ivf.quantizer
    own_sizes = np.array([own_ivf.invlists.list_size(i) for i in range(nlist)])
    sizes = index.cluster_offsets[1:] - index.cluster_offsets[:-1]
    exact_assign = assign(x, km.centroids)[0]
    moved = float((exact_assign != km.assignment).double().mean())
    exact_index = FilteredIVFIndex.from_ivf(cluster_major_layout(x, torch.arange(n), km.centroids, exact_assign,
                                                                 residual=index.residual),
                                            torch.zeros(0, (n + 63) // 64, dtype=torch.int64))
    print(f"items off their nearest centroid in the built index: {moved:.4f}", flush=True)
    other_ivf, _ = build_ivf(Pool(np.arange(n, dtype=np.int64), xn.copy()), IVFConfig(spherical=not km.spherical))
    other = FilteredIVFIndex.from_ivf(other_ivf, torch.zeros(0, (n + 63) // 64, dtype=torch.int64))
    other_name = f"ours_served_{'mean' if km.spherical else 'unit'}_centroids"
    margins = sorted({rescore_margin(K), K // 4, K, 3 * K})
    out_rows = []
    truth_cluster = cluster[torch.from_numpy(truth)]
    for pr in nprobes:
        sq8.nprobe = pr
        flat.nprobe = pr
        fs = inv[torch.from_numpy(sq8.search(qn, K)[1])].numpy()
        ff = inv[torch.from_numpy(flat.search(qn, K)[1])].numpy()
        row = {"nprobe": pr, "faiss_sq8": recall(fs, truth), "faiss_flat": recall(ff, truth)}
        own.nprobe = ipa.nprobe = pr
        row["faiss_sq8_own_kmeans"] = recall(inv[torch.from_numpy(own.search(qn, K)[1])].numpy(), truth)
        row["faiss_sq8_ip_assignment"] = recall(inv[torch.from_numpy(ipa.search(qn, K)[1])].numpy(), truth)
        row["ours_served_exact_assignment"] = recall(
            exact_index.row_to_item.long()[torch.from_numpy(served(exact_index, q, K, pr, rescore_margin(K)))].numpy(),
            truth_items.numpy())
        row[other_name] = recall(other.row_to_item.long()[torch.from_numpy(served(other, q, K, pr, rescore_margin(K)))].numpy(),
                                 truth_items.numpy())
        for m in [0] + margins:
            row[f"ours_served_margin_{m}"] = recall(served(index, q, K, pr, m), truth)
        for name, by_p in res.items():
            row[name] = recall(by_p[pr], truth)
        ours_p, their_p = probes[pr], faiss_probes[pr]
        same = (torch.sort(ours_p, 1).values == torch.sort(their_p, 1).values).all(1)
        row["probe_sets_identical"] = float(same.double().mean())
        row["probe_coverage_ours"] = float((truth_cluster[:, :, None] == ours_p[:, None, :]).any(2).double().mean())
        row["probe_coverage_faiss"] = float((truth_cluster[:, :, None] == their_p[:, None, :]).any(2).double().mean())
        row["rows_scanned_ours"] = float(sizes[ours_p].sum(1).double().mean())
        row["rows_scanned_faiss_own_kmeans"] = float(own_sizes[own_quant.search(qn, pr)[1]].sum(1).mean())
        out_rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    write_results(args.name, vars(args) | {"nlist": nlist, "residual": index.residual, "spherical": km.spherical, "range_width": range_width,
                                           "default_margin": rescore_margin(K),
                                           "off_nearest_centroid": moved, "n": n}, out_rows)
    replot(args.name, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """recall@100 by nprobe: Faiss IVF-SQ8 on our centroids and with its own k-means, ours as served, on
    its centroids with exact assignment, and with the other k-means; and recall by rows scanned."""
    rows, cfg = payload["rows"], payload["config"]
    p = [r["nprobe"] for r in rows]
    other = next(k for k in rows[0] if k.startswith("ours_served_") and k.endswith("_centroids"))
    names = {"faiss_sq8": "Faiss IVF-SQ8, our centroids", "faiss_sq8_own_kmeans": "Faiss IVF-SQ8, its own k-means",
             f"ours_served_margin_{cfg['default_margin']}": "silverrec as served",
             "ours_served_exact_assignment": "silverrec, exact assignment", other: "silverrec, " + other[12:].replace("_", " "),
             "faiss_flat": "float scan of our probe (ceiling)"}
    panels = [Panel(f"noisy pool {cfg['n']:,} x 96, nlist {cfg['nlist']}: recall@100 by nprobe", "nprobe", "recall@100",
                    {label: (p, [r[key] for r in rows]) for key, label in names.items()}, logx=True),
              Panel("by rows scanned per query", "rows scanned per query", "recall@100",
                    {"silverrec as served": ([r["rows_scanned_ours"] for r in rows],
                                             [r[f"ours_served_margin_{cfg['default_margin']}"] for r in rows]),
                     "Faiss IVF-SQ8, its own k-means": ([r["rows_scanned_faiss_own_kmeans"] for r in rows],
                                                        [r["faiss_sq8_own_kmeans"] for r in rows])}, logx=True)]
    save_plot(path, panels, "Where the recall gap to Faiss IVF-SQ8 comes from")


if __name__ == "__main__" and not plot_only(plot, "recall_gap"):
    raise SystemExit(main())
