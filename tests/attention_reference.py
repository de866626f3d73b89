"""The float64 attention oracle the CPU backends are checked against (tests/attention/test_torch_backend.py,
tests/attention/test_cpu_attention.py, tests/attention/test_sliding_window.py)."""
from __future__ import annotations

import torch


def reference_attention(queries, keys, values, context_lens, scale, window=0, softcap=0.0,
                        sinks=None) -> list[torch.Tensor]:
    """Causal attention in float64, per sequence: queries [qlen, heads, hd], keys/values the whole
    sequence [seq_len, kv_heads, hd]; query j of a sequence (position p = context_len + j) sees keys
    0..p, or with window > 0 the keys p - window < i <= p; softcap > 0 caps the scores at
    softcap * tanh(score / softcap); sinks ([heads], GPT-OSS) joins each head's softmax denominator as
    one more logit with a zero value vector (HF's eager_attention_forward: concatenated, softmaxed, dropped)."""
    outs = []
    for q, k, v, ctx in zip(queries, keys, values, context_lens):
        q, k, v = q.double(), k.double(), v.double()
        qlen, heads, hd = q.shape
        group = heads // k.shape[1]
        out = torch.empty(qlen, heads, hd, dtype=torch.float64)
        for j in range(qlen):
            visible = ctx + j + 1
            first = max(0, visible - window) if window > 0 else 0
            kk = k[first:visible].repeat_interleave(group, dim=1)  # [visible - first, heads, hd]
            vv = v[first:visible].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[j], kk) * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                combined = torch.cat([scores, sinks.double()[:, None]], dim=-1)
                probs = torch.softmax(combined, dim=-1)[:, :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out[j] = torch.einsum("hk,khd->hd", probs, vv)
        outs.append(out)
    return outs


def assert_matches_reference(out, queries, keys, values, context_lens, scale, atol, window=0, softcap=0.0,
                             sinks=None) -> None:
    """out holds the sequences' query rows one after another; each within atol of the oracle."""
    start = 0
    for i, r in enumerate(reference_attention(queries, keys, values, context_lens, scale, window, softcap,
                                                      sinks)):
        got = out[start : start + r.shape[0]].double()
        assert torch.isfinite(got).all(), f"seq {i}: non-finite output"
        err = (got - r).abs().max().item()
        assert err < atol, f"seq {i} (ctx {context_lens[i]}, q {r.shape[0]}): max error {err}"
        start += r.shape[0]
