"""Model FLOPs of one GLM-5 training step, by component, and MFU against the GPU's dense bf16 peak.

Convention (what is counted)
----------------------------
* Matrix multiplications only, 2 FLOPs per multiply-add. Norms, activations, RoPE, softmax, the
  router's top-k and loss arithmetic, embedding look-ups and communication are not counted (they
  are O(hidden) per token against the O(hidden^2) GEMMs).
* Training = forward + backward, backward = 2x forward (input and weight gradient), so every
  GEMM counts 3x its forward cost. Exception, DSA only: the indexer's inputs are detached in the
  sparse stage (DeepSeek-V3.2 report), so its three projections compute
  only the weight gradient in backward (2x forward in total); its index scores still count 3x.
* Model FLOPs, not hardware FLOPs: activation recomputation is not counted, as in MFU.
* Attention scores Q K^T use the q/k head dim (MLA: qk_head_dim + qk_pos_emb_head_dim; GQA:
  kv_channels) and P V the v head dim (MLA: v_head_dim). Causal attention (`causal=True`, the
  default) counts half of the full S x S matrix, i.e. S / 2 keys per query, the convention of the
  FlashAttention-2 benchmarks (the work a causal kernel does); `causal=False` counts all S keys
  (what torchtitan's 6N + 12LHS formula and torch's FlopCounterMode count).
* Every GLM-5 component, per token:
    MLA        q_down h x q_lora, q_up q_lora x heads*(qk + rope) (or q_proj h x heads*(qk + rope)
               when q_lora_rank is None), kv_down h x (kv_lora + rope), kv_up kv_lora x heads*(qk + v),
               o_proj heads*v x h
    dense FFN  SwiGLU: fc1 h x 2*ffn, fc2 ffn x h          (layers whose moe_layer_freq entry is 0)
    MoE        router h x E, top-k routed SwiGLU experts (only the active ones), shared SwiGLU expert
    head       h x vocab, once for the main model and once per MTP depth
    MTP        per depth (mtp_num_layers depths, counted even though they share parameters): eh_proj
               2h x h, one full decoder layer (the spec of the last decoder layer), the output head
* DSA (`dsa_sparse=True`; the indexer runs in every layer, the MTP layer too): the lightning indexer's
  wq_b q_lora x H_I*d_I, wk h x d_I and weights_proj h x H_I, and its index scores 2*H_I*d_I per
  (query, key) pair over the causal keys (S / 2 per query); plus sparse attention over the selected
  keys INSTEAD of dense attention, in MLA's absorbed (MQA) form as DeepSeek's kernels compute it
  (the DeepSeek-V3.2 report's indexer): per query 2*heads*k*(kv_lora + rope) for the scores and
  2*heads*k*kv_lora for the values, times 3 for forward + backward. The absorption itself
  (q_nope x W_UK, and W_UV after attention) costs exactly what kv_up costs per token, so the MLA
  projection count is the same in both forms. k is the mean over queries of min(topk, keys the
  query may see); with the S / 2 convention (continuous average over positions t in [0, S]) that is
  S / 2 for S <= topk and topk - topk^2 / (2 S) above (topk keys for any query past position topk);
  with `causal=False`, min(topk, S).
  At S <= topk every causal key is selected and the absorbed form does more work per key than
  dense MLA attention ((kv_lora + rope + kv_lora) / (qk + rope + v) = 1088 / 512 at GLM-5's shapes),
  so DSA only pays off at long context: with topk keys per query, dense causal attention
  (S / 2 keys x 512) costs as much as sparse at S = 2 * 2048 * 1088 / 512 = 8704 tokens, the
  "about 8.7K" break-even the DSA papers' cost model gives.
  `dsa_indexer=True` with `dsa_sparse=False` counts the indexer next to dense attention (the dense
  warm-up stage, where only the indexer learns).

Sources: GLM-5 technical report (arXiv 2602.15763) and the DeepSeek-V3.2 report; the GEMM shapes are those of our megatron-core specs
(pretrain/model/specs.py), checked against torch's FlopCounterMode in tests/test_flops.py.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from pretrain.config import moe_layer_pattern

TRAIN_MULTIPLIER = 3  # forward + backward (input and weight gradients) for a GEMM


# ----------------------------------------------------------------------------------- per layer
def _attention_projections(m) -> float:
    """Forward FLOPs per token of the attention projections (MLA or GQA)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if not m.multi_latent_attention:
        d = m.kv_channels or h // heads
        groups = m.num_query_groups or heads
        return 2 * h * (heads * d + 2 * groups * d) + 2 * heads * d * h
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank is None:
        q = 2 * h * heads * qk
    else:
        q = 2 * h * m.q_lora_rank + 2 * m.q_lora_rank * heads * qk
    kv = 2 * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
    return q + kv + 2 * heads * m.v_head_dim * h


