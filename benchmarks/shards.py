"""Sharded search on this machine: 1, 2, 4 shards in one process and as gloo ranks, the cost of the
collectives, the merge's growth with k, measured bytes per item by part, and a capacity model for
100M and 1B items.

    .venv/bin/python benchmarks/shards.py [--items 100000] [--dim 64] [--quick]
    .venv/bin/python benchmarks/shards.py --shards 1,2 --splits items --items 50000   # the collectives at 2 shards

Limits: this machine has 2 CPU cores, so 2 ranks already share them with the front end and 4
ranks oversubscribe them (every process, one-process runs included, gets 1 intra-op thread); the machine is also shared
with other work (load average ~10 during the recorded run), so medians carry that noise; rank latencies here show the
protocol's overhead and the split's work, not the scaling of S hosts or S GPUs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, measure, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

import silverrec  # noqa: E402
from silverrec.publish.ivf import IVFConfig  # noqa: E402
from silverrec.publish.pool import Pool  # noqa: E402
from silverrec.publish.shards import ShardSpec, publish_sharded  # noqa: E402
from silverrec.serving.distributed import ShardedRuntime, spawn_workers  # noqa: E402
from silverrec.serving.sharded import merge_topk  # noqa: E402

BATCH, K = 16, 100
GIB = 2**30


def make_pool(n: int, d: int, seed: int = 0) -> Pool:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((256, d)).astype(np.float32) * 2
    emb = centers[rng.integers(0, 256, n)] + rng.standard_normal((n, d)).astype(np.float32)
    genre = [[f"g{g}"] for g in rng.integers(0, 20, n)]
    tag = [[f"t{t}" for t in set(rng.integers(0, 2000, 3).tolist())] for _ in range(n)]
    return Pool(np.arange(n, dtype=np.int64) * 13 + 5, emb, {"genre": genre, "tag": tag})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads; Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bytes_per_item(shard_snap, n: int) -> dict[str, float]:
    """Measured bytes per item of each buffer of a filtered IVF shard (its exported program's state)."""
    state = torch.export.load(shard_snap.path / "model.pt2").state_dict
    out: dict[str, float] = {}
    for name, t in state.items():
        out[name] = t.numel() * t.element_size() / n
    return out


def capacity(per_item: dict[str, float], dim_measured: int, dim: int, items: int, k: int, batch: int) -> dict:
    """Shard count and memory for `items` at dimension `dim` from the measured per-item bytes.

    codes scale with D; ids become int64 above 2^31 items; Bloom bank, planes and posting lists do
    not depend on D. GPU: 80 GB with 10% kept for scratch; host: 24 GiB with 25% kept."""
    b = dict(per_item)
    b["codes"] = b["codes"] * dim / dim_measured
    if items > 2**31:
        b["row_to_item"] = 8.0
    b["embedding_cache_bf16 (rec)"] = 2.0 * dim
    index = sum(v for n, v in b.items() if "(rec)" not in n and n not in ("centroids", "dim_scale", "dim_offset",
                                                                           "cluster_offsets", "post_offsets", "post_sizes"))
    total_rec = index + b["embedding_cache_bf16 (rec)"]
    gpu, host = 80e9 * 0.9, 24 * GIB * 0.75
    out = {"items": items, "dim": dim, "bytes_per_item_index": index, "bytes_per_item_with_rec_cache": total_rec,
           "index_gib": index * items / GIB, "with_rec_cache_gib": total_rec * items / GIB,
           "gpus_80gb": int(np.ceil(index * items / gpu)), "gpus_80gb_with_rec_cache": int(np.ceil(total_rec * items / gpu)),
           "hosts_24gib": int(np.ceil(index * items / host)), "hosts_24gib_with_rec_cache": int(np.ceil(total_rec * items / host))}
    s = out["gpus_80gb"]
    out["bytes_moved_per_request_at_gpu_shards"] = request_bytes(s, batch, dim, k)
    return out


def request_bytes(shards: int, batch: int, dim: int, k: int, opts: int = 64) -> dict[str, int]:
    """Collective bytes of one request: payload to each other rank, packed top-k back from each."""
    from silverrec.serving.distributed import HEADER, INLINE

    payload = batch * dim * 4 + opts  # inline in the fixed header buffer when it fits, else a second broadcast
    out_bytes = (shards - 1) * (HEADER + INLINE + (payload if payload > INLINE else 0))
    back = (shards - 1) * (1 + 2 * batch * k) * 8
    return {"shards": shards, "batch": batch, "k": k, "to_ranks": out_bytes, "from_ranks": back, "total": out_bytes + back}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="50k items, fewer repeats")
    ap.add_argument("--shards", default="1,2,4", help="shard counts to run (default 1,2,4)")
    ap.add_argument("--splits", default="items,clusters", help="splits to run above 1 shard (default items,clusters)")
    args = ap.parse_args()
    counts = [int(x) for x in args.shards.split(",")]
    splits = tuple(args.splits.split(","))
    partial = counts != [1, 2, 4] or splits != ("items", "clusters")
    torch.set_num_threads(1)  # every process (front end and ranks) one intra-op thread: 2 cores shared
    os.environ["OMP_NUM_THREADS"] = "1"
    n = 50_000 if args.quick else args.items
    repeat = 7 if args.quick else 25
    pool = make_pool(n, args.dim)
    rng = np.random.default_rng(1)
    queries = (pool.embeddings[rng.integers(0, n, BATCH)] + rng.standard_normal((BATCH, args.dim)).astype(np.float32))
    cfg = IVFConfig(seed=0)
    rows, root = [], Path(tempfile.mkdtemp(prefix="shards-bench-"))
    os.environ["SILVERREC_QUIET"] = "1"
    reference = None
    load_before = os.getloadavg()
    for shards in counts:
        for by in (("items",) if shards == 1 else splits):
            t = time.perf_counter()
            path = publish_sharded(pool, root / f"s{shards}_{by}", spec=ShardSpec(shards, by),
                                   config=cfg, torchscript=False)
            publish_s = time.perf_counter() - t
            snap = silverrec.load(path)
            nprobe = int(snap.config["default_nprobe"])
            res = snap.search(queries, K)
            reference = res.scores if reference is None else reference
            same = bool(torch.equal(res.scores, reference))  # ids agree up to ties at the k-th score
            m = measure(lambda: snap.search(queries, K), repeat=repeat, warmup=3)
            sizes = [s["item_count"] for s in snap.config["shards"]]
            row = {"shards": shards, "shard_by": by, "mode": "one process", "nprobe": nprobe,
                   "median_ms": m["median_ms"], "p20_ms": m["p20_ms"], "p80_ms": m["p80_ms"],
                   "qps": BATCH / m["median_ms"] * 1e3, "imbalance": max(sizes) / (n / shards), "same_scores_as_1_shard": same,
                   "publish_s": publish_s}
            if by == "clusters":  # shards a batch-16 request reaches / a single query reaches
                from silverrec.serving.sharded import routed_rows
                reach = torch.stack([routed_rows(snap.centroids, snap.owned_clusters(i), torch.from_numpy(queries), K,
                                                 {"nprobe": nprobe}, snap.shards[i].config)
                                     for i in range(shards)])  # [S, B]
                row["shards_per_query"] = float(reach.sum(0).float().mean())
                row["shards_per_batch"] = int(reach.any(1).sum())
            rows.append(row)
            if shards > 1:
                init = f"tcp://127.0.0.1:{free_port()}"
                procs = spawn_workers(path, shards, init, timeout_s=30)
                rt = ShardedRuntime(path, rank=0, world_size=shards, init_method=init, timeout_s=30)
                try:
                    assert torch.equal(rt.search(queries, K).item_ids, res.item_ids)
                    m = measure(lambda: rt.search(queries, K), repeat=repeat, warmup=3)
                    cpu0 = [cpu_seconds(os.getpid())] + [cpu_seconds(p.pid) for p in procs]
                    ping = measure(lambda: rt.ping(BATCH, K), repeat=1000, warmup=20)
                    cpu1 = [cpu_seconds(os.getpid())] + [cpu_seconds(p.pid) for p in procs]
                    cpu_ms = [round((b - a) / (1000 + 20) * 1e3, 3) for a, b in zip(cpu0, cpu1)]
                    rows.append({"shards": shards, "shard_by": by, "mode": f"{shards} gloo ranks", "nprobe": nprobe,
                                 "median_ms": m["median_ms"], "p20_ms": m["p20_ms"], "p80_ms": m["p80_ms"],
                                 "qps": BATCH / m["median_ms"] * 1e3, "collective_ms": ping["median_ms"],
                                 "collective_p20_ms": ping["p20_ms"], "collective_p80_ms": ping["p80_ms"],
                                 "collective_cpu_ms_per_rank": cpu_ms, "loadavg": os.getloadavg()})
                finally:
                    rt.close()
                    for p in procs:
                        p.wait(timeout=60)
    print_table(rows, ["shards", "shard_by", "mode", "median_ms", "p80_ms", "qps", "collective_ms", "collective_p20_ms",
                       "collective_cpu_ms_per_rank", "imbalance",
                       "shards_per_query", "shards_per_batch", "same_scores_as_1_shard"])
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    if partial:
        replot(write_results("shards_partial", {"items": n, "dim": args.dim, "batch": BATCH, "k": K, "shards": counts,
                                                "splits": list(splits), "cores": os.cpu_count(),
                                                "loadavg_before": load_before, "loadavg_after": load_after}, rows).stem, plot)
        return

    merge_rows = []
    for k in (10, 100, 1000, 10000):
        for s in (2, 4, 8):
            parts = [(torch.randn(BATCH, k).sort(1, descending=True).values, torch.randint(0, 10**9, (BATCH, k))) for _ in range(s)]
            m = measure(lambda: merge_topk([p[0] for p in parts], [p[1] for p in parts], k), repeat=15, warmup=2)
            merge_rows.append({"k": k, "shards": s, "batch": BATCH, "merge_ms": m["median_ms"],
                               "gathered_bytes": (s - 1) * (1 + 2 * BATCH * k) * 8})
    print_table(merge_rows, ["k", "shards", "batch", "merge_ms", "gathered_bytes"])

    shard0 = silverrec.load(root / "s2_items" / "shard-00000")
    per_item = bytes_per_item(shard0, shard0.manifest["item_count"])
    model = [capacity(per_item, args.dim, 128, items, K, BATCH) for items in (100_000_000, 1_000_000_000)]
    for c in model:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in c.items()})
    path = write_results("shards_quick" if args.quick else "shards",
                         {"items": n, "dim": args.dim, "batch": BATCH, "k": K, "kind": "filtered_ivf (unfiltered requests)",
                          "nlist": int(shard0.config["nlist"]), "cores": os.cpu_count(),
                          "loadavg_before": load_before, "loadavg_after": load_after},
                         rows + [{"merge": r} for r in merge_rows]
                         + [{"bytes_per_item_measured": per_item, "measured_dim": args.dim}] + [{"capacity": c} for c in model])
    replot(path.stem, plot)


