"""The generative decoder's checkpoint (`silverrec train --generative --out F`): written by the trainer
(publish/train_generative.py), read by the publisher (publish/generative.py) and the hybrid model.

    save_checkpoint(path, decoder, sids, cfg, metrics)
    decoder, sids, meta = load_checkpoint(path)   # RecDecoder (eval), SemanticIds,
                                                  # {"train_config": dict, "metrics": dict}
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from silverrec.errors import PoolError
from silverrec.generative.decoder import DecoderConfig, RecDecoder
from silverrec.publish.semantic_ids import SemanticIds, SemanticIdStats

FORMAT = "silverrec-generative-checkpoint-1"


def save_checkpoint(path: str | Path, decoder: RecDecoder, sids: SemanticIds, cfg: Any, metrics: Any) -> Path:
    """Write decoder config + weights, semantic IDs, the training config and metrics (cfg and metrics:
    train_generative's TrainConfig and Metrics dataclasses; torch.save, weights_only-loadable),
    atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({
        "format": FORMAT,
        "decoder_config": decoder.config.to_dict(),
        "state_dict": {k: v.detach().clone() for k, v in decoder.state_dict().items()},
        "item_ids": torch.from_numpy(sids.item_ids),
        "paths": torch.from_numpy(sids.paths),
        "level_sizes": list(sids.level_sizes),
        "semantic_id_stats": sids.stats.to_dict(),
        "train_config": asdict(cfg),
        "metrics": asdict(metrics),
    }, tmp)
    tmp.replace(path)
    return path


def load_checkpoint(path: str | Path) -> tuple[RecDecoder, SemanticIds, dict[str, Any]]:
    """Inverse of `save_checkpoint`: (decoder in eval mode, semantic IDs, {train_config, metrics})."""
    path = Path(path)
    if not path.is_file():
        raise PoolError(f"generative checkpoint {path} does not exist")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise PoolError(f"cannot read generative checkpoint {path}: {type(e).__name__}: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise PoolError(f"{path} is not a silverrec generative checkpoint")
    decoder = RecDecoder(DecoderConfig.from_dict(ck["decoder_config"]))
    decoder.load_state_dict(ck["state_dict"])
    sids = SemanticIds(ck["item_ids"].numpy(), ck["paths"].numpy(), [], list(ck["level_sizes"]),
                       SemanticIdStats(**ck["semantic_id_stats"]))
    return decoder.eval(), sids, {"train_config": ck["train_config"], "metrics": ck["metrics"]}
