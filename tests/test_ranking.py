"""Ranking stage modules: embedding cache, MLP and mixture-of-logits OverArch.

References are independent of the modules' vectorised code: direct indexing of float tensors for
the cache, an explicit concatenation for the MLP, and a per-(b, k, t) Python loop for MoL.
"""

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from silverrec.errors import PoolError
from silverrec.ranking import EmbeddingCache, ListwiseOverArch, MLPOverArch, MoLOverArch, overarch_from_config
from silverrec.snapshot import export_program

N, D, T, FEAT = 40, 8, 2, 3
SHAPES = [(1, 1), (1, 7), (3, 1), (3, 7)]  # (B, K)


def _rows(b: int, k: int, n: int = N) -> torch.Tensor:
    rows = torch.randint(0, n, (b, k))
    rows[torch.rand(b, k) < 0.3] = -1
    return rows


def _inputs(b: int, k: int, f: int = FEAT):
    return torch.randn(b, T, D), torch.randn(b, k, D), torch.randn(b, k, f)


def _script_roundtrip(module: torch.nn.Module) -> torch.jit.ScriptModule:
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _export_roundtrip(module, args, dynamic_shapes):
    buf = io.BytesIO()
    torch.export.save(export_program(module, args, dynamic_shapes), buf)
    buf.seek(0)
    return torch.export.load(buf).module()


