"""The `silverrec` command: what a serving host runs, with the build commands dispatched to silverrec.publish.

    silverrec query DIR --queries Q.npy --k K [--nprobe P | --target-recall R] [--filter "..."] [--json]
    silverrec query DIR --history "id1,id2,..." [--history-file F] --k K      (snapshots that recommend)
    silverrec recommend DIR --user U | --history "id1,id2,..." [--filter "..."] [--k K] [--target-recall R] [--json]
    silverrec rank DIR --user U | --history IDS --items FILE [--json]      (early-stage ranking)
    silverrec inspect DIR
    silverrec serve DIR [--host H] [--port P] [--workers N] [--max-batch B] [--max-wait-ms MS] [--batch-workers W]
                        [--threads T] [--tune F] [--device cuda]   (query / recommend / rank / evaluate take --device too)
    torchrun --nproc-per-node N -m silverrec serve DIR --sharded [--shard-timeout S]   (sharded snapshot across ranks)
    silverrec tune DIR [--out F] [--seconds S] [--processes 1,2] [--requests F] [--device cuda]
                       (largest batch, server processes, batch workers x threads, window; read by serve;
                       on a device the batch workers are CUDA streams)

Build commands (silverrec/publish/cli.py, imported only when one of them runs, or for --help):

    silverrec train --config train.toml --out model.ckpt [--minutes M] [--seed S] [--stage test|valid]
    silverrec train --generative --config generative.toml --out gen.ckpt [--minutes M] [--seed S] [--stage S]
    silverrec publish --config publish.toml --out DIR                     (recommendation model)
    silverrec publish --pool POOL.parquet --out DIR [--exact] [--nlist N] [--seed S] [--residual auto|on|off]
                      [--spherical auto|on|off] [--target-recall R] [--calibration-queries Q.npy | --no-calibration]
                      [--shards S --shard-by items|clusters]
    silverrec publish --generative --pool POOL --out DIR --model CKPT [--beam-width W] [--top-k K]
    silverrec evaluate DIR --interactions I.parquet --items ITEMS.parquet [--users U.parquet]
    silverrec update DIR --upsert ITEMS.parquet [--delete IDS] --out NEW_DIR   (incremental pool update)
"""

from __future__ import annotations

import argparse
import sys

from silverrec.commands import add_runtime_parsers
from silverrec.errors import SilverrecError

RUNTIME_COMMANDS = ("query", "recommend", "rank", "inspect", "serve", "tune")  # silverrec/commands.py


def build_parser(build: bool = True) -> argparse.ArgumentParser:
    """Every subcommand; with build=False only the runtime ones (nothing of silverrec.publish is imported)."""
    p = argparse.ArgumentParser(prog="silverrec", description="Recommendation serving as one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True)
    if build:
        from silverrec.publish.cli import add_build_parsers

        add_build_parsers(sub)
    add_runtime_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no other option
    args = build_parser(build=command not in RUNTIME_COMMANDS).parse_args(argv)
    try:
        return args.func(args)
    except SilverrecError as e:
        print(f"silverrec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
