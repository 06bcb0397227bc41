"""Which ranking of the hybrid's union could beat the better source? (MovieLens)

    python benchmarks/hybrid_fusions.py --test TT GEN --valid TTV GENV [--seeds 0 1 2]

TT / GEN: each seed's two-tower and generative checkpoints at stage "test" ('{seed}' in the path),
TTV / GENV: the same trainings at stage "valid" (the validation split the fusion would be chosen
on). Per split and seed: one hybrid model built as benchmarks/recommend.py's `sources_quality`
builds it (MoL OverArch + value model, K1 256, beam 64) with the neutral fusion; its union of
candidates per eval user (publish/fusion.py `union_tensors`: each candidate's value, the beam's
log-prob, which source found it), plus the decoder's teacher-forced log-prob of *every* candidate
(the beam with one beam per first-level code: every item's exact log-prob, 2-level semantic IDs).
Each fusion family below is then ranked from those tensors (full ranking, known items excluded),
NDCG@10 / HR@10 mean and sample std over seeds, on both splits:

- the sources alone, as the snapshot serves them (`fused_topk`: ANN by value; the decode's rows by
  value + 0.5 x log-prob);
- publish/fusion.py's family: value + w x the log-prob the forward ranks with (exact for the
  decode's rows and the ANN rows whose prefix its last step extends, else the first code's), w in
  `WEIGHTS`, each priority;
- reciprocal rank fusion (Cormack et al. 2009; c 10 and 60) of the value ranking of the ANN's rows
  and the log-prob ranking of the decode's rows;
- value + w x the decoder's full log-prob of every candidate (no lower bound);
- the decoder's full log-prob alone over the union (how good the decoder is as a ranker).

A family beats "the better source" only if it does so on both splits. Writes
benchmarks/results/hybrid_fusions.json (--name: another name; hybrid_fusions_4000steps.json holds
the same study with decoders trained for 4,000 steps instead of 1,000).

Checkpoints of the recorded run: two-tower `benchmarks/quality.py` (1,500 / 150 steps, its temporary
directory's seed{S}.ckpt), stage valid the same config with `stage = "valid"`; decoders
publish/train_generative.py's TrainConfig(embeddings=that two-tower checkpoint, max_steps=1000,
eval_beam=64, seed=S[, stage="valid"]).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("SILVERREC_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402
from recommend import CANDIDATES, K0, OVERARCH, SOURCE_BEAM, VALUE_MODEL  # noqa: E402

from silverrec.candidates import FOUND_ANN, FOUND_GENERATIVE, SOURCES  # noqa: E402
from silverrec.spec import PRIORITIES  # noqa: E402
from silverrec.publish import movielens  # noqa: E402
from silverrec.publish.evaluate import mean_and_spread, metrics_from_ranks, ranks_from_topk  # noqa: E402
from silverrec.publish.fusion import WEIGHTS, fused_topk, union_tensors  # noqa: E402
from silverrec.publish.logs import leave_one_out, read_logs  # noqa: E402
from silverrec.publish.quality import K_EVAL, handler_for  # noqa: E402
from silverrec.publish.rec import PublishConfig, build_rec_model  # noqa: E402



@torch.no_grad()
def full_log_probs(model, split, stage: str, batch: int = 32) -> torch.Tensor:
    """The decoder's log-prob of every item for each eval user, float32 [U, N] by canonical row:
    the prefill's first-level log-probs plus, with one beam per first-level code, every code's
    second-level log-probs (semantic IDs of exactly 2 levels)."""
    gs = model.sources.decode.generative  # the hybrid's decode (HybridSources)
    r, dec = gs.retrieval, gs.retrieval.decoder
    if r.n_levels != 2:
        raise SystemExit(f"full scoring needs 2-level semantic IDs, the decoder has {r.n_levels}")
    item_to_row = {int(it): i for i, it in enumerate(model.sources.ann.index.row_to_item.long().tolist())}
    ids = split.logs.item_ids
    hists = split.histories(split.eval_users, stage)
    paths = r.trie.leaf_paths
    out = []
    for s in range(0, len(hists), batch):
        hs = hists[s:s + batch]
        H = max(2, max(len(h) for h in hs))
        hist = torch.full((len(hs), H), -1, dtype=torch.int64)
        for b, h in enumerate(hs):
            if len(h):
                hist[b, H - len(h):] = torch.tensor([item_to_row[int(x)] for x in ids[h]])
        tokens = gs.history_tokens(hist)
        B, C0 = tokens.shape[0], r.level_sizes[0]
        key_valid = tokens != 0
        last, sk, sv = dec.prefill(tokens)
        cache = sk.new_zeros(2, dec.n_layers, B * C0, 1, dec.n_kv_heads, dec.head_dim).float()
        first = torch.arange(C0).expand(B, C0) + r.level_offsets[0]
        logits = dec.decode(first, key_valid.long().sum(1), sk.float(), sv.float(), key_valid, cache[0], cache[1], 0)
        total = r._level_logprobs(last, 0)[:, :, None] + r._level_logprobs(logits, 1)  # [B, C0, C1]
        leaf = total[:, paths[:, 0], paths[:, 1]]  # [B, N] trie order
        canon = torch.empty_like(leaf)
        canon[:, gs.trie_to_canon] = leaf
        out.append(canon.float())
    return torch.cat(out)


def split_tensors(tt: str, gen: str, seed: int, stage: str, logs: Path) -> dict[str, torch.Tensor]:
    """union_tensors of the neutral hybrid (stage `stage`) + each candidate's full decoder log-prob."""
    pcfg = PublishConfig(checkpoint=tt, overarch=OVERARCH, value_model=VALUE_MODEL, k0=K0, candidates=CANDIDATES,
                         sources=list(SOURCES), generative_checkpoint=gen, beam_width=SOURCE_BEAM,
                         generative_weight=0.0, source_priority="none", torchscript=False)
    handler = handler_for(build_rec_model(pcfg))
    split = leave_one_out(read_logs(logs / "interactions.parquet", logs / "items.parquet", None, seed=seed))
    u = union_tensors(handler, split, stage)
    full = full_log_probs(handler.module, split, stage)
    r2i = handler.module.sources.ann.index.row_to_item.long()
    row_of = torch.full((int(r2i.max()) + 1,), 0, dtype=torch.int64)
    row_of[r2i] = torch.arange(r2i.numel())
    real = u["item_ids"] >= 0
    u["full_log_prob"] = torch.where(real, full.gather(1, row_of[u["item_ids"].clamp_min(0)]), float("-inf"))
    beam = (u["found_by"] & FOUND_GENERATIVE) != 0
    gap = (u["full_log_prob"][beam] - u["log_prob"][beam]).abs().max() if beam.any() else torch.tensor(0.0)
    if float(gap) > 1e-3:  # the full scoring must reproduce the beam's scores where the beam found the row
        raise SystemExit(f"full log-probs disagree with the beam's by {float(gap)}")
    return u


