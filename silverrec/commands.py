"""The runtime commands of `silverrec` (what a serving host runs; the entry point is silverrec/cli.py):
query, recommend, rank, inspect, serve, tune, and the helpers the build commands share with them.
Nothing here imports silverrec.publish.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from silverrec.errors import QueryError, SilverrecError


def add_program_args(parser: argparse.ArgumentParser) -> None:
    """--backend and --device: which of a snapshot's programs runs, and where."""
    parser.add_argument("--backend", choices=("auto", "export", "torchscript"), default="auto",
                        help="program to run (auto: the one the publisher measured faster)")
    parser.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")


def _query(args: argparse.Namespace) -> int:
    from silverrec.serving.loader import load

    snap = load(args.snapshot, backend=args.backend, device=args.device)
    spec = getattr(snap, "spec", None)  # (a sharded snapshot has no spec: it answers search)
    if spec is not None and not spec.answers_search:
        return _query_histories(snap, args)
    if args.queries is None:
        raise QueryError("a pure-ANN snapshot needs --queries Q.npy")
    try:
        queries = np.load(args.queries)
    except (OSError, ValueError) as e:
        raise QueryError(f"cannot read queries from {args.queries}: {e}") from None
    if queries.dtype != np.float32:
        raise QueryError(f"queries in {args.queries} must be float32 [B, D], got {queries.dtype}")
    options = {name: getattr(args, name) for name in ("nprobe", "target_recall", "filter", "max_probe", "mode")
               if getattr(args, name, None) is not None}
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
    text = str(text)
    items = [t for t in text.replace(",", " ").split() if t]
    try:
        return [int(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not t.lstrip("-").isdigit())
        raise QueryError(f"{where}: history item id {bad!r} is not an integer") from None


def _query_histories(snap, args: argparse.Namespace) -> int:
    """Next items for each history (a snapshot that answers recommend requests): --history "1,2,3"
    (one request) or --history-file (one per line)."""
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
        raise QueryError("a snapshot that answers recommend requests needs --history \"id1,id2,...\" or "
                         "--history-file F (or use silverrec recommend)")
    requests = [{"history": h, "filter": args.filter} for h in histories]
    _print_result(snap.recommend(requests, k=args.k, exclude_history=args.exclude_history), args)
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


def rec_snapshot(args: argparse.Namespace):
    """The recommendation-model snapshot args.snapshot names (recommend, rank, evaluate); other kinds refused."""
    from silverrec.serving.loader import load

    snap = load(args.snapshot, backend=args.backend, device=args.device)
    if snap.kind != "rec" or snap.spec.answers_search:
        what = f"a {snap.kind!r} snapshot" if snap.kind != "rec" else "a pure-ANN snapshot (published from a pool)"
        raise SilverrecError(f"{args.snapshot} is {what}; {args.command} needs a recommendation model "
                             "(silverrec publish --config)")
    return snap


def _recommend(args: argparse.Namespace) -> int:
    snap = rec_snapshot(args)
    options = {name: getattr(args, name) for name in ("nprobe", "target_recall", "k0") if getattr(args, name) is not None}
    result = snap.recommend(_rec_requests(args), k=args.k, exclude_history=not args.include_history, **options)
    _print_rec(result, args)
    return 0


def _rank(args: argparse.Namespace) -> int:
    snap = rec_snapshot(args)
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



def print_update_advice(config: dict) -> None:
    """An updated snapshot's generation, counts, drift and whether a rebuild is advised (inspect, update)."""
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


def print_stages(report: dict | None) -> None:
    """Time and peak resident memory per stage (manifest build_report / update.timings)."""
    for st in (report or {}).get("stages", []):
        print(f"  stage       {st['seconds']:>8.1f} s  peak RSS {st['peak_rss_bytes'] / 2**30:6.2f} GiB  {st['name']}")


def _print_generative_dtypes(config: dict) -> None:
    """A generative snapshot's stored weight dtype and the compute dtype the publisher measured faster."""
    config = config.get("generative") or {}
    if "weights_dtype" not in config:
        return
    timing = config.get("compute_timing") or {}
    ms = ", ".join(f"{k} {v:.1f} ms" for k, v in timing.get("median_ms", {}).items())
    where = f" (measured at publish, batch 1: {ms}; {timing.get('measured_on')})" if ms else ""
    print(f"generative    weights {config['weights_dtype']}, compute {config.get('compute_dtype', config['weights_dtype'])}{where}")


def print_calibration(config: dict) -> None:
    """The probe defaults publish measured (publish/calibrate.py): target, default nprobe, the curve
    (recall and ms per batch of 16 at each nprobe), the filtered widening and each sampled filter's recall."""
    c = config.get("calibration")
    if not c:
        return
    reached = "reached" if c["reached"] else "NOT reached (the curve's best)"
    seconds = c["seconds"] + c.get("truth_seconds", 0.0)
    build = sum(st["seconds"] for st in (config.get("build_report") or {}).get("stages", []))
    share = f", {seconds / build:.1%} of the build" if build else ""
    print(f"calibration   recall@{c['k']} {c['target_recall']} {reached} at nprobe {c['default_nprobe']} of "
          f"{config['nlist']} ({c['queries']} {c['source'] if c['source'] != 'user' else 'given'} queries, "
          f"{seconds:.1f} s{share})")
    print("  curve       " + ", ".join(f"{p['nprobe']}: {p['recall']:.3f} ({p['ms']:.1f} ms)" for p in c["curve"]))
    if "probe_exponent" in c:
        print(f"  filtered    depth x max(1, k / ({c['k']} x share)) ** {c['probe_exponent']:g}, "
              f"widening up to {c['max_probe_factor']:g} x that depth")
    for f in c.get("filters", []):
        print(f"  {f['selectivity']:>9.4%}   recall {f['recall']:.3f} ({f['ms']:.1f} ms)  {f['filter']}")


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
    print_calibration(m["config"])
    print_update_advice(m["config"])
    _print_generative_dtypes(m["config"])
    print_stages(m["config"].get("build_report") or m["config"].get("update", {}).get("timings"))
    print("files")
    for name, meta in sorted(m["files"].items()):
        print(f"  {name:<12}{meta['bytes']:>14,} bytes  sha256 {meta['sha256'][:16]}")
    return 0



def serve_config(args: argparse.Namespace):
    """The ServeConfig of `silverrec serve`'s flags. Without --workers: the process count `silverrec
    tune` chose (the tune file's "processes"), else one per two cores; without --max-batch / --max-wait-ms:
    the largest batch and the window tune chose, else 64 and 0; the tune file's batch-worker table
    applies unless --batch-workers or --threads is given (or --tune names the file)."""
    from silverrec.serving.app import ServeConfig
    from silverrec.serving.processes import default_processes
    from silverrec.serving.reload import read_token
    from silverrec.serving.tune import default_tune_path, tuned

    sibling = default_tune_path(args.snapshot)
    found = args.tune or (str(sibling) if sibling.is_file() else None)
    tune_file = args.tune
    if tune_file is None and args.batch_workers is None and args.threads is None:
        tune_file = found
    processes = args.workers or (1 if args.sharded else tuned(found, "processes") or default_processes())
    max_batch = args.max_batch if args.max_batch is not None else tuned(found, "max_batch") or 64
    max_wait_ms = args.max_wait_ms if args.max_wait_ms is not None else tuned(found, "max_wait_ms") or 0.0
    return ServeConfig(host=args.host, port=args.port, max_batch=max_batch, max_wait_ms=max_wait_ms,
                       max_queue=args.max_queue, processes=processes, batch_workers=args.batch_workers,
                       threads=args.threads, max_body_bytes=args.max_body_bytes, deadline_ms=args.deadline_ms,
                       admin_token=read_token(args.admin_token_file), tune_file=tune_file, device=args.device)


def _serve(args: argparse.Namespace) -> int:
    from silverrec.serving.server import serve

    config = serve_config(args)
    if args.sharded:  # torchrun (RANK / WORLD_SIZE / MASTER_ADDR) or --rank / --world-size / --init-method
        from silverrec.serving.distributed import serve_http

        if config.processes > 1:
            raise SilverrecError("--sharded serves from rank 0 in one process: drop --workers")
        return serve_http(args.snapshot, config, rank=args.rank, world_size=args.world_size,
                          init_method=args.init_method, timeout_s=args.shard_timeout)
    if config.processes > 1:
        from silverrec.serving.processes import serve_processes

        return serve_processes(args.snapshot, config)
    return serve(args.snapshot, config)


def _tune(args: argparse.Namespace) -> int:
    from silverrec.serving.tune import LEVELS, tune

    try:
        levels = tuple(int(x) for x in args.concurrency.split(",")) if args.concurrency else LEVELS
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise SilverrecError(f"--concurrency must list positive ints, got {args.concurrency!r}")
    processes = None
    if args.processes is not None:
        try:
            processes = tuple(int(x) for x in args.processes.split(",") if x.strip())
        except ValueError:
            processes = (0,)
        if any(n < 1 for n in processes):
            raise SilverrecError(f"--processes must list positive ints (or be empty), got {args.processes!r}")
    requests = None
    if args.requests is not None:
        try:
            requests = [json.loads(line) for line in Path(args.requests).read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            raise SilverrecError(f"cannot read --requests {args.requests}: {type(e).__name__}: {e}") from None
        if not requests or not all(isinstance(r, dict) for r in requests):
            raise SilverrecError(f"--requests {args.requests} must hold one JSON object a line")
    tune(args.snapshot, args.out, seconds=args.seconds, levels=levels, max_batch=args.max_batch,
         max_wait_ms=args.max_wait_ms, processes=processes, requests=requests, device=args.device,
         log=lambda s: print(s, file=sys.stderr))
    return 0


def add_runtime_parsers(sub) -> None:
    """The serving host's subcommands: query, recommend, rank, inspect, serve, tune."""
    q = sub.add_parser("query", help="top-k items for each query vector")
    q.add_argument("snapshot")
    q.add_argument("--queries", default=None, help=".npy float32 [B, D] (retrieval snapshots)")
    q.add_argument("--history", default=None,
                   help="a snapshot that recommends: one history, item ids oldest first, e.g. \"1,50,260\"")
    q.add_argument("--history-file", dest="history_file", default=None,
                   help="a snapshot that recommends: one history per line")
    q.add_argument("--exclude-history", dest="exclude_history", action="store_true",
                   help="a snapshot that recommends: never recommend an item of the request's history")
    q.add_argument("--k", type=int, required=True)
    q.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or stdout)")
    add_program_args(q)
    q.add_argument("--nprobe", type=int, default=None, help="IVF clusters to probe (default: the snapshot's calibrated depth)")
    q.add_argument("--target-recall", dest="target_recall", type=float, default=None,
                   help="instead of --nprobe: the recall@k wanted (mapped through the snapshot's calibration curve)")
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
        add_program_args(r)
        if name == "recommend":
            r.add_argument("--filter", default=None, help="attribute filter, e.g. \"genre = Comedy AND NOT decade = '1990s'\"")
            r.add_argument("--k", type=int, default=10)
            r.add_argument("--k0", type=int, default=None, help="candidates per task (default: the snapshot's)")
            r.add_argument("--nprobe", type=int, default=None)
            r.add_argument("--target-recall", dest="target_recall", type=float, default=None,
                           help="instead of --nprobe: the retrieval's recall@k0 wanted (the snapshot's calibration curve)")
            r.add_argument("--include-history", dest="include_history", action="store_true",
                           help="may return items of the user's history (excluded by default)")
        else:
            r.add_argument("--items", required=True, help="item ids: a text file (one per line) or .npy")
        r.set_defaults(func=fn)

    i = sub.add_parser("inspect", help="print a snapshot's manifest")
    i.add_argument("snapshot")
    i.set_defaults(func=_inspect)

    s = sub.add_parser("serve", help="serve a snapshot over HTTP (batching, deadlines, metrics, hot reload)")
    s.add_argument("snapshot")
    s.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs an admin token)")
    s.add_argument("--port", type=int, default=8080, help="0 = an ephemeral port (printed)")
    s.add_argument("--max-batch", dest="max_batch", type=int, default=None,
                   help="requests per batch (default: the largest batch silverrec tune chose, else 64)")
    s.add_argument("--max-wait-ms", dest="max_wait_ms", type=float, default=None,
                   help="beside a busy batch worker, how long a free one may hold a short queue for a fuller batch "
                        "(default: the window silverrec tune chose, else 0: a request runs at once when a worker is free)")
    s.add_argument("--max-queue", dest="max_queue", type=int, default=1024, help="queued requests before 503 (default 1024)")
    s.add_argument("--workers", type=int, default=None,
                   help="server processes sharing the port, each with its own copy of the snapshot "
                        "(default: the count silverrec tune chose, else one per two cores; --sharded: 1)")
    s.add_argument("--batch-workers", dest="batch_workers", type=int, default=None,
                   help="batches computed at once per process (default: one per two cores of its share, or the tune file)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per batch (default: the cores per batch worker, or the tune file)")
    s.add_argument("--tune", default=None, help="silverrec tune's file (default DIR.tune.json if it exists)")
    s.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")
    s.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=4 << 20, help="413 above (default 4 MiB)")
    s.add_argument("--deadline-ms", dest="deadline_ms", type=float, default=None,
                   help="default per-request deadline (X-Deadline-Ms or body deadline_ms override it)")
    s.add_argument("--admin-token-file", dest="admin_token_file", default=None,
                   help="file holding the reload token (else $SILVERREC_ADMIN_TOKEN)")
    s.add_argument("--sharded", action="store_true",
                   help="serve a sharded snapshot across torch.distributed ranks (launch with torchrun "
                        "--nproc-per-node N -m silverrec serve DIR --sharded): rank 0 serves HTTP")
    s.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="--sharded: this rank (default $RANK)")
    s.add_argument("--world-size", dest="world_size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="--sharded: number of ranks (default $WORLD_SIZE)")
    s.add_argument("--init-method", dest="init_method", default="env://",
                   help="--sharded: rendezvous (default env://, as torchrun sets; or tcp://HOST:PORT)")
    s.add_argument("--shard-timeout", dest="shard_timeout", type=float, default=5.0,
                   help="--sharded: seconds before a request waiting on a dead or stalled rank fails with 503 (default 5)")
    s.set_defaults(func=_serve)

    t = sub.add_parser("tune", help="measure server processes, and batch workers x intra-op threads per concurrency; write the file serve reads")
    t.add_argument("snapshot")
    t.add_argument("--out", default=None, help="output JSON (default DIR.tune.json)")
    t.add_argument("--seconds", type=float, default=1.0, help="per setting and concurrency level (default 1)")
    t.add_argument("--concurrency", default=None, help="levels, e.g. 1,4,16,64 (the default)")
    t.add_argument("--processes", default=None,
                   help="server process counts to compare over HTTP with wrk, e.g. 1,2 (default: 1 and one per core; "
                        "'' skips)")
    t.add_argument("--max-batch", dest="max_batch", type=int, default=64,
                   help="the largest batch size timed (default 64); tune keeps the size that pays, 1 if none")
    t.add_argument("--max-wait-ms", dest="max_wait_ms", type=float, default=None,
                   help="a fixed batch window (default: measured where it acts)")
    t.add_argument("--requests", default=None,
                   help="sample request bodies, one JSON object a line, standing for the served traffic "
                        "(default: generated ones)")
    t.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N (one process; "
                   "its batch workers are CUDA streams)")
    t.set_defaults(func=_tune)
