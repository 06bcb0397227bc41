"""The `silverrec` command line: publish, query, inspect.

    silverrec publish --pool POOL.parquet --out DIR [--exact] [--nlist N] [--seed S]
    silverrec query DIR --queries Q.npy --k K [--nprobe P] [--filter "..."] [--json]
    silverrec inspect DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _publish(args: argparse.Namespace) -> int:
    from silverrec.publish.pool import read_pool

    pool = read_pool(args.pool)
    print(f"pool: {pool.size} items, dim {pool.dim}, features {sorted(pool.features) or 'none'}", file=sys.stderr)
    kind = "exact" if args.exact else DEFAULT_KIND
    if kind == "ivf" and pool.features and "filtered_ivf" in PUBLISHERS:
        kind = "filtered_ivf"  # categorical columns become filterable features
    publisher = PUBLISHERS[kind]
    out = publisher(pool, args)
    print(f"published {out}")
    return 0


def _publish_exact(pool, args) -> Path:
    from silverrec.publish.build import publish_exact

    return publish_exact(pool, args.out, overwrite=args.overwrite)


def _publish_ivf(pool, args) -> Path:
    from silverrec.publish.ivf import IVFConfig, publish_ivf

    config = IVFConfig(nlist=args.nlist, seed=args.seed)
    return publish_ivf(pool, args.out, config=config, overwrite=args.overwrite)


def _publish_filtered_ivf(pool, args) -> Path:
    from silverrec.publish.filtered_ivf import publish_filtered_ivf
    from silverrec.publish.ivf import IVFConfig

    config = IVFConfig(nlist=args.nlist, seed=args.seed)
    return publish_filtered_ivf(
        pool, args.out, config=config, bloom_bits=args.bloom_bits, bloom_hashes=args.bloom_hashes, overwrite=args.overwrite
    )


# Index kind -> publisher(pool, args).
PUBLISHERS = {"exact": _publish_exact, "ivf": _publish_ivf, "filtered_ivf": _publish_filtered_ivf}
DEFAULT_KIND = "ivf"


def _query(args: argparse.Namespace) -> int:
    import silverrec

    snap = silverrec.load(args.snapshot, backend=args.backend)
    try:
        queries = np.load(args.queries)
    except (OSError, ValueError) as e:
        raise silverrec.QueryError(f"cannot read queries from {args.queries}: {e}") from None
    if queries.dtype != np.float32:
        raise silverrec.QueryError(f"queries in {args.queries} must be float32 [B, D], got {queries.dtype}")
    options = {name: getattr(args, name) for name in ("nprobe", "filter", "max_probe", "mode") if getattr(args, name, None) is not None}
    result = snap.search(queries, args.k, **options)
    if args.json:
        text = json.dumps(result.to_json())
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    else:
        for b in range(result.item_ids.shape[0]):
            pairs = ", ".join(
                f"{int(i)}:{float(s):.4f}" for i, s in zip(result.item_ids[b], result.scores[b])
            )
            print(f"query {b}: {pairs}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from silverrec.snapshot import read_manifest

    m = read_manifest(args.snapshot)
    print(f"snapshot      {Path(args.snapshot).resolve()}")
    print(f"kind          {m['kind']}")
    print(f"format        {m['format_version']} (silverrec {m['silverrec_version']}, torch {m['torch_version']})")
    print(f"created       {m['created']}")
    print(f"items         {m['item_count']:,}")
    print("config")
    for key, value in sorted(m["config"].items()):
        text = json.dumps(value)
        print(f"  {key:<12}{text if len(text) < 200 else text[:197] + '...'}")
    print("files")
    for name, meta in sorted(m["files"].items()):
        print(f"  {name:<12}{meta['bytes']:>14,} bytes  sha256 {meta['sha256'][:16]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silverrec", description="Recommendation serving as one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True)

    pub = sub.add_parser("publish", help="build a snapshot from a candidate pool")
    pub.add_argument("--pool", required=True, help="Parquet: item_id, embedding, categorical features")
    pub.add_argument("--out", required=True, help="snapshot directory to create")
    pub.add_argument("--exact", action="store_true", help="exact int8 index instead of IVF")
    pub.add_argument("--overwrite", action="store_true", help="replace an existing snapshot atomically")
    pub.add_argument("--nlist", type=int, default=None, help="IVF clusters (default about 4*sqrt(N))")
    pub.add_argument("--seed", type=int, default=0, help="IVF k-means seed")
    pub.add_argument("--bloom-bits", type=int, default=None, help="Bloom bits M per item (default: sizing rule, max tokens x K x 1.5)")
    pub.add_argument("--bloom-hashes", type=int, default=None, help="Bloom hash functions K per token (default 7)")
    pub.set_defaults(func=_publish)

    q = sub.add_parser("query", help="top-k items for each query vector")
    q.add_argument("snapshot")
    q.add_argument("--queries", required=True, help=".npy float32 [B, D]")
    q.add_argument("--k", type=int, required=True)
    q.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or stdout)")
    q.add_argument("--backend", choices=("export", "torchscript"), default="export")
    q.add_argument("--nprobe", type=int, default=None, help="IVF clusters to probe (default: the snapshot's)")
    q.add_argument("--filter", default=None, help="attribute filter, e.g. \"genre = Drama AND NOT decade = 1990s\"")
    q.add_argument("--max-probe", dest="max_probe", type=int, default=None, help="filtered search: widest probe (default: the snapshot's)")
    q.add_argument("--mode", choices=("auto", "probed", "unprobed"), default=None, help="filtered search mode (default auto)")
    q.set_defaults(func=_query)

    i = sub.add_parser("inspect", help="print a snapshot's manifest")
    i.add_argument("snapshot")
    i.set_defaults(func=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from silverrec.errors import SilverrecError

    try:
        return args.func(args)
    except SilverrecError as e:
        print(f"silverrec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
