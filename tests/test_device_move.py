"""A snapshot's model.pt2 moved to another device by torch.export's `move_to_device_pass` (what the
GPU suite and a CUDA predictor do; tests/gpu/device.py program_on) keeps no CPU constant: the
CPU-traced graph burns `device='cpu'` into every factory call, and the pass must rewrite them all.
Checked without a GPU by running the moved program on the meta device (shapes only: a CPU tensor
left anywhere fails with a device mismatch)."""

import numpy as np
import torch

import silverrec
from silverrec.filtering.filter_program import compile_request
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.generative import publish_generative
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.publish.semantic_ids import build_semantic_ids
from silverrec.retrieval.filtered_search import filter_plan
from silverrec.serving.recommend import RecRequest

from silverrec.serving.device import program_on, to_device
from .reference_beam_search import random_decoder


def _devices(module) -> set[str]:
    """Devices named by the graph's factory calls and held by the module's tensors."""
    named = {str(n.kwargs["device"]) for n in module.graph.nodes if n.kwargs.get("device") is not None}
    return named | {str(t.device) for t in [*module.buffers(), *module.parameters()]}


def _run_on_meta(path, *inputs):
    module = program_on(path, "export", "meta")
    assert _devices(module) == {"meta"}
    return module(*to_device(inputs, "meta"))


def _assert_on_meta(outputs, shapes):
    assert [tuple(o.shape) for o in outputs] == shapes
    assert all(o.device.type == "meta" for o in outputs)


def test_filtered_index_program_moves_whole(tmp_path):
    g = np.random.default_rng(0)
    n = 3000
    pool = Pool(np.arange(n, dtype=np.int64) * 3, g.normal(size=(n, 16)).astype(np.float32),
                {"country": [[f"c{v}"] for v in g.integers(0, 5, n)]})
    path = publish_index(pool, tmp_path / "s", config=IVFConfig(nlist=16, seed=0), torchscript=False)
    snap = silverrec.load(path, backend="export")
    request = (torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), torch.randn(2, 16),
               torch.full((2, 1), -1), *compile_request(["country = c1", None], filter_plan(snap)),
               torch.zeros(2, dtype=torch.int64), torch.full((2, 1), -1), torch.ones(2, 2, dtype=torch.bool), 5, 5, 4, 8)
    assert (snap.module(*request)[0] >= 0).all()  # the request is valid on CPU
    # rows [B, 0]: a pure-ANN search without exclusions maps straight to item ids (retrieval/sources.py
    # AnnSearch); found_by and source scores: one source
    _assert_on_meta(_run_on_meta(path, *request), [(2, 5), (2, 5), (2, 5, 1), (2, 0), (2, 0), (2, 0, 2)])


def test_generative_program_moves_whole(tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(240, 8)).astype(np.float32)
    sids = build_semantic_ids(x, np.arange(240, dtype=np.int64) + 7, levels=1, codes=16, seed=0, niter=3)
    dec = random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1)
    path = publish_generative(dec, sids, tmp_path / "g", beam_width=8, max_history=4, weights="fp32", torchscript=False)
    handler = silverrec.load(path, backend="export").rec_handler()
    ids = handler.row_to_item
    requests = [RecRequest(history=ids[[0, 1, 3, 20]].tolist()), RecRequest(history=ids[[1, 4, 19]].tolist())]
    values, lengths, dense, exclude, histories = handler.encode_rows(requests, True, 8)
    history, flags = handler._sources(requests, histories)
    request = (values, lengths, dense, exclude, *compile_request([None, None], handler.plan),
               torch.zeros(2, dtype=torch.int64), history, flags, 8, 8, 1, 1)
    assert (handler.module(*request)[0] >= 0).all()  # the request is valid on CPU
    # this graph burns device='cpu' into its factory calls (arange, zeros, full): unmoved, it fails here
    _assert_on_meta(_run_on_meta(path, *request), [(2, 8), (2, 8), (2, 8, 1), (2, 8), (2, 8), (2, 8, 2)])
