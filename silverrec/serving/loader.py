"""`silverrec.load`: a snapshot directory -> the object that answers its requests.

A top manifest (kind "sharded", `silverrec publish --shards S`) loads as a `ShardedSnapshot` (every
shard verified and loaded alone, answering in this process); any other snapshot as a predictor
`Snapshot`. This module sits above both, so neither imports the other's loader.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from silverrec.serving.device import resolve_device
from silverrec.serving.predictor import Snapshot, load_snapshot
from silverrec.serving.sharded import SHARDED_KIND, ShardedSnapshot, load_sharded
from silverrec.snapshot import read_manifest


def load(path: str | os.PathLike, backend: str = "auto", verify: bool = True,
         device: str | torch.device = "cpu", buckets: Any = True, streams: int = 1) -> Snapshot | ShardedSnapshot:
    """Verify and load a snapshot (arguments and errors: `predictor.load_snapshot`; a sharded snapshot's
    shards load with the defaults of `buckets` and `streams`)."""
    device = resolve_device(device)  # a bad device is refused before anything is read
    if read_manifest(path, verify=False).get("kind") == SHARDED_KIND:  # a top manifest: shards verify alone
        return load_sharded(path, backend=backend, verify=verify, device=device)
    return load_snapshot(path, backend=backend, verify=verify, device=device, buckets=buckets, streams=streams)
