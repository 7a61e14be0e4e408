"""DeepSeek Sparse Attention (DSA) as GLM-5 uses it (GLM-5 report, DSA; DeepSeek-V3.2 report).

Per query token t, with H_I index heads of d_I dims:

    q_I = W_qb(qr_t)            viewed [H_I, d_I]     (qr: the MLA query latent after its RMSNorm)
    k_I = LayerNorm(W_k x_s)    [d_I], one key head shared by all index heads (eps 1e-6)
    interleaved RoPE on the first qk_pos_emb_head_dim dims of q_I and k_I
    w   = W_w(x_t) * H_I^-1/2 * d_I^-1/2                  (fp32)
    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])    for s <= t
    attention of token t is restricted to topk(min(K, t + 1)) of I[t, :]

`LightningIndexer` holds the indexer's parameters under the names the checkpoint converter maps
to Hugging Face's (`wq_b`, `wk`, `k_norm`, `weights_proj`). The parameters exist whenever
`experimental_attention_variant == "dsa"`, so a dense MLA model carries its indexer through
conversion and checkpoints unchanged; with every key selected (topk >= sequence length) DSA attention
equals dense attention, which is what the core attention computes.
"""

from __future__ import annotations

import torch
from torch import nn


class LightningIndexer(nn.Module):
    def __init__(self, config):
        super().__init__()
        n_heads, head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        # None follows the default device (CPU, or meta when counting parameters).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype

        def linear(out_features: int, in_features: int) -> nn.Linear:
            layer = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
            if config.perform_initialization:
                config.init_method(layer.weight)
            return layer

        self.linear_wq_b = linear(n_heads * head_dim, config.q_lora_rank)
        self.linear_wk = linear(head_dim, config.hidden_size)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, device=device, dtype=dtype)
        # Scores are combined in fp32 (HF keeps this projection in fp32 as well).
        self.linear_weights_proj = linear(n_heads, config.hidden_size)
        self.n_heads, self.head_dim = n_heads, head_dim
        # No computation reads the indexer while attention is dense, so its weights take no
        # gradient: megatron's DDP (with overlapped reduction) waits for a gradient from every
        # trainable parameter, and the optimizer keeps no state for these.
        self.requires_grad_(False)
