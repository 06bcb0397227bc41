"""Train the example's own towers and list-wise OverArch on the bundled MovieLens, save them in the
three forms `publish.toml` names (about a minute on 2 CPU cores).

    .venv/bin/python examples/byo/train.py [--seconds 60]      # writes examples/byo/out/

Writes out/logs/{interactions,items}.parquet (the generic logs, publish/movielens.py `write_logs`),
out/vocab.json (the genre vocabulary the towers were trained with), out/user_tower.pt2
(torch.export), out/item_tower.ts (TorchScript) and out/overarch.pt (a state dict for the entry
point models:ListwiseRanker). The models themselves (models.py) are plain PyTorch.

Training: two-tower sampled softmax over in-batch negatives on (history prefix -> next item) pairs,
then the list-wise ranker on the towers' own top-K0 candidates (softmax over the list, the true next
item as the label). Each user's last item is held out; HR@10 / HR@100 on it are printed for the
exact two-tower retrieval and after the ranker.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import silverrec  # noqa: F401  (first: it sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP;
#                  spinning OpenMP workers made training steps many times slower on a loaded machine)
import numpy as np
import torch
import torch.nn.functional as F
from torch.export import Dim

from models import ItemTower, ListwiseRanker, UserTower
from silverrec.publish.logs import read_logs
from silverrec.publish.movielens import write_logs

HERE = Path(__file__).resolve().parent
DIM, HISTORY, RECENT, K0, FEATURE = 32, 50, 5, 100, "genre"
RANKER = {"dim": DIM, "feat_dim": 0, "width": 32, "heads": 2, "layers": 1}  # = publish.toml [overarch.args]


def user_inputs(histories: list[np.ndarray], codes: list[list[int]]):
    """The user tower's KJT (hist_item, recent_item, hist_genre) for pool-row histories."""
    hist = [h[-HISTORY:] for h in histories]
    recent = [h[-RECENT:] for h in hist]
    genre = [np.asarray([c for r in h for c in codes[r]], dtype=np.int64) for h in hist]
    parts = hist + recent + genre
    values = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    lengths = torch.tensor([len(p) for p in parts], dtype=torch.int32)
    dense = torch.tensor([[np.log1p(len(h))] for h in histories], dtype=torch.float32)
    return values, lengths, dense


def item_inputs(rows: np.ndarray, codes: list[list[int]]):
    """The item tower's KJT (item, genre) for pool rows."""
    genre = [np.asarray(codes[r], dtype=np.int64) for r in rows]
    values = torch.from_numpy(np.concatenate([rows.astype(np.int64), *genre]))
    lengths = torch.tensor([1] * len(rows) + [len(g) for g in genre], dtype=torch.int32)
    return values, lengths, torch.zeros(len(rows), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="training time, split 2:1 towers:ranker")
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    inter, items = write_logs(out / "logs")
    logs = read_logs(inter, items, seed=args.seed)
    vocab = sorted({v for vals in logs.item_features[FEATURE] for v in vals})
    index = {v: i + 1 for i, v in enumerate(vocab)}
    codes = [[index[v] for v in vals] for vals in logs.item_features[FEATURE]]
    seqs = [logs.user_items(u) for u in range(logs.num_users)]
    train = [s[:-1] for s in seqs]  # the last item is held out
    pairs = np.asarray([(u, t) for u, s in enumerate(train) for t in range(1, len(s))])  # history s[:t] -> s[t]
    n = logs.num_items
    user = UserTower(n, len(vocab), dim=DIM)
    item = ItemTower(n, len(vocab), dim=DIM)

    # --- two-tower: in-batch sampled softmax, temperature 0.05
    opt = torch.optim.Adam([*user.parameters(), *item.parameters()], lr=1e-2)
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds * 2 / 3:
        batch = pairs[rng.integers(0, len(pairs), 512)]
        hist = [train[u][:t] for u, t in batch]
        target = np.asarray([train[u][t] for u, t in batch])
        logits = user(*user_inputs(hist, codes)) @ item(*item_inputs(target, codes)).T / 0.05
        same = torch.from_numpy(target[:, None] == target[None, :]) & ~torch.eye(len(target), dtype=torch.bool)
        loss = F.cross_entropy(logits.masked_fill(same, float("-inf")), torch.arange(len(target)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    print(f"two-tower: {steps} steps, last loss {loss.item():.3f}")
    user.eval()
    item.eval()
    with torch.no_grad():
        emb = item(*item_inputs(np.arange(n), codes))

    def candidates(hist: list[np.ndarray]):
        """The towers' top-K0 pool rows per history (its own items masked) and the user embeddings."""
        with torch.no_grad():
            u = user(*user_inputs(hist, codes))
            scores = u @ emb.T
            for b, h in enumerate(hist):
                scores[b, torch.from_numpy(h)] = float("-inf")
            return torch.topk(scores, K0, dim=1).indices, u

    # --- the list-wise ranker on the towers' own candidates
    ranker = ListwiseRanker(**RANKER)
    opt = torch.optim.Adam(ranker.parameters(), lr=1e-3)
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds / 3:
        batch = pairs[rng.integers(0, len(pairs), 128)]
        hist = [train[u][:t] for u, t in batch]
        target = torch.from_numpy(np.asarray([train[u][t] for u, t in batch]))
        cand, u = candidates(hist)
        hit = cand == target[:, None]
        keep = hit.any(dim=1)
        if not bool(keep.any()):
            continue
        scores = ranker(u[keep, None], emb[cand[keep]], torch.zeros(int(keep.sum()), K0, 0),
                        torch.ones(int(keep.sum()), K0, dtype=torch.bool))[:, :, 0]
        loss = F.cross_entropy(scores, hit[keep].float().argmax(dim=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    print(f"list-wise ranker: {steps} steps, last loss {loss.item():.3f}")
    ranker.eval()

    # --- held-out last items: HR@10 / HR@100 before and after the ranker
    hist = train
    target = torch.tensor([s[-1] for s in seqs])
    cand, u = candidates(hist)
    with torch.no_grad():
        reranked = ranker(u[:, None], emb[cand], torch.zeros(len(hist), K0, 0), torch.ones(len(hist), K0, dtype=torch.bool))
    order = cand.gather(1, reranked[:, :, 0].argsort(dim=1, descending=True))
    for name, ranked in (("two-tower exact", cand), ("+ list-wise ranker", order)):
        hr = {k: float((ranked[:, :k] == target[:, None]).any(dim=1).float().mean()) for k in (10, 100)}
        print(f"{name:20s} HR@10 {hr[10]:.4f}  HR@100 {hr[100]:.4f}  ({len(hist)} users, last item held out)")

    # --- save: user tower as a torch.export program, item tower as TorchScript, ranker as a state dict
    batch = Dim("batch", min=1, max=1 << 16)
    example = user_inputs([np.arange(3), np.arange(2)], codes)
    program = torch.export.export(user, example, strict=False, dynamic_shapes={
        "values": {0: Dim.DYNAMIC}, "lengths": {0: 3 * batch}, "dense": {0: batch}})
    torch.export.save(program, out / "user_tower.pt2")
    torch.jit.save(torch.jit.script(item), str(out / "item_tower.ts"))
    torch.save(ranker.state_dict(), out / "overarch.pt")
    (out / "vocab.json").write_text(json.dumps({"item_features": {FEATURE: vocab}}))
    print(f"saved {out}/user_tower.pt2, item_tower.ts, overarch.pt, vocab.json")


if __name__ == "__main__":
    main()
