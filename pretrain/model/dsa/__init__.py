"""DeepSeek Sparse Attention (DSA), GLM-5's attention (GLM-5 report, DSA section; DeepSeek-V3.2,
section 2).

A lightning indexer scores, for each query token t, every key s it may see (causal, same document):

    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s] * d_I^-1/2)       H_I index heads j, one key head

and selects S_t = the top-k keys of I[t, :]. MLA attention then runs over S_t only, in absorbed form
(every head attends to the 576-dim keys [latent ; rope key] with the 512-dim latent as values), so
its cost per token is O(k) instead of O(t). The indexer trains on its own loss only, detached from
the language model: L_I = mean_t KL(p[t, S] || softmax(I[t, S])) with p the main attention's
probabilities summed over heads and normalized, over every visible key (dense warm-up) or over S_t
(`dsa_indexer_use_sparse_loss`).

Modules:
- `indexer`: `LightningIndexer`, visibility (`VisibleKeys`), index scores and the reference top-k;
- `indexer_fp8`: the top-k's index scores from e4m3 q_I / k_I (`dsa_indexer_fp8`, DeepSeek-V3.2's FP8 indexer);
- `sparse_mla`: the reference sparse absorbed attention (chunked, custom backward);
- `sparse_core`: absorb + sparse attention + expand as one autograd function, keeping less for
  backward than dense attention (its latent output recomputed under `recompute_modules: [core_attn]`);
- `indexer_loss`: the indexer KL losses, their targets and `DSAMetrics`;
- `backend`: `ReferenceBackend` / `TritonBackend`, the one interface the layer calls;
- `kernels`: the Triton kernels;
- `layer`: `DSAMLASelfAttention` and its core-attention slot `DSACoreAttention`.
"""

from pretrain.compat.dsa import IndexerLossAutoScaler
from pretrain.model.dsa.backend import BACKENDS, ReferenceBackend, TritonBackend, select_backend
from pretrain.model.dsa.indexer import LightningIndexer, VisibleKeys, is_indexer_parameter, segment_ids_from_cu_seqlens
from pretrain.model.dsa.indexer_loss import DSAMetrics
from pretrain.model.dsa.layer import DSACoreAttention, DSAMLASelfAttention, link_shared_indexers

__all__ = [
    "BACKENDS",
    "DSACoreAttention",
    "DSAMLASelfAttention",
    "DSAMetrics",
    "IndexerLossAutoScaler",
    "LightningIndexer",
    "ReferenceBackend",
    "TritonBackend",
    "VisibleKeys",
    "is_indexer_parameter",
    "link_shared_indexers",
    "segment_ids_from_cu_seqlens",
    "select_backend",
]
