"""A filtered snapshot's forward index on disk (forward.npz), kept for incremental updates.

    token_ids int32 [nnz]    every item's (feature, value) token ids, row after row
    offsets   int64 [N + 1]  row r's tokens = token_ids[offsets[r]:offsets[r + 1]], index row order

Written by the publisher (publish/filtered_ivf.py), read back by `silverrec update` (publish/update.py)
to rebuild the filter bank of the rows it keeps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from silverrec.errors import SnapshotError
from silverrec.filtering.forward_index import ForwardIndex

FORWARD_FILE = "forward.npz"


def save_forward(fwd: ForwardIndex, directory: Path) -> None:
    """The forward index in row order, for later updates (FORWARD_FILE)."""
    np.savez(directory / FORWARD_FILE, token_ids=fwd.token_ids.numpy(), offsets=fwd.offsets.numpy())


def read_forward(root: Path, manifest: dict) -> ForwardIndex:
    """The forward index of the snapshot at `root` (its manifest: the filter's features and values).

    Raises:
        SnapshotError: the snapshot has no forward.npz (published before incremental updates existed).
    """
    if FORWARD_FILE not in manifest.get("files", {}):
        raise SnapshotError(
            f"snapshot {root} has no {FORWARD_FILE} (published before incremental updates existed): "
            "re-publish it once, then update"
        )
    data = np.load(root / FORWARD_FILE)
    feats = manifest["config"]["filter"]["features"]
    names = sorted(feats)
    return ForwardIndex(names, [feats[f]["values"] for f in names], torch.from_numpy(data["token_ids"]), torch.from_numpy(data["offsets"]))
