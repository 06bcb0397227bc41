"""silverrec::beam_topk (per-beam top_k, then global top W, early termination) vs a full sort."""

import pytest
import torch

import silverrec.kernels.beam_topk as bt


def _case(B, Wi, C, p_invalid=0.3, p_dead=0.1, ties=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if ties:  # small integer grid: many exact ties inside and across beams
        beam = -torch.randint(0, 4, (B, Wi), generator=g).float()
        lp = -torch.randint(0, 5, (B, Wi, C), generator=g).float()
    else:
        beam = -torch.rand(B, Wi, generator=g) * 5
        lp = torch.log_softmax(torch.randn(B, Wi, C, generator=g) * 3, dim=-1)
    lp[torch.rand(B, Wi, C, generator=g) < p_invalid] = float("-inf")
    beam[torch.rand(B, Wi, generator=g) < p_dead] = float("-inf")
    return beam, lp


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


@pytest.mark.parametrize("Wi,C,top_k,W", [(1, 7, 3, 5), (4, 6, 2, 8), (8, 16, 16, 8), (8, 16, 3, 8), (16, 9, 4, 40), (32, 64, 8, 32), (5, 3, 10, 2)])
@pytest.mark.parametrize("ties", [True, False])
def test_matches_full_sort(Wi, C, top_k, W, ties):
    for seed in range(4):
        beam, lp = _case(3, Wi, C, ties=ties, seed=seed)
        out = torch.ops.silverrec.beam_topk(beam, lp, top_k, W)
        _assert_same(out, bt.beam_topk_reference(beam, lp, top_k, W))
        # the CUDA kernel's selection (every beam, no early exit), run here on the CPU, agrees too
        _assert_same(torch.ops.silverrec_host.beam_topk_every_beam(beam, lp, top_k, W),
                     bt.beam_topk_reference(beam, lp, top_k, W))


def test_reference_by_brute_force():
    """The reference itself vs Python tuple sorting with the documented tie rule."""
    beam, lp = _case(2, 5, 6, seed=3)
    top_k, W = 3, 7
    scores, parent, code = bt.beam_topk_reference(beam, lp, top_k, W)
    for b in range(2):
        cands = []
        for i in range(5):
            row = sorted(((-(beam[b, i] + lp[b, i, c]).item(), c) for c in range(6)))[:top_k]
            cands += [(s, i, c) for s, c in row if s != float("inf")]
        best = sorted(cands)[:W]
        n = len(best)
        assert scores[b, :n].tolist() == [-s for s, _, _ in best]
        assert parent[b, :n].tolist() == [i for _, i, _ in best]
        assert code[b, :n].tolist() == [c for _, _, c in best]
        assert torch.all(scores[b, n:] == float("-inf")) and torch.all(parent[b, n:] == 0)


def test_early_termination_keeps_the_full_sorts_answer():
    """Beams far below the top W, which the C++ kernel's early termination never sorts (kernels/csrc/beam.cpp): the
    answer is still the full sort's."""
    beam = torch.arange(64).float().neg()[None].repeat(2, 1) * 10  # beam i scores -10 i
    lp = torch.log_softmax(torch.randn(2, 64, 32), dim=-1)
    _assert_same(torch.ops.silverrec.beam_topk(beam, lp, 8, 16), bt.beam_topk_reference(beam, lp, 8, 16))


def test_never_selects_invalid():
    beam, lp = _case(2, 4, 5, p_invalid=0.9, seed=1)
    scores, parent, code = torch.ops.silverrec.beam_topk(beam, lp, 5, 20)
    live = scores > float("-inf")
    assert live.sum() < 40
    total = beam[:, :, None] + lp
    picked = total.gather(1, parent[:, :, None].expand(-1, -1, 5)).gather(2, code[:, :, None]).squeeze(2)
    assert torch.all(picked[live] > float("-inf"))
    assert torch.equal(picked[live], scores[live])


def test_fake_shapes_and_validation():
    beam, lp = _case(2, 4, 5)
    with pytest.raises(ValueError):
        torch.ops.silverrec.beam_topk(beam[:, :3], lp, 2, 3)
    with pytest.raises(ValueError):
        torch.ops.silverrec.beam_topk(beam, lp, 0, 3)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        s, p, c = torch.ops.silverrec.beam_topk(torch.empty(3, 4), torch.empty(3, 4, 9), 2, 6)
        assert s.shape == (3, 6) and p.dtype == torch.int64 and c.shape == (3, 6)