def _attention_head_dims(m) -> Tuple[int, int]:
    """(q/k head dim, v head dim) of dense attention."""
    if m.multi_latent_attention:
        return m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    return d, d


def dense_keys_per_query(seq_length: int, causal: bool = True) -> float:
    """Keys a query attends to on average: S / 2 causal (half the S x S matrix), S otherwise."""
    return seq_length / 2 if causal else float(seq_length)


def sparse_keys_per_query(seq_length: int, topk: int, causal: bool = True) -> float:
    """Mean over queries of min(topk, visible keys), continuous in the position like S / 2."""
    if not causal:
        return float(min(topk, seq_length))
    if seq_length <= topk:
        return seq_length / 2
    return topk - topk * topk / (2 * seq_length)


def _layer_flops(m, seq_length: int, moe: bool, dsa_sparse: bool, dsa_indexer: bool, causal: bool) -> Dict[str, float]:
    """Training FLOPs (forward + backward) per token of one decoder layer, by component."""
    h, heads, x3 = m.hidden_size, m.num_attention_heads, TRAIN_MULTIPLIER
    out = {"attention_proj": x3 * _attention_projections(m)}
    if dsa_sparse:
        keys = sparse_keys_per_query(seq_length, m.dsa_indexer_topk, causal)
        if m.multi_latent_attention:  # absorbed form: latent + rope keys, latent values
            per_key = 2 * heads * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * heads * m.kv_lora_rank
        else:
            dqk, dv = _attention_head_dims(m)
            per_key = 2 * heads * (dqk + dv)
        out["attention_sparse"] = x3 * per_key * keys
    else:
        dqk, dv = _attention_head_dims(m)
        window = getattr(m, "window_size", None)  # sliding window: the keys inside it (left + 1 at most)
        keys = sparse_keys_per_query(seq_length, window[0] + 1, causal) if window else dense_keys_per_query(
            seq_length, causal)
        out["attention_core"] = x3 * 2 * heads * (dqk + dv) * keys
    if dsa_indexer:
        n_i, d_i = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
        q_in = m.q_lora_rank or h
        projections = 2 * q_in * n_i * d_i + 2 * h * d_i + 2 * h * n_i
        scores = 2 * n_i * d_i * dense_keys_per_query(seq_length, causal)
        out["dsa_indexer"] = 2 * projections + x3 * scores  # detached inputs: weight gradients only
    if moe:
        out["router"] = x3 * 2 * h * m.num_moe_experts
        out["routed_experts"] = x3 * m.moe_router_topk * 6 * h * m.moe_ffn_hidden_size
        if m.moe_shared_expert_intermediate_size:
            out["shared_expert"] = x3 * 6 * h * m.moe_shared_expert_intermediate_size
    else:
        out["dense_mlp"] = x3 * 6 * h * m.ffn_hidden_size
    return out


def _add(total: Dict[str, float], part: Dict[str, float], times: float = 1.0) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value * times


def layer_training_flops(model_cfg, seq_length: int, moe: bool, dsa_sparse: bool = False, causal: bool = True,
                         dsa_indexer: Optional[bool] = None) -> float:
    """Training FLOPs per token of one decoder layer (dense or MoE FFN); the per-layer term of
    `training_flops_per_token` (pipeline stage balancing, `pretrain.tools.pipeline_split`)."""
    m = getattr(model_cfg, "model", model_cfg)
    dsa_indexer = dsa_sparse if dsa_indexer is None else dsa_indexer
    return sum(_layer_flops(m, seq_length, moe, dsa_sparse, dsa_indexer, causal).values())


