"""The sequential user tower (silverrec/retrieval/sequence_tower.py): against a plain-torch reference
written here from the definition (no masks, no padding: each history's valid items alone, attention
as an explicit softmax over the positions at or before the query), causal masking, padding,
exported and scripted programs against eager, and the tower trained and published end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from silverrec.retrieval.sequence_tower import SequenceConfig, SequenceUserTower, item_feature_codes
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

N_ITEMS = 40
LENGTH = 6
ITEM_FEATURES = {  # multi-valued "tags", single-valued "cat"; item 3 has no tag
    "tags": [[f"t{(i * 7) % 5}", f"t{i % 3}"][: 1 + i % 2] if i != 3 else [] for i in range(N_ITEMS)],
    "cat": [[f"c{i % 4}"] for i in range(N_ITEMS)],
}


def make_tower(seed: int = 0, user_vocabs=None, numeric=None, dropout: float = 0.0, layers: int = 2,
               item_table: str = "own") -> SequenceUserTower:
    spec = UserFeatureSpec(num_items=N_ITEMS, history_len=LENGTH, recent_len=2,
                           item_vocabs={"tags": [f"t{j}" for j in range(4)], "cat": [f"c{j}" for j in range(4)]},
                           user_vocabs=user_vocabs or {}, user_numeric=numeric or {})
    torch.manual_seed(seed)
    tower = SequenceUserTower(spec, dim=8, tasks=2, item_features=ITEM_FEATURES,
                              config=SequenceConfig(model_dim=12, layers=layers, heads=3, ffn=20, dropout=dropout, feature_dim=5,
                                                    item_table=item_table))
    with torch.no_grad():  # away from the initial zeros / ones, so that every parameter matters
        for p in tower.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return tower.eval()


def encoder_for(tower: SequenceUserTower, spec: UserFeatureSpec) -> FeatureEncoder:
    return FeatureEncoder(spec, ITEM_FEATURES)


def reference(tower: SequenceUserTower, spec: UserFeatureSpec, history: list[int], user_feats: dict, numeric: dict,
              item_table: str = "own") -> torch.Tensor:
    """The forward for one user, from the tower's parameters and the module docstring's definition,
    in float64: the last L items only, no padding anywhere; item_table "tower": the item's row of the
    table alone (the item tower's output, which carries the features). -> [T, D]."""
    P = {k: v.double() for k, v in tower.state_dict().items()}
    hist = history[-LENGTH:]
    n = len(hist)
    tag_vocab, cat_vocab = spec.item_vocabs["tags"], spec.item_vocabs["cat"]

    def item_input(r: int) -> torch.Tensor:
        x = P["items.weight"][r].clone()
        if item_table == "tower":
            return x
        for base, vocab, name in ((0, tag_vocab, "tags"), (len(tag_vocab) + 1, cat_vocab, "cat")):
            values = ITEM_FEATURES[name][r]
            if values:
                codes = [base + (vocab.index(v) + 1 if v in vocab else 0) for v in values]
                x = x + sum(P["features.weight"][c] for c in codes) / len(codes)
        return x

    def layer_norm(x, prefix):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * P[prefix + ".weight"] + P[prefix + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    m = P["items.weight"].shape[1]
    heads, hd = 3, m // 3
    xs = [item_input(r) + P["positions"][j] for j, r in enumerate(hist)]  # 0 = the oldest item used
    x = torch.stack(xs) if xs else torch.zeros(0, m, dtype=torch.float64)
    for b in range(len(tower.blocks)):
        pre = f"blocks.{b}."
        h = layer_norm(x, pre + "norm1")
        qkv = h @ P[pre + "qkv.weight"].T + P[pre + "qkv.bias"]
        q, k, v = qkv[:, :m], qkv[:, m:2 * m], qkv[:, 2 * m:]
        out = torch.zeros_like(x)
        for i in range(n):  # query i attends to positions 0..i
            for a in range(heads):
                sl = slice(a * hd, (a + 1) * hd)
                logits = torch.stack([q[i, sl] @ k[j, sl] / math.sqrt(hd) for j in range(i + 1)])
                w = torch.softmax(logits, 0)
                out[i, sl] = sum(w[j] * v[j, sl] for j in range(i + 1))
        x = x + out @ P[pre + "proj.weight"].T + P[pre + "proj.bias"]
        h = layer_norm(x, pre + "norm2")
        x = x + gelu(h @ P[pre + "ffn_in.weight"].T + P[pre + "ffn_in.bias"]) @ P[pre + "ffn_out.weight"].T + P[pre + "ffn_out.bias"]
    state = layer_norm(x[-1], "norm")
    parts = [state]
    for g, (name, vocab) in enumerate(spec.user_vocabs.items()):
        raw = user_feats.get(name, [])
        vals = [raw] if isinstance(raw, str) else list(raw)
        codes = [vocab.index(v) + 1 if v in vocab else 0 for v in vals]
        table = P[f"user_tables.{g}.weight"]
        parts.append(sum(table[c] for c in codes) / len(codes) if codes else torch.zeros(table.shape[1], dtype=torch.float64))
    dense = [math.log1p(len(history))] + [(numeric.get(k, mean) - mean) / std for k, (mean, std) in spec.user_numeric.items()]
    parts.append(torch.tensor(dense, dtype=torch.float64))
    u = (torch.cat(parts) @ P["out.weight"].T + P["out.bias"]).reshape(2, 8)
    return u / u.norm(dim=-1, keepdim=True)


def spec_of(tower_kwargs) -> UserFeatureSpec:
    return UserFeatureSpec(num_items=N_ITEMS, history_len=LENGTH, recent_len=2,
                           item_vocabs={"tags": [f"t{j}" for j in range(4)], "cat": [f"c{j}" for j in range(4)]},
                           user_vocabs=tower_kwargs.get("user_vocabs") or {}, user_numeric=tower_kwargs.get("numeric") or {})


USERS = {"user_vocabs": {"country": ["de", "fr", "jp"], "device": ["ios", "web"]}, "numeric": {"age": (30.0, 10.0)}}
HISTORIES = [[5, 9, 1], [2], list(range(10, 25)), [3, 3, 7, 39, 0, 12], [8, 30]]
FEATS = [{"country": "fr"}, {"country": ["de", "jp"], "device": "web"}, {}, {"country": "xx"}, {"device": ["ios"]}]
NUMS = [{"age": 41.0}, {}, {"age": 12.5}, {}, {"age": 30.0}]


@pytest.mark.parametrize("item_table", ["own", "tower"])  # "tower", the default: the features come with the table's row
@pytest.mark.parametrize("layers", [1, 2])  # one block: the default, its only block reads the last query alone
def test_forward_equals_an_independent_reference(layers, item_table):
    tower = make_tower(**USERS, layers=layers, item_table=item_table)
    spec = spec_of(USERS)
    values, lengths, dense = encoder_for(tower, spec).encode([np.array(h) for h in HISTORIES], FEATS, NUMS)
    with torch.no_grad():
        got = tower(values, lengths, dense).double()
    for b, h in enumerate(HISTORIES):
        want = reference(tower, spec, h, FEATS[b], NUMS[b], item_table)
        torch.testing.assert_close(got[b], want, rtol=0, atol=2e-5)


def test_a_request_does_not_depend_on_its_batch():
    tower = make_tower(**USERS)
    enc = encoder_for(tower, spec_of(USERS))
    with torch.no_grad():
        batch = tower(*enc.encode([np.array(h) for h in HISTORIES], FEATS, NUMS))
        for b, h in enumerate(HISTORIES):
            alone = tower(*enc.encode([np.array(h)], [FEATS[b]], [NUMS[b]]))
            torch.testing.assert_close(alone[0], batch[b], rtol=0, atol=1e-6)


def test_padding_never_changes_a_valid_position():
    """Every valid position's state is the same whatever the padded positions hold and however many
    there are (a window trimmed to its batch's longest, as in training, or the full L)."""
    tower = make_tower()
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, N_ITEMS, (4, LENGTH), generator=g)
    sizes = torch.tensor([1, 3, 4, 2])
    valid = torch.arange(LENGTH)[None, :] >= LENGTH - sizes[:, None]
    with torch.no_grad():
        base = tower.states(torch.where(valid, rows, 0), valid)
        garbage = tower.states(torch.where(valid, rows, torch.randint(0, N_ITEMS, rows.shape, generator=g)), valid)
        trimmed = tower.states(rows[:, -4:], valid[:, -4:])  # the batch's longest window is 4
    torch.testing.assert_close(garbage[valid], base[valid], rtol=0, atol=1e-6)
    torch.testing.assert_close(trimmed[valid[:, -4:]], base[:, -4:][valid[:, -4:]], rtol=0, atol=1e-6)
    assert torch.isfinite(base).all()  # padded queries attend to themselves: no empty softmax row


def test_a_later_item_cannot_change_an_earlier_position():
    tower = make_tower()
    rows = torch.tensor([[4, 8, 15, 16, 23, 33]])
    valid = torch.ones_like(rows, dtype=torch.bool)
    user = torch.zeros(1, 0)
    dense = torch.zeros(1, LENGTH, 1)
    with torch.no_grad():
        base = tower.position_embeddings(rows, valid, user, dense)
        for j in range(LENGTH):
            changed = rows.clone()
            changed[0, j] = (rows[0, j] + 11) % N_ITEMS
            out = tower.position_embeddings(changed, valid, user, dense)
            torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=0)
            assert (out[:, j:] - base[:, j:]).abs().amax(dim=(2, 3)).min() > 1e-4  # j and after do see it


