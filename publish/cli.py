"""The `silverrec` command line: train, publish, recommend, rank, evaluate, query, inspect.

    silverrec train --config train.toml --out model.ckpt [--minutes M] [--seed S] [--stage test|valid]
    silverrec train --generative --config generative.toml --out gen.ckpt [--minutes M] [--seed S] [--stage S]
    silverrec publish --config publish.toml --out DIR                     (recommendation model)
    silverrec recommend DIR --user U | --history "id1,id2,..." [--filter "..."] [--k K] [--json]
    silverrec rank DIR --user U | --history IDS --items FILE [--json]      (early-stage ranking)
    silverrec evaluate DIR --interactions I.parquet --items ITEMS.parquet [--users U.parquet]
    silverrec publish --pool POOL.parquet --out DIR [--exact] [--nlist N] [--seed S] [--residual auto|on|off]
                      [--shards S --shard-by items|clusters]
    silverrec query DIR --queries Q.npy --k K [--nprobe P] [--filter "..."] [--json]
    silverrec publish --generative --pool POOL --out DIR --model CKPT [--beam-width W] [--top-k K]
    silverrec query DIR --history "id1,id2,..." [--history-file F] --k K      (generative snapshots)
    silverrec update DIR --upsert ITEMS.parquet [--delete IDS] --out NEW_DIR   (incremental pool update)
    silverrec inspect DIR
    silverrec serve DIR [--host H] [--port P] [--max-batch N] [--max-wait-ms MS] [--workers W] [--threads T] [--tune F]
                        [--device cuda]   (query / recommend / rank / evaluate take --device too)
    torchrun --nproc-per-node N -m silverrec serve DIR --sharded [--shard-timeout S]   (sharded snapshot across ranks)
    silverrec tune DIR [--out F] [--seconds S]            (workers x threads per concurrency, read by serve)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from silverrec.errors import SilverrecError


RESIDUAL = {"auto": "auto", "on": True, "off": False}  # --residual -> IVFConfig.residual


def _train(args: argparse.Namespace) -> int:
    if args.generative:
        return _train_generative(args)
    from silverrec.publish.train import TrainConfig, train

    cfg = TrainConfig.from_toml(args.config, minutes=args.minutes, seed=args.seed, stage=args.stage)
    ckpt = train(cfg, args.out)
    print(json.dumps({"checkpoint": str(args.out), "metrics": ckpt.get("metrics", {}), "stats": ckpt["stats"]}, indent=2))
    return 0


def _train_generative(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from silverrec.publish.train_generative import TrainConfig, train

    cfg = TrainConfig.from_toml(args.config, minutes=args.minutes, seed=args.seed, stage=args.stage)
    _, sids, metrics = train(cfg, args.out)
    print(json.dumps({"checkpoint": str(args.out), "metrics": asdict(metrics), "semantic_ids": sids.stats.to_dict()},
                     indent=2))
    return 0


def _publish(args: argparse.Namespace) -> int:
    from silverrec.publish.pool import read_pool

    if args.config is not None:
        from silverrec.publish.rec import PublishConfig, publish_rec

        if args.pool is not None:
            raise SilverrecError("give either --config (a recommendation model) or --pool (an index), not both")
        from silverrec.publish.byo import ByoConfig, is_byo_config, publish_byo

        if is_byo_config(args.config):  # a [user_tower] table: the user's own towers and OverArch
            out = publish_byo(ByoConfig.from_toml(args.config), args.out, overwrite=args.overwrite)
        else:
            out = publish_rec(PublishConfig.from_toml(args.config), args.out, overwrite=args.overwrite)
        print(f"published {out}")
        return 0
    if args.pool is None:
        raise SilverrecError("publish needs --pool POOL.parquet or --config publish.toml")

    pool = read_pool(args.pool)
    print(f"pool: {pool.size} items, dim {pool.dim}, features {sorted(pool.features) or 'none'}", file=sys.stderr)
    if args.shard_by is not None and args.shards is None:
        raise SilverrecError("--shard-by needs --shards S")
    if getattr(args, "generative", False):
        out = _publish_generative(pool, args)
    elif args.shards is not None:
        out = _publish_sharded(pool, args)
    else:
        out = _publish_index(pool, args)
    print(f"published {out}")
    return 0


def _publish_index(pool, args) -> Path:
    """A pure-ANN snapshot: int8 IVF (one cluster with --exact) + the filter bank of the pool's
    categorical columns, in the root module's retrieval-only configuration."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.ivf import IVFConfig

    return publish_index(pool, args.out, config=IVFConfig(nlist=args.nlist, seed=args.seed, residual=RESIDUAL[args.residual]),
                         exact=args.exact,
                         bloom_bits=args.bloom_bits, bloom_hashes=args.bloom_hashes, overwrite=args.overwrite,
                         release_embeddings=True)