def output_head_training_flops(model_cfg) -> float:
    """Training FLOPs per token of one output head (h x vocab); once for the main model, once per MTP depth."""
    m = getattr(model_cfg, "model", model_cfg)
    return TRAIN_MULTIPLIER * 2 * m.hidden_size * m.vocab_size


def mtp_eh_proj_training_flops(model_cfg) -> float:
    """Training FLOPs per token of one MTP depth's eh_proj (2h x h)."""
    m = getattr(model_cfg, "model", model_cfg)
    return TRAIN_MULTIPLIER * 2 * (2 * m.hidden_size) * m.hidden_size


# ----------------------------------------------------------------------------------- model
def training_flops_per_token(
    model_cfg,
    seq_length: int,
    dsa_sparse: bool = False,
    causal: bool = True,
    dsa_indexer: Optional[bool] = None,
) -> Dict[str, object]:
    """Training FLOPs (forward + backward) per token of a `seq_length` sequence.

    `model_cfg` is a `ModelConfig` (or a `GLM5Config`, whose `.model` is used). Returns
    {"total": float, "components": {name: float}, "parts": {"main": float, "mtp": float}}:
    the components (attention_proj, attention_core or attention_sparse, dsa_indexer, dense_mlp,
    router, routed_experts, shared_expert, output_head, mtp_eh_proj) include the MTP depths' work
    and sum to total; "parts" splits the same total into the main model and the MTP depths.
    `dsa_indexer` (default: `dsa_sparse`) counts the lightning indexer.
    """
    m = getattr(model_cfg, "model", model_cfg)
    dsa_indexer = dsa_sparse if dsa_indexer is None else dsa_indexer
    if (dsa_sparse or dsa_indexer) and m.experimental_attention_variant != "dsa":
        raise ValueError("dsa_sparse / dsa_indexer need model.experimental_attention_variant=dsa")
    pattern: List[int] = moe_layer_pattern(m)
    x3, h = TRAIN_MULTIPLIER, m.hidden_size
    layer = {
        is_moe: _layer_flops(m, seq_length, bool(is_moe), dsa_sparse, dsa_indexer, causal) for is_moe in set(pattern)
    }
    head = {"output_head": x3 * 2 * h * m.vocab_size}

    main: Dict[str, float] = {}
    for is_moe in pattern:
        _add(main, layer[is_moe])
    _add(main, head)

    mtp: Dict[str, float] = {}
    depths = m.mtp_num_layers or 0
    if depths:
        last = bool(pattern[-1])  # the MTP layer has the last decoder layer's spec
        mtp_layer = layer.get(pattern[-1]) or _layer_flops(m, seq_length, last, dsa_sparse, dsa_indexer, causal)
        _add(mtp, {"mtp_eh_proj": x3 * 2 * (2 * h) * h}, depths)
        _add(mtp, mtp_layer, depths)
        _add(mtp, head, depths)

    components: Dict[str, float] = {}
    _add(components, main)
    _add(components, mtp)
    main_total, mtp_total = sum(main.values()), sum(mtp.values())
    return {
        "total": main_total + mtp_total,
        "components": components,
        "parts": {"main": main_total, "mtp": mtp_total},
    }


def training_flops_per_step(
    model_cfg,
    seq_length: int,
    global_batch_tokens: int,
    dsa_sparse: bool = False,
    causal: bool = True,
    dsa_indexer: Optional[bool] = None,
) -> Dict[str, object]:
    """Training FLOPs of one optimizer step over `global_batch_tokens` tokens (all ranks together).

    Same structure as `training_flops_per_token` scaled by the token count, plus "per_token" and
    "tokens". Divide "total" by the step time and the number of GPUs for the achieved FLOP/s per GPU.
    """
    per_token = training_flops_per_token(model_cfg, seq_length, dsa_sparse, causal, dsa_indexer)
    n = global_batch_tokens
    return {
        "total": per_token["total"] * n,
        "per_token": per_token["total"],
        "tokens": n,
        "components": {k: v * n for k, v in per_token["components"].items()},
        "parts": {k: v * n for k, v in per_token["parts"].items()},
    }


