"""Every snapshot kind on CUDA against the same snapshot on CPU: the pure-ANN index (ivf), the
filtered index (filtered_ivf), the generative decode and the recommendation model, each published
small here with the publish code (a snapshot saved by another torch may not load), then loaded as
model.pt2 (moved by torch.export's device pass) and model.ts (map_location) onto the device by the
public `silverrec.load(path, device=...)` and run behind the unchanged predictor API (every
program replayed through GraphedForward, the rank program too); the eager modules moved with
`.to(device)` as well."""

from unittest import mock


import numpy as np
import pytest
import torch

import silverrec
import silverrec.serving.device as device_path
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.generative import build_generative, publish_generative
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.publish.semantic_ids import build_semantic_ids
from silverrec.bitmask import pack_bits
from silverrec.serving.cuda_graphs import EAGER, GraphedForward

from ..reference_beam_search import random_decoder
from ..test_filter_ivf import _pool
from ..test_postings import FILTERS
from .device import FLOAT_TOL, assert_ranking_close

BACKENDS = ["export", "torchscript"]
K = 50


def _on_device(path, backend, device):
    """The snapshot loaded on CPU (the reference) and the same snapshot loaded onto `device`
    (SILVERREC_TEST_DEVICE=cpu: the device path forced on the CPU)."""
    cpu = silverrec.load(path, backend=backend)
    with mock.patch.object(device_path, "MOVE_CPU", True):
        dev = silverrec.load(path, backend=backend, device=device)
    assert dev.device == device and device_path.graph_counts(dev.module)["calls"] >= 0
    return cpu, dev


@pytest.fixture(scope="module")
def index_snapshots(tmp_path_factory):
    root = tmp_path_factory.mktemp("ivf")
    pool, rng = _pool(seed=1)
    queries = torch.from_numpy(pool.embeddings[rng.integers(0, len(pool.item_ids), len(FILTERS))] + 0.1)
    plain = Pool(pool.item_ids, pool.embeddings)
    cfg = IVFConfig(nlist=100, seed=0)
    return {"ivf": publish_index(plain, root / "ivf", config=cfg, torchscript=True),
            "filtered_ivf": publish_index(pool, root / "filtered", config=cfg, torchscript=True)}, queries


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ivf", "filtered_ivf"])
def test_index_snapshot(index_snapshots, kind, backend, cuda):
    paths, queries = index_snapshots
    cpu, dev = _on_device(paths[kind], backend, cuda)
    requests = [{"nprobe": 8}] if kind == "ivf" else [{"filter": FILTERS, "nprobe": 4}, {"filter": FILTERS, "mode": "probed"}]
    warm = device_path.graph_counts(dev.module)  # the shapes the warm-up at load captured (serving/buckets.py)
    for options in requests:
        # the same request shape three times with other queries (padded to its buckets): the first call
        # captures its CUDA graph (k 50 and these nprobe are not warmed at load), the next two replay it
        for q in (queries, queries.flip(0) * 0.9, queries.roll(1, 0) * 1.1):
            want = cpu.search(q, K, **options)
            got = dev.search(q, K, **options)
            assert_ranking_close(got.item_ids, got.scores, want.item_ids, want.scores)
            assert (want.item_ids >= 0).any()
    counts = device_path.graph_counts(dev.module)
    assert counts["captures"] - warm["captures"] == len(requests) and counts["eager"] == 0, counts
    assert counts["replays"] - warm["replays"] == 2 * len(requests), counts
    graphed = dev.module.module.module  # BucketedForward -> OnDevice -> GraphedForward
    assert isinstance(graphed, GraphedForward)
    assert not any(entry is EAGER for entry in graphed.graphs.values()), "a search shape fell back to eager"


@pytest.fixture(scope="module")
def generative(tmp_path_factory):
    g = np.random.default_rng(0)
    x = (g.normal(size=(12, 10))[g.integers(0, 12, 240)] * 3 + g.normal(size=(240, 10))).astype(np.float32)
    ids = g.permutation(np.arange(1000, 5000))[:240].astype(np.int64)
    sids = build_semantic_ids(x, ids, levels=2, codes=8, seed=0, niter=5)
    dec = random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1)
    path = publish_generative(dec, sids, tmp_path_factory.mktemp("gen") / "snap", beam_width=16, top_k=5,
                              max_history=6, weights="fp32")
    histories = [list(g.choice(ids, n, replace=False)) for n in (0, 1, 3, 6, 11)]
    return dec, sids, path, histories