def _publish_generative(pool, args) -> Path:
    from silverrec.publish.generative import publish_from_pool

    return publish_from_pool(
        pool, args.out, model=args.model, beam_width=args.beam_width, top_k=args.top_k, weights=args.weights,
        overwrite=args.overwrite,
    )


def _publish_sharded(pool, args) -> Path:
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.shards import DEFAULT_SHARD_BY, ShardSpec, publish_sharded

    spec = ShardSpec(args.shards, args.shard_by or DEFAULT_SHARD_BY)
    config = IVFConfig(nlist=1 if args.exact else args.nlist, seed=args.seed, residual=RESIDUAL[args.residual])
    return publish_sharded(pool, args.out, spec=spec, config=config, bloom_bits=args.bloom_bits,
                           bloom_hashes=args.bloom_hashes, overwrite=args.overwrite)


def _query(args: argparse.Namespace) -> int:
    import silverrec

    snap = silverrec.load(args.snapshot, backend=args.backend, device=args.device)
    if snap.kind == "generative":
        return _query_generative(snap, args)
    if args.queries is None:
        raise silverrec.QueryError("a pure-ANN snapshot needs --queries Q.npy")
    try:
        queries = np.load(args.queries)
    except (OSError, ValueError) as e:
        raise silverrec.QueryError(f"cannot read queries from {args.queries}: {e}") from None
    if queries.dtype != np.float32:
        raise silverrec.QueryError(f"queries in {args.queries} must be float32 [B, D], got {queries.dtype}")
    options = {name: getattr(args, name) for name in ("nprobe", "filter", "max_probe", "mode") if getattr(args, name, None) is not None}
    result = snap.search(queries, args.k, **options)
    _print_result(result, args)
    return 0


def _print_result(result, args: argparse.Namespace) -> None:
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