def test_every_position_equals_the_forward_on_that_prefix():
    """Training's per-position embeddings are the forward's answers for the prefixes."""
    tower = make_tower()
    spec = spec_of({})
    enc = encoder_for(tower, spec)
    hist = [7, 1, 22, 35, 2, 9]
    rows = torch.tensor([hist])
    valid = torch.ones_like(rows, dtype=torch.bool)
    dense = torch.log1p(torch.arange(1, LENGTH + 1, dtype=torch.float32))[None, :, None]
    with torch.no_grad():
        every = tower.position_embeddings(rows, valid, torch.zeros(1, 0), dense)[0]
        for j in range(LENGTH):
            prefix = tower(*enc.encode([np.array(hist[:j + 1])]))[0]
            torch.testing.assert_close(every[j], prefix, rtol=0, atol=1e-6)


def test_dropout_acts_in_training_only():
    tower = make_tower(dropout=0.5)
    enc = encoder_for(tower, spec_of({}))
    inputs = enc.encode([np.array(h) for h in HISTORIES])
    with torch.no_grad():
        a, b = tower(*inputs), tower(*inputs)
        tower.train()
        c = tower(*inputs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_folded_item_features_give_the_same_answers_after_a_permutation():
    tower = make_tower(**USERS)
    spec = spec_of(USERS)
    perm = torch.from_numpy(np.random.default_rng(3).permutation(N_ITEMS))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(N_ITEMS)
    inputs = encoder_for(tower, spec).encode([np.array(h) for h in HISTORIES], FEATS, NUMS)
    with torch.no_grad():
        want = tower(*inputs)
        tower.permute_items(perm)
        tower.fold_item_features()
        assert tower.feature_codes.shape[1] == 0
        # the same histories in the permuted row space: pool row r is canonical row inv[r]
        perm_features = {f: [v[p] for p in perm.tolist()] for f, v in ITEM_FEATURES.items()}
        canonical = FeatureEncoder(spec, perm_features).encode([inv[torch.tensor(h)].numpy() for h in HISTORIES], FEATS, NUMS)
        got = tower(*canonical)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_exported_and_scripted_equal_eager_at_every_batch_size(layers):
    tower = make_tower(**USERS, layers=layers)
    spec = spec_of(USERS)
    enc = encoder_for(tower, spec)
    example = enc.encode([np.array(h) for h in HISTORIES[:2]], FEATS[:2], NUMS[:2])
    batch = torch.export.Dim("batch", min=1, max=4096)
    keys = len(spec.keys)
    program = torch.export.export(tower, example, dynamic_shapes=(
        {0: torch.export.Dim.DYNAMIC}, {0: keys * batch}, {0: batch}), strict=False)
    scripted = torch.jit.script(tower)
    for sizes in ([0], [1], [0, 1, 2, 3, 4], [2, 3, 4, 0, 1, 2, 3]):
        inputs = enc.encode([np.array(HISTORIES[i]) for i in sizes], [FEATS[i] for i in sizes], [NUMS[i] for i in sizes])
        with torch.no_grad():
            want = tower(*inputs)
            torch.testing.assert_close(program.module()(*inputs), want, rtol=0, atol=1e-6)
            torch.testing.assert_close(scripted(*inputs), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layers", [1, 2])
def test_an_empty_history_gets_a_finite_answer(layers):
    tower = make_tower(layers=layers)
    with torch.no_grad():
        out = tower(*encoder_for(tower, spec_of({})).encode([np.zeros(0, dtype=np.int64)]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(1, 2))


def test_item_feature_codes_are_each_features_mean():
    spec = spec_of({})
    codes, weights, offsets = item_feature_codes(spec, ITEM_FEATURES)
    assert offsets == [0, 5]
    for r in range(N_ITEMS):
        for base, name in ((0, "tags"), (5, "cat")):
            vocab = spec.item_vocabs[name]
            want = sorted(base + (vocab.index(v) + 1 if v in vocab else 0) for v in ITEM_FEATURES[name][r])
            mask = (weights[r] > 0) & (codes[r] >= base) & (codes[r] < base + 5)
            assert sorted(codes[r][mask].tolist()) == want
            np.testing.assert_allclose(weights[r][mask], 1.0 / max(1, len(want)))


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="divisible"):
        SequenceConfig(model_dim=10, heads=3)
    with pytest.raises(ValueError, match="dropout"):
        SequenceConfig(dropout=1.0)