@pytest.mark.parametrize("backend", BACKENDS)
def test_generative_snapshot(generative, backend, cuda):
    """The decode-only RecModel: histories, with and without exclude ids (half the pool)."""
    _, sids, path, histories = generative
    cpu, dev = _on_device(path, backend, cuda)
    rng = np.random.default_rng(0)
    excluded = [rng.choice(sids.item_ids, len(sids.item_ids) // 2, replace=False).tolist() for _ in histories]
    for exclude in ([[]] * len(histories), excluded):
        requests = [{"history": [int(i) for i in h], "exclude": e} for h, e in zip(histories, exclude)]
        want = cpu.recommend(requests, k=16, exclude_history=False)
        got = dev.recommend(requests, k=16, exclude_history=False)
        assert_ranking_close(got.item_ids, got.scores, want.item_ids, want.scores)


def test_generative_module_to_device(generative, cuda):
    """The eager module moved with `.to(device)` (buffers: trie, item ids, RoPE tables)."""
    dec, sids, path, _ = generative
    module = build_generative(dec, sids, 16, 5, torch.float32).eval()
    snap = silverrec.load(path)
    n = snap.manifest["item_count"]
    history = torch.tensor([[0, 0, 1, 3, 12], [1, 5, 14, 2, 11]], dtype=torch.int64)
    bitmask = pack_bits(torch.rand(2, n, generator=torch.Generator().manual_seed(1)) < 0.7)
    with torch.inference_mode():
        want = module(history, bitmask)
        got = module.to(cuda)(history.to(cuda), bitmask.to(cuda))
    assert_ranking_close(got[0], got[1], *want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recommendation_model(backend, cuda, tmp_path_factory):
    pytest.importorskip("torchrec", reason="the recommendation model's user tower needs torchrec + fbgemm_gpu")
    from ..rec_fixtures import rec_setup

    rec = rec_setup(tmp_path_factory)
    cpu, dev = _on_device(rec.snap_dir, backend, cuda)
    requests = [{"user_id": int(u)} for u in rec.logs.user_ids[:8]]
    want = cpu.recommend(requests, k=10)
    got = dev.recommend(requests, k=10)
    assert_ranking_close(got.item_ids, got.scores, want.item_ids, want.scores)
    items = [int(i) for i in want.item_ids[0]]  # early-stage ranking: rank.pt2 / the TorchScript method
    with mock.patch.object(device_path, "MOVE_CPU", True):
        got = dev.rank(requests[0], items)
    want = cpu.rank(requests[0], items)
    assert torch.equal(got.item_ids, want.item_ids)
    torch.testing.assert_close(got.scores, want.scores, **FLOAT_TOL)


@pytest.mark.parametrize("user_form", ["pt2", "entry"])
def test_byo_recommendation_model(user_form, cuda, tmp_path):
    """The recommendation model without TorchRec (a team's own plain-PyTorch towers and list-wise
    OverArch, examples/byo; an entry-point tower without an OverArch): the whole forward (user
    tower, filtered IVF search, candidate_rows, the OverArch, top-k) on the device, replayed from CUDA graphs, == the same snapshot on the CPU,
    with and without a request filter and a filter template that excludes the history."""
    from silverrec.publish.byo import publish_byo

    from ..test_byo import DIM, GENRES, K, N, config, make_world

    (tmp_path / "world").mkdir()
    world = make_world(tmp_path / "world")
    arch = {"entry": "models:ListwiseRanker", "args": {"dim": DIM, "feat_dim": 1, "width": 16, "heads": 2},
            "path": "arch_state.pt", "mask": True}
    user = ({"path": "user.pt2"} if user_form == "pt2" else
            {"entry": "models:UserTower", "path": "user_state.pt",
             "args": {"num_items": N, "num_values": len(GENRES), "dim": DIM, "hidden": 16}})
    arch = arch if user_form == "pt2" else None  # with and without the OverArch stage
    out = publish_byo(config(world, user, arch, filter_template="NOT item_id IN $history"), tmp_path / "snap")
    backends = ["export"] + (["torchscript"] if (out / "model.ts").exists() else [])
    rng = np.random.default_rng(3)
    histories = [world["item_ids"][rng.choice(N, size=int(rng.integers(1, 7)), replace=False)].tolist()
                 for _ in range(6)]
    for backend in backends:
        cpu, dev = _on_device(out, backend, cuda)
        for filt in (None, "genre IN (a, b)"):
            for requests in ([{"history": histories[0], "filter": filt}],
                             [{"history": h, "filter": filt} for h in histories]):
                want = cpu.recommend(requests, k=K)
                for _ in range(3):  # eager, capture, replay (GraphedForward)
                    got = dev.recommend(requests, k=K)
                    assert_ranking_close(got.item_ids, got.scores, want.item_ids, want.scores)


def test_sharded_runtime_on_device(cuda, tmp_path):
    """`silverrec serve --sharded --device cuda`'s runtime (one rank, gloo): its shards loaded onto
    the device answer like the same sharded snapshot served on the CPU in one process."""
    import socket

    from silverrec.publish.shards import ShardSpec, publish_sharded
    from silverrec.serving.distributed import ShardedRuntime

    from ..test_shards import D, make_pool

    pool = make_pool()
    path = publish_sharded(pool, tmp_path / "s2", spec=ShardSpec(2, "items"), config=IVFConfig(nlist=40, seed=0),
                           torchscript=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mock.patch.object(device_path, "MOVE_CPU", True):
        rt = ShardedRuntime(path, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30.0,
                            device=str(cuda))
    try:
        assert all(s.device == cuda and isinstance(s.module.module, device_path.OnDevice) for s in rt.shards)
        cpu = silverrec.load(path)
        q = np.random.default_rng(4).standard_normal((8, D)).astype(np.float32)
        for options in ({"nprobe": 8}, {"filter": "tag = t5", "mode": "unprobed"}):
            for _ in range(3):  # eager, capture, replay (GraphedForward per shard)
                got, want = rt.search(q, 40, **options), cpu.search(q, 40, **options)
                assert_ranking_close(got.item_ids, got.scores, want.item_ids, want.scores)
    finally:
        rt.close()
