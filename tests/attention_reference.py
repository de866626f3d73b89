"""The float64 attention oracle the CPU backends are checked against (tests/attention/test_torch_backend.py,
tests/attention/test_cpu_attention.py)."""
from __future__ import annotations

import torch


def reference_attention(queries, keys, values, context_lens, scale) -> list[torch.Tensor]:
    """Causal attention in float64, per sequence: queries [qlen, heads, hd], keys/values the whole
    sequence [seq_len, kv_heads, hd]; query j of a sequence sees keys 0..context_len + j."""
    outs = []
    for q, k, v, ctx in zip(queries, keys, values, context_lens):
        q, k, v = q.double(), k.double(), v.double()
        qlen, heads, hd = q.shape
        group = heads // k.shape[1]
        out = torch.empty(qlen, heads, hd, dtype=torch.float64)
        for j in range(qlen):
            visible = ctx + j + 1
            kk = k[:visible].repeat_interleave(group, dim=1)  # [visible, heads, hd]
            vv = v[:visible].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[j], kk) * scale
            out[j] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), vv)
        outs.append(out)
    return outs


def assert_matches_reference(out, queries, keys, values, context_lens, scale, atol) -> None:
    """out holds the sequences' query rows one after another; each within atol of the oracle."""
    start = 0
    for i, r in enumerate(reference_attention(queries, keys, values, context_lens, scale)):
        got = out[start : start + r.shape[0]].double()
        assert torch.isfinite(got).all(), f"seq {i}: non-finite output"
        err = (got - r).abs().max().item()
        assert err < atol, f"seq {i} (ctx {context_lens[i]}, q {r.shape[0]}): max error {err}"
        start += r.shape[0]