def configured_flops_per_step(model_cfg, seq_length: int, global_batch_tokens: int) -> float:
    """Total training FLOPs of one step of the model as its config trains it: DSA's sparse
    attention and its indexer loss counted when `model_cfg` turns them on."""
    dsa = model_cfg.experimental_attention_variant == "dsa"
    return training_flops_per_step(
        model_cfg, seq_length, global_batch_tokens, dsa_sparse=dsa and model_cfg.dsa_sparse_attention,
        dsa_indexer=dsa and model_cfg.dsa_indexer_loss_coeff > 0,
    )["total"]


# ----------------------------------------------------------------------------------- MFU
# Dense (no structured sparsity) bf16 tensor-core peaks in FLOP/s, from the vendors' datasheets.
# First match wins, so the more specific names come first.
_PEAKS: List[Tuple[str, float]] = [
    (r"gh200", 989.4e12),
    (r"gb200", 2.5e15),
    (r"b200", 2.25e15),
    (r"b100", 1.75e15),
    (r"h100.*pcie", 756.0e12),
    (r"h100.*nvl", 835.0e12),
    (r"h100", 989.4e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"h800.*pcie", 756.0e12),
    (r"h800", 989.4e12),
    (r"h200.*nvl", 835.0e12),
    (r"h200", 989.4e12),
    (r"h20\b", 148.0e12),
    (r"a100|a800", 312.0e12),
    (r"l40s", 362.1e12),
    (r"l40\b", 181.0e12),
    (r"mi300x|mi325x", 1307.4e12),
    (r"mi250x", 383.0e12),
]


def peak_flops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU by its name (`torch.cuda.get_device_name()`); None for
    a CPU or an unknown device, so MFU is reported as null rather than guessed."""
    if not device_name:
        return None
    name = device_name.lower()
    for pattern, peak in _PEAKS:
        if re.search(pattern, name):
            return peak
    return None


def mfu(achieved_flops_per_s_per_gpu: float, device_name: Optional[str]) -> Optional[float]:
    """Model FLOPs utilization as a fraction of the dense bf16 peak (None when the peak is unknown)."""
    peak = peak_flops(device_name)
    if peak is None or achieved_flops_per_s_per_gpu is None:
        return None
    return achieved_flops_per_s_per_gpu / peak


def format_breakdown(flops: Dict[str, object]) -> str:
    """A table of the components' share, for `python -m pretrain.training.flops`."""
    total = flops["total"]
    lines = [f"{'component':<18}{'FLOPs':>14}{'share':>8}"]
    for name, value in sorted(flops["components"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<18}{value:>14.4g}{value / total:>8.1%}")
    lines.append(f"{'total':<18}{total:>14.4g}")
    if "per_token" in flops:
        lines.append(f"per token: {flops['per_token']:.4g} FLOPs (main {flops['parts']['main'] / flops['tokens']:.4g}, "
                     f"MTP {flops['parts']['mtp'] / flops['tokens']:.4g})")
    return "\n".join(lines)


def main(argv=None) -> None:
    """python -m pretrain.training.flops --config X [--dsa-sparse] [--no-causal] [overrides...]"""
    import argparse

    from pretrain.config import load_config

    parser = argparse.ArgumentParser(description="Training FLOPs per step of a config, by component")
    parser.add_argument("--config", required=True)
    parser.add_argument("--dsa-sparse", action="store_true", help="count the indexer and sparse attention")
    parser.add_argument("--no-causal", action="store_true", help="count full S x S attention")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    tokens = cfg.train.global_batch_size * cfg.data.seq_length
    flops = training_flops_per_step(cfg.model, cfg.data.seq_length, tokens, args.dsa_sparse, not args.no_causal)
    print(format_breakdown(flops))


if __name__ == "__main__":
    main()