# ------------------------------------------------------------------------------------ cache
def test_cache_gather_matches_direct_indexing():
    emb = torch.randn(N, D)
    feats = torch.rand(N, FEAT) * 10
    cache = EmbeddingCache(emb, feats, ["a", "b", "c"])
    rows = _rows(4, 9)
    rows[0, 0] = -1
    got_emb, got_feats = cache.gather(rows)
    assert got_emb.dtype == torch.float32 and got_emb.shape == (4, 9, D)
    assert got_feats.dtype == torch.float32 and got_feats.shape == (4, 9, FEAT)
    for b in range(4):
        for k in range(9):
            r = int(rows[b, k])
            if r < 0:
                assert bool((got_emb[b, k] == 0).all()) and bool((got_feats[b, k] == 0).all())
            else:  # bf16 storage: 8 mantissa bits
                torch.testing.assert_close(got_emb[b, k], emb[r], rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(got_feats[b, k], feats[r], rtol=1e-2, atol=1e-2)


def test_cache_rescore_is_exact_on_cached_values():
    emb = torch.randn(N, D)
    cache = EmbeddingCache(emb)
    user = torch.randn(3, T, D)
    rows = _rows(3, 11)
    rows[1, 2] = -1
    got = cache.rescore(user, rows)
    assert got.shape == (3, 11, T) and got.dtype == torch.float32
    cached = emb.to(torch.bfloat16).double()
    for b in range(3):
        for k in range(11):
            r = int(rows[b, k])
            for t in range(T):
                if r < 0:
                    assert got[b, k, t] == -math.inf
                else:
                    exact = float(cached[r] @ user[b, t].double())
                    assert abs(float(got[b, k, t]) - exact) < 1e-5
                    assert abs(float(got[b, k, t]) - float(emb[r] @ user[b, t])) < 0.05 * math.sqrt(D)
    e, f, r, s = cache(user, rows)  # forward = one take of each table + rescore
    torch.testing.assert_close(s, got, rtol=0, atol=0)
    valid = rows >= 0
    torch.testing.assert_close(e[valid], cache.gather(rows)[0][valid], rtol=0, atol=0)
    torch.testing.assert_close(cache.embeddings(rows)[valid], e[valid], rtol=0, atol=0)
    assert f.shape == (3, 11, 0) and r.shape == (3, 11, 0)
    for g, w in zip(cache.lookup(rows), (e, f, r)):  # the lookups alone, unmasked: padding reads row 0
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(e[~valid], cache.emb[0].float().expand(int((~valid).sum()), D), rtol=0, atol=0)


def test_cache_ranker_holds_the_item_side_by_row():
    emb, feats = torch.randn(N, D), torch.rand(N, FEAT)
    cache = EmbeddingCache(emb, feats, ["a", "b", "c"])
    assert cache.bytes_per_item() == 2 * D + 2 * FEAT
    plain = cache

    def item_side(e, f):
        return torch.cat([e[:, :3] * 2, f.sum(1, keepdim=True)], 1)

    stored_e, stored_f = cache.emb.float(), cache.feats.float()  # computed from what the cache holds
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = plain.with_ranker(item_side) if dtype == torch.float32 else plain.with_ranker(item_side, dtype)
        assert cache.ranker.shape == (N, 4) and cache.ranker.dtype == dtype
        assert plain.ranker.shape == (N, 0) and cache.emb is plain.emb  # the original is left as it was
        assert cache.bytes_per_item() == 2 * D + 2 * FEAT + size * 4
        want = item_side(stored_e, stored_f).to(dtype)
        assert torch.equal(cache.ranker, want)
        rows = _rows(2, 9)
        got = cache(torch.randn(2, T, D), rows)[2]
        assert torch.equal(got, want[rows.clamp(min=0)])
    with pytest.raises(PoolError, match="ranker dtype must be"):
        plain.with_ranker(item_side, torch.float16)


def test_cache_feature_storage_and_bytes():
    emb = torch.randn(N, D)
    flags = torch.randint(0, 2, (N, 4)).float()
    binary = EmbeddingCache(emb, flags, ["f0", "f1", "f2", "f3"])
    assert binary.feats.dtype == torch.uint8 and binary.bytes_per_item() == 2 * D + 4
    assert torch.equal(binary.gather(torch.arange(N)[None])[1][0], flags)  # 0/1 exact
    dense = EmbeddingCache(emb, flags * 3.5, ["f0", "f1", "f2", "f3"])
    assert dense.feats.dtype == torch.bfloat16 and dense.bytes_per_item() == 2 * D + 2 * 4
    wide = EmbeddingCache(emb, flags * 3.5, ["f0", "f1", "f2", "f3"], feats_dtype="float32")
    assert wide.bytes_per_item() == 2 * D + 4 * 4
    assert EmbeddingCache(emb).bytes_per_item() == 2 * D
    assert binary.feature_names == ["f0", "f1", "f2", "f3"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"emb": torch.randn(0, D)}, "non-empty"),
        ({"emb": torch.randn(N)}, r"\[N, D\]"),
        ({"emb": torch.randn(N, D).index_put_((torch.tensor([7]), torch.tensor([2])), torch.tensor(math.nan))},
         "row 7, column 2"),
        ({"emb": torch.randn(N, D), "feats": torch.rand(N, 2), "feature_names": ["a"]}, "2 feature columns but 1"),
        ({"emb": torch.randn(N, D), "feats": torch.rand(N, 2), "feature_names": ["a", "a"]}, "duplicate feature names: a"),
        ({"emb": torch.randn(N, D), "feats": torch.rand(N, 1) + 2, "feature_names": ["price"], "feats_dtype": "uint8"},
         "'price'"),
        ({"emb": torch.randn(N, D), "feats_dtype": "int4"}, "feats_dtype"),
    ],
)
def test_cache_rejects_bad_input(kwargs, match):
    with pytest.raises(PoolError, match=match):
        EmbeddingCache(**kwargs)


