"""Every silverrec op runs in a C++ process without Python: tests/cpp/jit_forward (built here with CMake against
the venv's libtorch, `torch.utils.cmake_prefix_path`) dlopens libsilverrec_ops.so, loads a TorchScript program
that calls each op once, and its answers equal Python's (the same kernels, so bit for bit). An op defined or
implemented in Python would be missing there: the load or the call would fail.

Skipped, saying why, where CMake or a C++ compiler is missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest
import torch
from torch import Tensor

from silverrec.kernels import library
from silverrec.kernels.constants import MODE_AUTO, NO_LISTS, OP_PUSH, OP_TRUE
from tests.test_kernel_interfaces import _index

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "cpp-checks"


class AllOps(torch.nn.Module):
    """One call of every silverrec op, on the request tensors forward takes and the index it holds."""

    def __init__(self):
        super().__init__()
        index = _index(n=300, d=8, nlist=5)
        self.tensors = index.filtered_index_tensors()
        self.params = index.filtered_params
        self.ratio = index.exact_cost_ratio
        g = torch.Generator().manual_seed(1)
        self.emb = torch.randn(300, 8, generator=g)
        self.ranker = torch.randn(300, 3 * 2 + 5, generator=g)  # the item side: p_x x comp_dim, then the gate's hidden
        d, t, p_q, p_x, c, f, h = 8, 2, 2, 2, 3, 2, 5
        self.mol = [torch.randn(t, p_q * c, d, generator=g), torch.randn(t, p_q * c, generator=g),
                    torch.randn(h, 2 * d + f + p_q * p_x, generator=g), torch.randn(t, p_q * p_x, h, generator=g),
                    torch.randn(t, p_q * p_x, generator=g), torch.full((t,), 0.5), torch.full((t,), 0.1)]
        self.mol_dims = [p_q, p_x, c, f]

    def forward(self, queries: Tensor, program: List[Tensor], mode: Tensor, user: Tensor, attn: List[Tensor],
                beams: List[Tensor]) -> List[Tensor]:
        ops = torch.ops.silverrec
        B = queries.shape[0]
        codes, cluster_offsets, centroids, bits = self.tensors[0], self.tensors[3], self.tensors[4], self.tensors[6]
        one, zero = torch.ones(()), torch.zeros(())
        out: List[Tensor] = []
        a, b = ops.ivf_search(queries, self.tensors[:6], self.params[:2], 7, 2)
        out += [a, b]
        a, b = ops.filtered_ivf_search(queries, self.tensors, self.params, self.ratio, program, mode, 7, 2, 4)
        out += [a, b]
        probes = ops.centroid_candidates(queries, centroids, 3)
        a, b, c = ops.filter_plan(queries, self.tensors, self.params, self.ratio, program, mode, 7, 2, 4)
        out += [probes, a, b, c]
        s, r = ops.ivf_scan(queries, codes, one, zero, cluster_offsets, probes, 9)
        lo = cluster_offsets[probes]
        a, b = ops.bloom_filter_counts(bits, program[0], program[1], lo, cluster_offsets[probes + 1], 2)
        out += [s, r, ops.bloom_filter(bits, program[0], program[1], lo >> 6, 2), a, b]
        a, b = ops.verify_topk(bits, program[2], program[3], s, r, 5)
        out += [a, b]
        a, b = ops.filtered_topk(queries, codes, one, zero, bits, [program[2], program[3]],
                                 [self.tensors[7], self.tensors[8], program[4]], torch.ones(B, dtype=torch.bool), 6, 300,
                                 [])
        out += [a, b]
        a, b = ops.rescore_rows(queries, r, codes, self.tensors[1], self.tensors[2], 4)
        out += [a, b, ops.rows_to_items(self.tensors[5], r)]
        out.append(ops.candidate_rows(queries, r, torch.full([B, 1], -1, dtype=torch.int64), self.emb, 5, 6, False))
        out.append(ops.mol_score(user, r, self.emb, self.ranker, self.mol, self.mol_dims))
        a, b = ops.merge_attention_states(attn[0], attn[1], attn[2], attn[3])
        out += [a, b, ops.staged_attention(attn[4], attn[5], attn[6], attn[7] > 0, attn[8], attn[9], 2)]
        a, b, c = ops.beam_topk(beams[0], beams[1], 3, 4)
        out += [a, b, c]
        return out


def _inputs(B=3):
    g = torch.Generator().manual_seed(2)
    queries = torch.randn(B, 8, generator=g)
    push_true = torch.tensor([[OP_PUSH, 0, 0], [OP_TRUE, 0, 0], [OP_PUSH, 0, 0]])  # row 0 of the bank, or TRUE
    program = [push_true, torch.zeros(B, 3, 1, dtype=torch.int64), push_true.flip(0), torch.zeros(B, 3, 1, dtype=torch.int64),
               torch.tensor([[NO_LISTS, -1], [0, -1], [NO_LISTS, -1]])]
    user = torch.randn(B, 2, 8, generator=g)
    N, H, D, W, KV, T, S = 4, 4, 8, 2, 2, 5, 3
    attn = [torch.randn(N, H, D, generator=g), torch.randn(N, H, generator=g), torch.randn(N, H, D, generator=g),
            torch.randn(N, H, generator=g), torch.randn(B, W, H, D, generator=g), torch.randn(B, KV, T, D, generator=g),
            torch.randn(B, KV, T, D, generator=g), torch.ones(B, T), torch.randn(B * W, S, KV, D, generator=g),
            torch.randn(B * W, S, KV, D, generator=g)]
    attn[1][0, 0] = float("-inf")  # an empty stage
    beams = [torch.randn(B, 3, generator=g), torch.log_softmax(torch.randn(B, 3, 6, generator=g), dim=-1)]
    return queries, program, torch.full((B,), MODE_AUTO), user, attn, beams


def _build() -> Path:
    cmake, cxx = shutil.which("cmake"), shutil.which("c++") or shutil.which("g++")
    if cmake is None or cxx is None:
        pytest.skip(f"the C++ check needs CMake and a C++ compiler (cmake: {cmake}, c++: {cxx})")
    BUILD.mkdir(parents=True, exist_ok=True)
    subprocess.run([cmake, "-S", str(REPO / "tests" / "cpp"), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"], check=True, capture_output=True, text=True)
    subprocess.run([cmake, "--build", str(BUILD)], check=True, capture_output=True, text=True)
    return BUILD / "jit_forward"


def test_every_op_runs_in_a_cpp_process_without_python(tmp_path):
    program = _build()
    model, args = torch.jit.script(AllOps()), _inputs()
    with torch.inference_mode():
        want = model(*args)
    model.save(str(tmp_path / "model.ts"))
    torch.save(args, tmp_path / "inputs.pt")
    run = subprocess.run([str(program), library.load(), str(tmp_path / "model.ts"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "out.pt")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = torch.load(tmp_path / "out.pt", weights_only=False)  # a Tensor[] pickled by the test's own program
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


def test_without_the_library_the_program_cannot_run(tmp_path):
    """The control: the same program in the same process, the library not loaded, fails on a silverrec op."""
    program = _build()
    torch.jit.script(AllOps()).save(str(tmp_path / "model.ts"))
    torch.save(_inputs(), tmp_path / "inputs.pt")
    run = subprocess.run([str(program), "libm.so.6", str(tmp_path / "model.ts"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "out.pt")], capture_output=True, text=True)
    assert run.returncode != 0 and "silverrec::" in run.stderr
