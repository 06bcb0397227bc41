"""RecDecoder vs transformers' LlamaForCausalLM (independent reference), config validation,
and prefill/decode (staged shared + unshared KV) vs the plain causal forward."""

import pytest
import torch

from silverrec.generative.decoder import (
    BOS,
    PAD,
    DecoderConfig,
    RecDecoder,
    level_offsets,
    paths_to_tokens,
    to_llama,
    vocab_size,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _cfg(**kw):
    base = dict(vocab_size=37, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=80, max_seq_len=64)
    base.update(kw)
    return DecoderConfig(**base)


def _left_padded(lengths, T, vocab, gen=None):
    rows = []
    for n in lengths:
        body = torch.randint(2, vocab, (n - 1,), generator=gen)
        rows.append(torch.cat([torch.full((T - n,), PAD), torch.tensor([BOS]), body]))
    return torch.stack(rows)


def _random_model(cfg, std=0.3):
    model = RecDecoder(cfg).eval()
    model.reset_parameters(std)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention_norm.weight.uniform_(0.5, 1.5)
            layer.ffn_norm.weight.uniform_(0.5, 1.5)
    return model


def test_vocabulary_contract():
    sizes = [256, 256, 256, 7]
    assert level_offsets(sizes) == [2, 258, 514, 770]
    assert vocab_size(sizes) == 777
    paths = torch.tensor([[0, 0, 0, 0], [255, 1, 2, 6]])
    assert paths_to_tokens(paths, sizes).tolist() == [[2, 258, 514, 770], [257, 259, 516, 776]]


@pytest.mark.parametrize(
    "bad",
    [dict(dim=50), dict(n_kv_heads=4), dict(vocab_size=2), dict(n_layers=0), dict(rope_theta=-1.0), dict(dim=True)],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        _cfg(**bad)


def test_config_round_trip():
    cfg = _cfg()
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        DecoderConfig.from_dict({**cfg.to_dict(), "bogus": 1})


@pytest.mark.parametrize("n_kv_heads", [1, 2, 6])
def test_logits_match_hf_llama(n_kv_heads):
    cfg = _cfg(n_kv_heads=n_kv_heads)
    model = _random_model(cfg)
    hf = to_llama(model)
    tokens = _left_padded([9, 5, 1, 12], 12, cfg.vocab_size)
    mask = tokens != PAD
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        ours = model(tokens)
        ref = hf(input_ids=tokens, attention_mask=mask.long(), position_ids=pos).logits
    torch.testing.assert_close(ours[mask], ref[mask], atol=2e-5, rtol=2e-5)
    # unpadded rows: no mask needed by HF either
    with torch.no_grad():
        ref_full = hf(input_ids=tokens[3:]).logits
    torch.testing.assert_close(ours[3:], ref_full, atol=2e-5, rtol=2e-5)


def test_padding_invariance():
    """A left-padded row computes the same logits as the same row unpadded."""
    cfg = _cfg()
    model = _random_model(cfg)
    tokens = _left_padded([6], 10, cfg.vocab_size)
    with torch.no_grad():
        padded = model(tokens)[0, 4:]
        alone = model(tokens[:, 4:])[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_prefill_and_staged_decode_match_forward():
    """prefill + decode steps (shared KV once, per-beam unshared KV) == full forward per beam."""
    cfg = _cfg()
    model = _random_model(cfg).double()
    B, W, S, T = 3, 4, 3, 9
    hist = _left_padded([9, 4, 2], T, cfg.vocab_size)
    new = torch.randint(2, cfg.vocab_size, (B, W, S))
    with torch.no_grad():
        last, sk, sv = model.prefill(hist)
        torch.testing.assert_close(last, model(hist)[:, -1])
        n_real = (hist != PAD).sum(1)
        uk = torch.zeros(cfg.n_layers, B * W, S, cfg.n_kv_heads, cfg.head_dim, dtype=torch.float64)
        uv = torch.zeros_like(uk)
        for s in range(S):
            logits = model.decode(new[:, :, s], n_real + s, sk, sv, hist != PAD, uk, uv, s)
            full = torch.cat([hist[:, None].expand(B, W, T), new[:, :, : s + 1]], dim=2).reshape(B * W, T + s + 1)
            ref = model(full)[:, -1].reshape(B, W, -1)
            torch.testing.assert_close(logits, ref, atol=1e-10, rtol=1e-10)


def test_prefill_with_batch_folded_into_heads_is_equal():
    """The prefill's batch-in-heads attention (torch < 2.13, see silverrec/attention.py) gives
    the plain 4-D attention's logits and KV, padded rows included."""
    cfg = _cfg()
    model = _random_model(cfg)
    tokens = _left_padded([1, 5, 9], 9, cfg.vocab_size)
    want = model.prefill(tokens)
    for layer in model.layers:
        layer.attention.batch_in_heads = not layer.attention.batch_in_heads
    got = model.prefill(tokens)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