def test_cache_script_and_export_equal_eager():
    cache = EmbeddingCache(torch.randn(N, D), torch.randint(0, 2, (N, FEAT)).float(), ["a", "b", "c"])
    scripted = _script_roundtrip(cache)
    assert scripted.feature_names == ["a", "b", "c"]
    exported = _export_roundtrip(
        cache, (torch.randn(4, T, D), _rows(4, 5)),
        {"user": {0: Dim.DYNAMIC}, "rows": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}},
    )
    for b, k in SHAPES:
        user, rows = torch.randn(b, T, D), _rows(b, k)
        want = cache(user, rows)
        for got in (scripted(user, rows), exported(user, rows)):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        for g, w in zip(scripted.gather(rows), cache.gather(rows)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(scripted.rescore(user, rows), cache.rescore(user, rows), rtol=0, atol=0)
        for g, w in zip(scripted.lookup(rows), cache.lookup(rows)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ OverArch references
def mlp_reference(module: MLPOverArch, user, cand, feats) -> torch.Tensor:
    """Explicit x_t = [u_t, v, u_t * v, feats] through the trunk layers and head t."""
    b, k = cand.shape[:2]
    u = user.unsqueeze(1).expand(b, k, -1, -1)
    v = cand.unsqueeze(2).expand_as(u)
    f = feats.unsqueeze(2).expand(b, k, u.shape[2], feats.shape[-1])
    h = torch.relu(module.first(torch.cat([u, v, u * v, f], dim=-1)))
    for layer in module.rest:
        h = torch.relu(layer(h))
    return torch.stack([h[..., t, :] @ module.head_weight[t] + module.head_bias[t]
                        + module.dot_scale[t] * (u[..., t, :] * v[..., t, :]).sum(-1) for t in range(u.shape[2])], -1)


def mol_reference(module: MoLOverArch, user, cand, feats) -> torch.Tensor:
    """Mixture of logits, one (b, k, t) at a time, straight from the definition (float64 out)."""
    with torch.no_grad():
        return _mol_loop(module, user, cand, feats)


def _mol_loop(module: MoLOverArch, user, cand, feats) -> torch.Tensor:
    bsz, k_count = cand.shape[:2]
    c = module.comp_dim
    out = torch.zeros(bsz, k_count, module.tasks, dtype=torch.float64)
    wi, bi = module.item_proj.weight, module.item_proj.bias
    wg, bg = module.gate_in.weight, module.gate_in.bias
    for b in range(bsz):
        for k in range(k_count):
            v, f = cand[b, k], feats[b, k]
            xf = wi @ v + bi
            xs = [xf[j * c:(j + 1) * c] / max(float(xf[j * c:(j + 1) * c].norm()), 1e-12) for j in range(module.p_x)]
            for t in range(module.tasks):
                u = user[b, t]
                qf = module.user_weight[t] @ u + module.user_bias[t]
                qs = [qf[i * c:(i + 1) * c] / max(float(qf[i * c:(i + 1) * c].norm()), 1e-12) for i in range(module.p_q)]
                logits = torch.stack([torch.dot(qs[i], xs[j]) for i in range(module.p_q) for j in range(module.p_x)])
                hidden = F.silu(wg @ torch.cat([u, v, f, logits]) + bg)
                gates = torch.softmax(module.gate_weight[t] @ hidden + module.gate_bias[t], dim=0)
                scale = min(math.exp(float(module.log_scale[t])), 100.0)
                out[b, k, t] = scale * float((gates * logits).sum()) + float(module.dot_scale[t]) * float(u @ v)
    return out


def listwise_reference(module: ListwiseOverArch, user, cand, feats, valid) -> torch.Tensor:
    """The list-wise OverArch one request at a time in float64, straight from its definition, run
    on the valid candidates only (padding removed, not masked) -> [B, K, T], NaN at padding."""
    out = torch.full((cand.shape[0], cand.shape[1], module.tasks), math.nan, dtype=torch.float64)
    m = {k: v.detach().double() for k, v in module.state_dict().items()}

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], m[name + ".weight"], m[name + ".bias"])

    for b in range(cand.shape[0]):
        keep = valid[b].nonzero().reshape(-1)
        v, f, u = cand[b, keep].double(), feats[b, keep].double(), user[b].double()
        x = torch.cat([u @ m["user_in.weight"].T + m["user_in.bias"] + m["task_token"],
                       torch.cat([v, f], 1) @ m["item_in.weight"].T + m["item_in.bias"]])  # [T + k, M]
        for i in range(module.layers):
            p = f"blocks.{i}."
            qkv = (ln(x, p + "norm1") @ m[p + "qkv.weight"].T + m[p + "qkv.bias"]).reshape(len(x), 3, module.heads, -1)
            heads = []
            for h in range(module.heads):
                q, k_, v_ = qkv[:, 0, h], qkv[:, 1, h], qkv[:, 2, h]
                heads.append(torch.softmax(q @ k_.T / math.sqrt(q.shape[1]), dim=1) @ v_)
            x = x + torch.cat(heads, 1) @ m[p + "proj.weight"].T + m[p + "proj.bias"]
            hid = F.gelu(ln(x, p + "norm2") @ m[p + "ffn_in.weight"].T + m[p + "ffn_in.bias"])
            x = x + hid @ m[p + "ffn_out.weight"].T + m[p + "ffn_out.bias"]
        h = ln(x[module.tasks:], "out_norm")
        out[b, keep] = h @ m["head_weight"].T + m["head_bias"] + (v @ u.T) * m["dot_scale"]
    return out


