"""GraphedForward (silverrec/serving/cuda_graphs.py) on the CPU with `capture_eager`: the keys, the
static buffers and copies, eviction and the eager fallback that a CUDA graph relies on, against
calling the module directly. tests/gpu/test_snapshots_cuda.py replays real CUDA graphs."""

import warnings

import pytest
import torch

from silverrec.serving.cuda_graphs import EAGER, GraphedForward, capture_eager


class Toy(torch.nn.Module):
    """Tensors, ints, None and a list of tensors in; a tuple and a nested output out."""

    def forward(self, q, k: int, scale, extra, bias=None):
        s = q @ q.T * scale
        if bias is not None:
            s = s + bias
        for t in extra:
            s = s + t.sum()
        vals, idx = torch.topk(s, k, dim=1)
        return vals, (idx, s.sum(dim=1))


def _args(seed, b=4, d=3, k=2, n_extra=2, bias=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    extra = [torch.randn(2, generator=g) for _ in range(n_extra)]
    return (q, k, 0.5, extra, torch.randn(b, b, generator=g) if bias else None)


def _assert_equal(got, want):
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want):
        assert torch.equal(g, w)


def test_replays_equal_direct_calls_and_one_capture_per_shape():
    module = Toy()
    graphed = GraphedForward(module, capture=capture_eager, capture_after=1)
    first = graphed(*_args(0))
    _assert_equal(first, module(*_args(0)))
    kept = torch.utils._pytree.tree_map(torch.clone, first)
    second = graphed(*_args(1))  # same shapes, other values: a replay on new inputs
    _assert_equal(second, module(*_args(1)))
    _assert_equal(first, kept)  # outputs are clones: the replay did not overwrite the first answer
    assert graphed.captures == 1
    for args in (_args(2, k=3), _args(3, b=5), _args(4, n_extra=1), _args(5, bias=True)):  # new keys
        _assert_equal(graphed(*args), module(*args))
    assert graphed.captures == 5 and len(graphed.graphs) == 5


def test_a_shape_is_captured_on_its_second_call_by_default():
    module = Toy()
    graphed = GraphedForward(module, capture=capture_eager)
    for seed in range(3):  # eager, capture, replay
        _assert_equal(graphed(*_args(seed)), module(*_args(seed)))
        assert graphed.captures == (0 if seed == 0 else 1)
    for b in range(5, 10):  # a different shape each call (the batch): none is ever captured
        args = _args(b, b=b)
        _assert_equal(graphed(*args), module(*args))
    assert graphed.captures == 1 and len(graphed.graphs) == 1


def test_least_recently_used_shape_is_evicted():
    module = Toy()
    graphed = GraphedForward(module, max_graphs=2, capture=capture_eager, capture_after=1)
    a, b, c = _args(0, k=1), _args(1, k=2), _args(2, k=3)
    graphed(*a), graphed(*b), graphed(*a), graphed(*c)  # b is the least recently used when c comes
    assert graphed.captures == 3 and len(graphed.graphs) == 2
    _assert_equal(graphed(*b), module(*b))
    assert graphed.captures == 4


def test_a_shape_that_cannot_be_captured_runs_eagerly():
    def refuses(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    module = Toy()
    graphed = GraphedForward(module, capture=refuses, capture_after=1)
    args = _args(0)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = graphed(*args)
    _assert_equal(got, module(*args))
    assert list(graphed.graphs.values()) == [EAGER]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per shape, not per call
        _assert_equal(graphed(*_args(1)), module(*_args(1)))


def test_cpu_tensors_with_the_cuda_capture_call_the_module_directly():
    graphed = GraphedForward(Toy())
    _assert_equal(graphed(*_args(0)), Toy()(*_args(0)))
    assert graphed.captures == 0


def test_arguments_on_two_devices_are_refused():
    graphed = GraphedForward(Toy(), capture=capture_eager)
    q, k, scale, extra, _ = _args(0)
    with pytest.raises(ValueError, match="several devices"):
        graphed(q, k, scale, extra, torch.zeros(4, 4, device="meta"))