def _parse_history(text: str, where: str) -> list[int]:
    from silverrec.errors import QueryError

    text = str(text)
    items = [t for t in text.replace(",", " ").split() if t]
    try:
        return [int(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not t.lstrip("-").isdigit())
        raise QueryError(f"{where}: history item id {bad!r} is not an integer") from None


def _query_generative(snap, args: argparse.Namespace) -> int:
    """Next items for each history: --history "1,2,3" (one request) or --history-file (one per line)."""
    from silverrec.errors import QueryError, check_k

    histories = []
    if args.history is not None:
        histories.append(_parse_history(args.history, "--history"))
    if args.history_file is not None:
        try:
            lines = Path(args.history_file).read_text().splitlines()
        except OSError as e:
            raise QueryError(f"cannot read histories from {args.history_file}: {e.strerror}") from None
        histories += [_parse_history(line, f"{args.history_file} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not histories:
        raise QueryError("a generative snapshot needs --history \"id1,id2,...\" or --history-file F")
    width = int(snap.config["beam_width"])
    check_k(args.k, width, "beams (the snapshot's beam_width)")
    result = snap.recommend(histories, exclude_history=args.exclude_history)
    result = type(result)(item_ids=result.item_ids[:, : args.k], scores=result.scores[:, : args.k])
    _print_result(result, args)
    return 0


def _rec_requests(args: argparse.Namespace) -> list[dict]:
    """--user U[,U2,...] (one request per user) or --history IDS (one request)."""
    if (args.user is None) == (args.history is None):
        raise SilverrecError("give exactly one of --user U and --history \"id1,id2,...\"")
    if args.user is not None:
        reqs = [{"user_id": u} for u in _parse_history(args.user, "--user")]
    else:
        reqs = [{"history": _parse_history(args.history, "--history")}]
    for r in reqs:
        if getattr(args, "filter", None):
            r["filter"] = args.filter
    return reqs


def _rec_snapshot(args: argparse.Namespace):
    import silverrec

    snap = silverrec.load(args.snapshot, backend=args.backend, device=args.device)
    if snap.kind != "rec" or snap.spec.answers_search:
        what = f"a {snap.kind!r} snapshot" if snap.kind != "rec" else "a pure-ANN snapshot (published from a pool)"
        raise SilverrecError(f"{args.snapshot} is {what}; {args.command} needs a recommendation model "
                             "(silverrec publish --config)")
    return snap


def _recommend(args: argparse.Namespace) -> int:
    snap = _rec_snapshot(args)
    options = {name: getattr(args, name) for name in ("nprobe", "k0") if getattr(args, name) is not None}
    result = snap.recommend(_rec_requests(args), k=args.k, exclude_history=not args.include_history, **options)
    _print_rec(result, args)
    return 0


def _rank(args: argparse.Namespace) -> int:
    snap = _rec_snapshot(args)
    path = Path(args.items)
    try:
        items = np.load(path).reshape(-1).tolist() if path.suffix == ".npy" else \
            [int(t) for t in path.read_text().replace(",", " ").split()]
    except (OSError, ValueError) as e:
        raise SilverrecError(f"cannot read item ids from {path}: {e}") from None
    reqs = _rec_requests(args)
    if len(reqs) != 1:
        raise SilverrecError("rank scores items for one user: give one --user or one --history")
    _print_rec(snap.rank(reqs[0], items), args)
    return 0


def _print_rec(result, args: argparse.Namespace) -> None:
    if args.json:
        text = json.dumps(result.to_json())
        print(text) if args.json == "-" else Path(args.json).write_text(text)
        return
    for b in range(result.item_ids.shape[0]):
        cells = [f"request {b}:"] if result.item_ids.shape[0] > 1 else []
        for j in range(result.item_ids.shape[1]):
            tasks = " ".join(f"{t}={float(result.task_scores[b, j, i]):.3f}" for i, t in enumerate(result.tasks))
            cells.append(f"  {int(result.item_ids[b, j]):>8}  {float(result.scores[b, j]):8.4f}  {tasks}")
        print("\n".join(cells))


def _evaluate(args: argparse.Namespace) -> int:
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.quality import evaluate_handler

    snap = _rec_snapshot(args)
    split = leave_one_out(read_logs(args.interactions, args.items, args.users, seed=args.seed))
    metrics = evaluate_handler(snap.rec_handler(), split, args.stage)
    metrics["users"] = int(len(split.eval_users))
    print(json.dumps(metrics, indent=2) if args.json else "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    return 0


def _update(args: argparse.Namespace) -> int:
    from silverrec.publish.update import update_snapshot

    if args.upsert is None and args.delete is None:
        raise SilverrecError("update needs --upsert ITEMS.parquet and/or --delete IDS")
    out = update_snapshot(args.snapshot, args.out, upsert=args.upsert, delete=args.delete, overwrite=args.overwrite)
    config = json.loads((out / "manifest.json").read_text())["config"]
    _print_update_advice(config)
    _print_stages(config["update"].get("timings"))
    print(f"published {out}")
    return 0


def _print_update_advice(config: dict) -> None:
    up = config.get("update")
    if not up:
        return
    c, d = up["counts"], up["drift"]
    print(f"update        generation {up['generation']} of {up['parent']['path']}: {c['inserted']} inserted, "
          f"{c['changed']} changed, {c['deleted']} deleted, {c['items']:,} items")
    print(f"drift         clamped {d['clamped_share']:.2e} (since build {d['clamped_share_since_build']:.2e}), "
          f"upserted since build {d['changed_share_since_build']:.1%}"
          + (f", imbalance {d['imbalance']:.3f} ({d['imbalance_ratio']:.2f}x the build's)" if "imbalance" in d else ""))
    advised = up.get("rebuild_advised") or []
    print("rebuild       " + ("ADVISED: " + "; ".join(advised) if advised else "not needed"))


def _print_stages(report: dict | None) -> None:
    """Time and peak resident memory per stage (manifest build_report / update.timings)."""
    for st in (report or {}).get("stages", []):
        print(f"  stage       {st['seconds']:>8.1f} s  peak RSS {st['peak_rss_bytes'] / 2**30:6.2f} GiB  {st['name']}")


def _print_generative_dtypes(config: dict) -> None:
    """A generative snapshot's stored weight dtype and the compute dtype the publisher measured faster."""
    if "weights_dtype" not in config:
        return
    timing = config.get("compute_timing") or {}
    ms = ", ".join(f"{k} {v:.1f} ms" for k, v in timing.get("median_ms", {}).items())
    where = f" (measured at publish, batch 1: {ms}; {timing.get('measured_on')})" if ms else ""
    print(f"generative    weights {config['weights_dtype']}, compute {config.get('compute_dtype', config['weights_dtype'])}{where}")


def _inspect(args: argparse.Namespace) -> int:
    from silverrec.snapshot import read_manifest

    m = read_manifest(args.snapshot)
    print(f"snapshot      {Path(args.snapshot).resolve()}")
    print(f"kind          {m['kind']}")
    if "spec" in m["config"]:
        sp = m["config"]["spec"]
        print(f"model         tower {sp['tower']}, nlist {sp['nlist']}{' (exact)' if sp['nlist'] == 1 else ''}, "
              f"tasks {sp['tasks']}, cache {sp['cache']}, overarch {sp['overarch']}, value model {sp['value_model']}")
    print(f"format        {m['format_version']} (silverrec {m['silverrec_version']}, torch {m['torch_version']})")
    print(f"created       {m['created']}")
    print(f"items         {m['item_count']:,}")
    print("config")
    for key, value in sorted(m["config"].items()):
        text = json.dumps(value)
        print(f"  {key:<12}{text if len(text) < 200 else text[:197] + '...'}")
    _print_update_advice(m["config"])
    _print_generative_dtypes(m["config"])
    _print_stages(m["config"].get("build_report") or m["config"].get("update", {}).get("timings"))
    print("files")
    for name, meta in sorted(m["files"].items()):
        print(f"  {name:<12}{meta['bytes']:>14,} bytes  sha256 {meta['sha256'][:16]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silverrec", description="Recommendation serving as one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train the two-tower model and the OverArch rankers from interaction logs")
    tr.add_argument("--config", required=True, help="train.toml (logs, tasks, dimensions, minutes), or with "
                    "--generative generative.toml (logs, embeddings, decoder shape, minutes)")
    tr.add_argument("--generative", action="store_true",
                    help="train the generative (semantic-ID) decoder (publish/train_generative.py)")
    tr.add_argument("--out", required=True, help="checkpoint file to write")
    tr.add_argument("--minutes", type=float, default=None, help="training budget (overrides the config)")
    tr.add_argument("--seed", type=int, default=None)
    tr.add_argument("--stage", choices=("test", "valid"), default=None,
                    help="test: fit on train + validation items (default); valid: train items only")
    tr.set_defaults(func=_train)

    pub = sub.add_parser("publish", help="build a snapshot from a trained model (--config) or a candidate pool (--pool)")
    pub.add_argument("--config", default=None, help="publish.toml naming a checkpoint (recommendation model)")
    pub.add_argument("--pool", default=None, help="Parquet: item_id, embedding, categorical features")
    pub.add_argument("--out", required=True, help="snapshot directory to create")
    pub.add_argument("--exact", action="store_true", help="exact int8 index: IVF with one cluster, every search scans every row")
    pub.add_argument("--overwrite", action="store_true", help="replace an existing snapshot atomically")
    pub.add_argument("--nlist", type=int, default=None, help="IVF clusters (default about 4*sqrt(N))")
    pub.add_argument("--residual", choices=sorted(RESIDUAL), default="auto",
                     help="int8 codes of item - centroid: on, off, or auto (whichever reconstructs a sample closer)")
    pub.add_argument("--seed", type=int, default=0, help="IVF k-means seed")
    pub.add_argument("--bloom-bits", type=int, default=None, help="Bloom bits M per item (default: sizing rule, max tokens x K x 1.5)")
    pub.add_argument("--bloom-hashes", type=int, default=None, help="Bloom hash functions K per token (default 7)")
    pub.add_argument("--shards", type=int, default=None, help="split the index into S shard snapshots + a top manifest")
    pub.add_argument("--shard-by", dest="shard_by", choices=("items", "clusters"), default=None,
                     help="sharded: items hashed to shards (default) or whole IVF clusters by size")
    pub.add_argument("--generative", action="store_true", help="generative (semantic-ID beam decode) snapshot")
    pub.add_argument("--model", default=None, help="generative: checkpoint from silverrec train --generative")
    pub.add_argument("--beam-width", dest="beam_width", type=int, default=64, help="generative: beams = items returned (default 64)")
    pub.add_argument("--top-k", dest="top_k", type=int, default=None, help="generative: candidates per beam (default beam width)")
    pub.add_argument("--weights", choices=("auto", "bf16", "fp32"), default="auto", help="generative: weight dtype (auto: bf16 if it agrees with fp32)")
    pub.set_defaults(func=_publish)

    q = sub.add_parser("query", help="top-k items for each query vector")
    q.add_argument("snapshot")
    q.add_argument("--queries", default=None, help=".npy float32 [B, D] (retrieval snapshots)")
    q.add_argument("--history", default=None, help="generative: one history, item ids oldest first, e.g. \"1,50,260\"")
    q.add_argument("--history-file", dest="history_file", default=None, help="generative: one history per line")
    q.add_argument("--exclude-history", dest="exclude_history", action="store_true",
                   help="generative: never recommend an item of the request's history")
    q.add_argument("--k", type=int, required=True)
    q.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or stdout)")
    q.add_argument("--backend", choices=("auto", "export", "torchscript"), default="auto",
                   help="program to run (auto: the one the publisher measured faster)")
    q.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")
    q.add_argument("--nprobe", type=int, default=None, help="IVF clusters to probe (default: the snapshot's)")
    q.add_argument("--filter", default=None, help="attribute filter, e.g. \"genre = Drama AND NOT decade = 1990s\"")
    q.add_argument("--max-probe", dest="max_probe", type=int, default=None, help="filtered search: widest probe (default: the snapshot's)")
    q.add_argument("--mode", choices=("auto", "probed", "unprobed"), default=None, help="filtered search mode (default auto)")
    q.set_defaults(func=_query)

    for name, fn, text in (("recommend", _recommend, "top-k items for a user from a recommendation snapshot"),
                           ("rank", _rank, "score given items for a user (early-stage ranking)")):
        r = sub.add_parser(name, help=text)
        r.add_argument("snapshot")
        r.add_argument("--user", default=None, help="user id(s) of the training logs (their stored histories), e.g. 1 or \"1,42\"")
        r.add_argument("--history", default=None, help="item ids oldest first, e.g. \"1,50,260\"")
        r.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or stdout)")
        r.add_argument("--backend", choices=("auto", "export", "torchscript"), default="auto",
                   help="program to run (auto: the one the publisher measured faster)")
        r.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")
        if name == "recommend":
            r.add_argument("--filter", default=None, help="attribute filter, e.g. \"genre = Comedy AND NOT decade = '1990s'\"")
            r.add_argument("--k", type=int, default=10)
            r.add_argument("--k0", type=int, default=None, help="candidates per task (default: the snapshot's)")
            r.add_argument("--nprobe", type=int, default=None)
            r.add_argument("--include-history", dest="include_history", action="store_true",
                           help="may return items of the user's history (excluded by default)")
        else:
            r.add_argument("--items", required=True, help="item ids: a text file (one per line) or .npy")
        r.set_defaults(func=fn)

    ev = sub.add_parser("evaluate", help="leave-one-out HR/NDCG of a recommendation snapshot on interaction logs")
    ev.add_argument("snapshot")
    ev.add_argument("--interactions", required=True)
    ev.add_argument("--items", required=True)
    ev.add_argument("--users", default=None)
    ev.add_argument("--stage", choices=("test", "valid"), default="test")
    ev.add_argument("--seed", type=int, default=0, help="timestamp tie-break seed (as in training)")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--backend", choices=("auto", "export", "torchscript"), default="auto",
                   help="program to run (auto: the one the publisher measured faster)")
    ev.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")
    ev.set_defaults(func=_evaluate)

    up = sub.add_parser("update", help="new snapshot version: upsert and delete items without a full rebuild")
    up.add_argument("snapshot", help="parent snapshot (a pure-ANN snapshot, published from a pool)")
    up.add_argument("--upsert", default=None, help="Parquet of new or changed items (the pool's schema)")
    up.add_argument("--delete", default=None, help="ids to delete: text (one per line) or Parquet with item_id")
    up.add_argument("--out", required=True, help="snapshot directory to create")
    up.add_argument("--overwrite", action="store_true", help="replace an existing snapshot atomically")
    up.set_defaults(func=_update)

    i = sub.add_parser("inspect", help="print a snapshot's manifest")
    i.add_argument("snapshot")
    i.set_defaults(func=_inspect)

    from silverrec.publish.tune import add_serve_parsers

    add_serve_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        return args.func(args)
    except SilverrecError as e:
        print(f"silverrec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