def plot(payload: dict, path: Path) -> None:
    """Search latency per shard count, split and runtime (one process or gloo ranks), the collectives'
    share, and the exact merge's cost against k."""
    rows = [r for r in payload["rows"] if "mode" in r]
    cats = [f"{r['shards']} shard{'s' if r['shards'] > 1 else ''}, {r['shard_by'] if r['shards'] > 1 else '-'}" for r in rows]
    cats = list(dict.fromkeys(cats))
    series = {}
    for r in rows:
        cat = f"{r['shards']} shard{'s' if r['shards'] > 1 else ''}, {r['shard_by'] if r['shards'] > 1 else '-'}"
        mode = "one process" if r["mode"] == "one process" else "gloo ranks"
        xs, ys = series.setdefault(mode, ([], []))
        xs.append(cat)
        ys.append(r["median_ms"])
        if "collective_ms" in r:
            xs, ys = series.setdefault("of which collectives", ([], []))
            xs.append(cat)
            ys.append(r["collective_ms"])
    c = payload["config"]
    panels = [Panel(f"batch {c['batch']}, k {c['k']}, {c['items']:,} x {c['dim']}, {c.get('cores')} cores", "shards, split",
                    "ms per batch (median)", series, kind="bar")]
    merge = [r["merge"] for r in payload["rows"] if "merge" in r]
    if merge:
        panels.append(Panel(f"exact merge of the shards' top-k, batch {c['batch']}", "k", "ms (median)",
                            {f"{s} shards": ([m["k"] for m in merge if m["shards"] == s], [m["merge_ms"] for m in merge if m["shards"] == s])
                             for s in dict.fromkeys(m["shards"] for m in merge)}, logx=True, logy=True))
    save_plot(path, panels, "sharded search: one process vs gloo ranks")


if __name__ == "__main__" and not plot_only(plot, "shards"):
    main()
