"""FP8 index scores for DSA's top-k selection (DeepSeek-V3.2, section 2.1: "the lightning indexer ... can be
implemented in FP8"; GLM-5 report, DSA section). Off by default (`model.dsa_indexer_fp8`): GLM-5's indexer is bf16.

The indexer's queries and keys are quantized per row to e4m3 with one scale each (per token and index head for
q_I, per key for k_I):

    x8 = round_e4m3(x / s_x),     s_x = max_i |x_i| / 448   (1 for an all-zero row)

and the selection ranks keys by

    I8[t, s] = d^-1/2 * s_k[s] * sum_j (w[t, j] s_q[t, j]) ReLU(q8[t, j] . k8[s])

which is `indexer.index_scores` of the dequantized rows (ReLU(a z) = a ReLU(z) for a > 0). The e4m3 products are
exact in fp32, so the Triton kernel runs q8 . k8 on FP8 tensor cores (twice bf16's rate on Hopper) and applies the
scales after: s_q folded into the head weights w, s_k on the score columns. Only the selection uses I8; the
indexer loss (KL to the attention) keeps the bf16 scores, so the indexer trains as before. DeepSeek pairs its FP8
indexer with a Hadamard rotation of q_I and k_I (`model.dsa_indexer_hadamard`), which spreads outlier dims before the
per-row scale is taken; the two keys are independent here. What FP8 costs in selection accuracy (recall of the bf16
top-k, per layer) and what it saves: docs/dsa.md.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor):
    """x [..., d] -> (x8 [..., d] float8_e4m3fn, scale [...] fp32) with x ~ x8 * scale, one scale per row."""
    amax = x.detach().abs().amax(-1).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (x.detach().float() / scale[..., None]).to(torch.float8_e4m3fn)
    return x8, scale


def selection_inputs(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor):
    """The indexer's q_I [b, s, H, d], k_I [b, T, d], w [b, s, H] -> (q8, k8, w * s_q fp32 [b, s, H], s_k fp32
    [b, T]): what the FP8 selection scores read."""
    q8, sq = quantize_rows(q)
    k8, sk = quantize_rows(k)
    return q8, k8, w.float() * sq, sk


__all__ = ["E4M3_MAX", "quantize_rows", "selection_inputs"]
