"""The build commands of `silverrec`: train, publish, evaluate, update (their usage: silverrec/cli.py).

The entry point (silverrec/cli.py) imports this module only when one of them runs, or for --help, so
the runtime commands never import silverrec.publish.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from silverrec.commands import add_program_args, print_stages, print_update_advice, rec_snapshot
from silverrec.errors import SilverrecError


RESIDUAL = {"auto": "auto", "on": True, "off": False}  # --residual / --spherical -> IVFConfig.residual / spherical


def _ivf_config(args: argparse.Namespace, nlist=None):
    from silverrec.publish.ivf import IVFConfig

    return IVFConfig(nlist=args.nlist if nlist is None else nlist, seed=args.seed, residual=RESIDUAL[args.residual],
                     spherical=RESIDUAL[args.spherical])


def _calibration(args: argparse.Namespace):
    """--target-recall / --calibration-queries / --no-calibration -> CalibrationConfig or None."""
    import numpy as np

    from silverrec.publish.calibrate import CalibrationConfig

    if args.no_calibration:
        if args.calibration_queries is not None or args.target_recall is not None:
            raise SilverrecError("--no-calibration takes neither --target-recall nor --calibration-queries")
        return None
    queries = None
    if args.calibration_queries is not None:
        try:
            queries = np.load(args.calibration_queries)
        except (OSError, ValueError) as e:
            raise SilverrecError(f"cannot read calibration queries from {args.calibration_queries}: {e}") from None
        if queries.dtype != np.float32:
            raise SilverrecError(f"calibration queries in {args.calibration_queries} must be float32 [Q, D], got {queries.dtype}")
    return CalibrationConfig(**({} if args.target_recall is None else {"target_recall": args.target_recall}), queries=queries)


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

    return publish_index(pool, args.out, config=_ivf_config(args), exact=args.exact, bloom_bits=args.bloom_bits,
                         bloom_hashes=args.bloom_hashes, overwrite=args.overwrite, release_embeddings=True,
                         calibration=_calibration(args))


def _publish_generative(pool, args) -> Path:
    from silverrec.publish.generative import publish_from_pool

    return publish_from_pool(
        pool, args.out, model=args.model, beam_width=args.beam_width, top_k=args.top_k, weights=args.weights,
        overwrite=args.overwrite,
    )


def _publish_sharded(pool, args) -> Path:
    from silverrec.publish.shards import DEFAULT_SHARD_BY, ShardSpec, publish_sharded

    if args.target_recall is not None or args.calibration_queries is not None:
        raise SilverrecError("--target-recall / --calibration-queries: a sharded publish keeps the fixed probe defaults")
    spec = ShardSpec(args.shards, args.shard_by or DEFAULT_SHARD_BY)
    config = _ivf_config(args, 1 if args.exact else None)
    return publish_sharded(pool, args.out, spec=spec, config=config, bloom_bits=args.bloom_bits,
                           bloom_hashes=args.bloom_hashes, overwrite=args.overwrite)



def _evaluate(args: argparse.Namespace) -> int:
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.quality import evaluate_handler

    snap = rec_snapshot(args)
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
    print_update_advice(config)
    print_stages(config["update"].get("timings"))
    print(f"published {out}")
    return 0



def add_build_parsers(sub) -> None:
    """The build subcommands: train, publish, evaluate, update."""
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
    pub.add_argument("--spherical", choices=sorted(RESIDUAL), default="auto",
                     help="unit-length k-means centroids: on, off, or auto (when every embedding has the same length)")
    pub.add_argument("--seed", type=int, default=0, help="IVF k-means seed")
    pub.add_argument("--target-recall", dest="target_recall", type=float, default=None,
                     help="--pool: the recall@100 the default search is calibrated to on the pool (default 0.95)")
    pub.add_argument("--calibration-queries", dest="calibration_queries", default=None,
                     help="--pool: .npy float32 [Q, D] queries to calibrate with (default: pool items plus noise)")
    pub.add_argument("--no-calibration", dest="no_calibration", action="store_true",
                     help="--pool: keep the fixed probe defaults (no recall measured at publish)")
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

    ev = sub.add_parser("evaluate", help="leave-one-out HR/NDCG of a recommendation snapshot on interaction logs")
    ev.add_argument("snapshot")
    ev.add_argument("--interactions", required=True)
    ev.add_argument("--items", required=True)
    ev.add_argument("--users", default=None)
    ev.add_argument("--stage", choices=("test", "valid"), default="test")
    ev.add_argument("--seed", type=int, default=0, help="timestamp tie-break seed (as in training)")
    ev.add_argument("--json", action="store_true")
    add_program_args(ev)
    ev.set_defaults(func=_evaluate)

    up = sub.add_parser("update", help="new snapshot version: upsert and delete items without a full rebuild")
    up.add_argument("snapshot", help="parent snapshot (a pure-ANN snapshot, published from a pool)")
    up.add_argument("--upsert", default=None, help="Parquet of new or changed items (the pool's schema)")
    up.add_argument("--delete", default=None, help="ids to delete: text (one per line) or Parquet with item_id")
    up.add_argument("--out", required=True, help="snapshot directory to create")
    up.add_argument("--overwrite", action="store_true", help="replace an existing snapshot atomically")
    up.set_defaults(func=_update)