def top_of(u, score: torch.Tensor) -> torch.Tensor:
    s = torch.where(u["item_ids"] >= 0, score, float("-inf"))
    top = s.topk(K_EVAL, dim=1)
    return torch.where(top.values > float("-inf"), u["item_ids"].gather(1, top.indices), -1)


def ranks_within(score: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """1-based rank of each entry among the kept ones of its row, by descending score."""
    order = torch.where(keep, score, float("-inf")).argsort(dim=1, descending=True, stable=True)
    pos = torch.arange(score.shape[1]).expand_as(order).contiguous()
    return torch.empty_like(order).scatter_(1, order, pos) + 1


def families(u) -> dict[str, torch.Tensor]:
    """Every fusion's top-K_EVAL item ids [U, K_EVAL]."""
    real = u["item_ids"] >= 0
    fa, fg = real & ((u["found_by"] & FOUND_ANN) != 0), real & ((u["found_by"] & FOUND_GENERATIVE) != 0)
    out = {"ann only": fused_topk(u, "ann", 0.0), "generative only": fused_topk(u, "generative", 0.5)}
    for w in WEIGHTS:
        for p in PRIORITIES:
            out[f"value + {w:g} x beam log-prob, priority {p}"] = fused_topk(u, "hybrid", w, p)
    ra, rg = ranks_within(u["value"], fa), ranks_within(u["log_prob"], fg)
    for c in (10, 60):
        out[f"reciprocal rank fusion, c {c}"] = top_of(u, torch.where(fa, 1.0 / (c + ra), 0.0) + torch.where(fg, 1.0 / (c + rg), 0.0))
    for w in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0):
        out[f"value + {w:g} x full log-prob"] = top_of(u, u["value"] + w * u["full_log_prob"])
    out["full log-prob alone"] = top_of(u, u["full_log_prob"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--test", nargs=2, required=True, metavar=("TT", "GEN"))
    p.add_argument("--valid", nargs=2, required=True, metavar=("TTV", "GENV"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--logs", default="/tmp/silverrec_movielens_logs")
    p.add_argument("--name", default="hybrid_fusions", help="results name (hybrid_fusions_4000steps: 4,000-step decoders)")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    movielens.write_logs(args.logs)
    per = {}  # (split, family) -> per-seed metrics
    for stage, (tt, gen) in (("valid", args.valid), ("test", args.test)):
        for seed in args.seeds:
            t0 = time.perf_counter()
            u = split_tensors(tt.replace("{seed}", str(seed)), gen.replace("{seed}", str(seed)), seed, stage, Path(args.logs))
            for name, top in families(u).items():
                m = metrics_from_ranks(ranks_from_topk(top, u["targets"]))
                per.setdefault((stage, name), []).append({k: m[k] for k in ("NDCG@10", "HR@10", "HR@100")})
            print(f"{stage} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (stage, name), runs in per.items():
        summary = mean_and_spread(runs)
        rows.append({"split": stage, "fusion": name, **{k: [round(v, 5) for v in mv] for k, mv in summary.items()},
                     "per_seed_ndcg10": [round(r["NDCG@10"], 5) for r in runs]})
    best = {s: max(r["NDCG@10"][0] for r in rows if r["split"] == s and r["fusion"] in ("ann only", "generative only"))
            for s in ("valid", "test")}
    beats = sorted({r["fusion"] for r in rows if r["split"] == "valid" and r["NDCG@10"][0] > best["valid"]}
                   & {r["fusion"] for r in rows if r["split"] == "test" and r["NDCG@10"][0] > best["test"]})
    for s in ("valid", "test"):
        print(f"\n{s}: better source NDCG@10 {best[s]:.4f}")
        for r in sorted((r for r in rows if r["split"] == s), key=lambda r: -r["NDCG@10"][0])[:12]:
            print(f"  {r['fusion']:<48} NDCG@10 {r['NDCG@10'][0]:.4f} +- {r['NDCG@10'][1]:.4f}  HR@10 {r['HR@10'][0]:.4f}")
    verdict = f"fusions above the better source on both splits: {beats or 'none'}"
    print(verdict)
    write_results(args.name, {"seeds": args.seeds, "test": args.test, "valid": args.valid, "k_eval": K_EVAL},
                  rows + [{"better_source_ndcg10": best, "verdict": verdict}])
    replot(args.name, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """NDCG@10 (mean +- std over seeds) of every ranking of the union, validation and test split side by side."""
    rows = [r for r in payload["rows"] if "fusion" in r]
    series = {split: ([r["fusion"] for r in rows if r["split"] == split], [r["NDCG@10"][0] for r in rows if r["split"] == split],
                      [r["NDCG@10"][1] for r in rows if r["split"] == split]) for split in ("valid", "test")}
    best = next(r["better_source_ndcg10"] for r in payload["rows"] if "better_source_ndcg10" in r)
    save_plot(path, [Panel(f"NDCG@10 over seeds {payload['config']['seeds']}; dashed: the better source on test",
                           "ranking of the hybrid's union", "NDCG@10", series, kind="barh", ref=best["test"],
                           ref_label="better source (test)")],
              "which ranking of the hybrid's candidates could beat the better source? (MovieLens)", height=10, width=9)


if __name__ == "__main__" and not plot_only(plot, "hybrid_fusions"):
    raise SystemExit(main())