def _kinds(feat_dim=FEAT):
    return [MLPOverArch(D, feat_dim, T, hidden=(16, 12)),
            MoLOverArch(D, feat_dim, T, p_q=2, p_x=3, comp_dim=4, gate_hidden=10),
            ListwiseOverArch(D, feat_dim, T, model_dim=8, heads=2, layers=2, ffn=12)]


@pytest.mark.parametrize("feat_dim", [FEAT, 0])
def test_overarch_shapes(feat_dim):
    for module in _kinds(feat_dim):
        out = module(*_inputs(3, 7, feat_dim))
        assert out.shape == (3, 7, T) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("feat_dim", [FEAT, 0])
def test_mlp_matches_concat_reference(feat_dim):
    module = MLPOverArch(D, feat_dim, T, hidden=(16, 12, 6)).double()
    args = [x.double() for x in _inputs(3, 7, feat_dim)]
    torch.testing.assert_close(module(*args).double(), mlp_reference(module, *args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feat_dim", [FEAT, 0])
def test_mol_matches_loop_reference(feat_dim):
    module = MoLOverArch(D, feat_dim, T, p_q=2, p_x=3, comp_dim=4, gate_hidden=10)
    with torch.no_grad():  # move every parameter off its init so the test sees them all
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    args = _inputs(3, 7, feat_dim)
    ref = mol_reference(module.double(), *[x.double() for x in args])
    torch.testing.assert_close(module(*[x.double() for x in args]).double(), ref, rtol=1e-5, atol=1e-5)
    module.float()
    torch.testing.assert_close(module(*args).double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch_in_heads", [False, True])
@pytest.mark.parametrize("feat_dim", [FEAT, 0])
def test_listwise_matches_reference_and_ignores_padding(feat_dim, batch_in_heads):
    """Both attention forms (silverrec/attention.py: the batch folded into the heads on torch < 2.13)."""
    module = ListwiseOverArch(D, feat_dim, T, model_dim=8, heads=2, layers=2, ffn=12).double()
    for block in module.blocks:
        block.batch_in_heads = batch_in_heads
    with torch.no_grad():  # off the init (LayerNorm weights 1, biases 0) so the test sees every parameter
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    user, cand, feats = [x.double() for x in _inputs(3, 7, feat_dim)]
    valid = torch.rand(3, 7, generator=torch.Generator().manual_seed(4)) < 0.6
    valid[0] = True  # a full list
    valid[1, :] = False
    valid[1, 3] = True  # a list of one
    got = module.score(user, cand, module.item_side(cand, feats), valid)  # float64 math, float32 out
    ref = listwise_reference(module, user, cand, feats, valid)
    torch.testing.assert_close(got[valid].double(), ref[valid], rtol=1e-6, atol=1e-6)
    # what sits in a padding slot never changes a valid candidate's score
    junk = torch.where(valid[:, :, None], cand, torch.randn_like(cand) * 50)
    again = module.score(user, junk, module.item_side(junk, feats), valid)
    torch.testing.assert_close(again[valid], got[valid], rtol=1e-6, atol=1e-6)
    # and the list matters: dropping one valid candidate moves the others' scores
    fewer = valid.clone()
    fewer[0, 0] = False
    moved = module.score(user, cand, module.item_side(cand, feats), fewer)
    assert float((moved[0, 1:] - got[0, 1:]).abs().max()) > 1e-6


@pytest.mark.parametrize("kind", ["mlp", "mol", "listwise"])
def test_overarch_script_and_export_equal_eager(kind):
    module = {m.kind: m for m in _kinds()}[kind].eval()
    scripted = _script_roundtrip(module)
    exported = _export_roundtrip(
        module, _inputs(4, 5),
        {"user": {0: Dim.DYNAMIC}, "cand": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, "feats": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}},
    )
    for b, k in SHAPES:
        args = _inputs(b, k)
        want = module(*args)
        torch.testing.assert_close(scripted(*args), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(exported(*args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "mol", "listwise"])
def test_overarch_bf16_eager(kind):
    module = {m.kind: m for m in _kinds()}[kind]
    args = _inputs(3, 7)
    want = module(*args)
    got = module.to(torch.bfloat16)(*args)  # float32 inputs, as the cache produces them
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max()) + 0.05


@pytest.mark.parametrize("kind", ["mlp", "mol", "listwise"])
def test_overarch_config_rebuilds(kind):
    module = {m.kind: m for m in _kinds()}[kind]
    cfg = json.loads(json.dumps(module.config()))
    rebuilt = overarch_from_config(kind, cfg)
    assert rebuilt.config() == module.config()
    rebuilt.load_state_dict(module.state_dict())
    args = _inputs(2, 3)
    torch.testing.assert_close(rebuilt(*args), module(*args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown OverArch kind"):
        overarch_from_config("dlrm", cfg)


@pytest.mark.parametrize("kind", ["mlp", "mol", "listwise"])
def test_overarch_every_parameter_trains(kind):
    module = {m.kind: m for m in _kinds()}[kind]
    user, cand, feats = _inputs(3, 7)
    # a pointwise loss: a softmax over candidates is blind to the per-task bias (a shift of every logit)
    F.binary_cross_entropy_with_logits(module(user, cand, feats)[:, :, 0], torch.rand(3, 7)).backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_mol_fixed_scale_is_a_buffer():
    module = MoLOverArch(D, FEAT, T, scale=5.0, learn_scale=False)
    assert "log_scale" not in dict(module.named_parameters()) and "log_scale" in dict(module.named_buffers())
    assert module.config()["scale"] == 5.0 and module.config()["learn_scale"] is False
    with pytest.raises(ValueError, match="scale"):
        MoLOverArch(D, FEAT, T, scale=0.0)


def _planted_lists(n: int, k: int, rot: torch.Tensor, gen: torch.Generator):
    """Lists of k candidates: the positive (at a random index) is rot @ u plus noise, the rest random."""
    dim = rot.shape[0]
    user = torch.randn(n, 1, dim, generator=gen)
    cand = torch.randn(n, k, dim, generator=gen)
    label = torch.randint(0, k, (n,), generator=gen)
    pos = user[:, 0] @ rot.T + 0.3 * torch.randn(n, dim, generator=gen)
    cand[torch.arange(n), label] = pos
    feats = torch.randn(n, k, 2, generator=gen)
    return user, cand, feats, label


def test_mol_training_separates_planted_positive():
    gen = torch.Generator().manual_seed(1)
    dim, k = 16, 8
    rot = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0]  # the user-item relation to learn
    model = MoLOverArch(dim, 2, 1, p_q=2, p_x=2, comp_dim=8, gate_hidden=16, dot_scale=0.0)  # the mixture alone
    test = _planted_lists(512, k, rot, gen)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(*test[:3])[:, :, 0].argmax(1) == test[3]).float().mean())

    before = accuracy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds contention on a busy machine
    try:
        for _ in range(150):
            user, cand, feats, label = _planted_lists(64, k, rot, gen)
            loss = F.cross_entropy(model(user, cand, feats)[:, :, 0], label)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    after = accuracy()
    assert before < 0.35, before  # chance is 1/8: the relation is not there before training
    print(f"MoL planted-positive top-1: {before:.3f} before, {after:.3f} after training")
    assert after > 0.8, after
