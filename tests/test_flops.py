"""The FLOP counter: against torch's FlopCounterMode on the tiny model, its response to the
architecture (dense/MoE layers, MTP depths, top-k), DSA's sparse count, GLM-5 744B, and MFU.

FlopCounterMode counts the matmuls the code executes (mm, bmm, SDPA), full S x S attention (the
CPU math kernel computes every score and masks afterwards), every MTP depth and exactly the
routed experts' token counts (top-k per token); norms, activations and softmax are not counted by
either side. So with causal=False the two counts are the same integer, and the tests compare them
exactly (ours is a float holding an integer far below 2**53, so float equality is integer equality).
"""

import dataclasses
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel.initialize import ensure_single_rank
from pretrain.compat import grouped_mm_available
from pretrain.config import load_config
from pretrain.model import experts
from pretrain.model.builder import build_model
from pretrain.training.flops import (
    mfu,
    peak_flops,
    sparse_keys_per_query,
    training_flops_per_step,
    training_flops_per_token,
)

SEQ, BATCH = 64, 2


def tiny_cfg(*overrides):
    base = [f"data.seq_length={SEQ}", "model.vocab_size=256", "model.moe_token_dispatcher_type=allgather"]
    return load_config("configs/models/glm5-tiny.yaml", base + list(overrides))


def measured_flops(cfg, custom_mapping=None) -> int:
    """FlopCounterMode's count of one forward (main + MTP losses) and backward."""
    ensure_single_rank()
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ))
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    grouped_mm_available("cpu")  # cached probe: keep its tiny test GEMM out of the count
    counter = FlopCounterMode(display=False, custom_mapping=custom_mapping or {})
    with counter:
        model(ids, pos, None, labels=ids).mean().backward()
    return counter.get_total_flops()


VARIANTS = {
    "tiny (dense + MoE layer, 3 MTP depths)": [],
    "all MoE layers": ["model.moe_layer_freq=1"],
    "1 MTP depth": ["model.mtp_num_layers=1"],
    "no MTP": ["model.mtp_num_layers=0"],
    "top-4 of 8 experts": ["model.moe_router_topk=4"],
    "MLA without q LoRA": ["model.q_lora_rank=null", "model.experimental_attention_variant=null"],
    "GQA": ["model.multi_latent_attention=false", "model.experimental_attention_variant=null",
            "model.num_query_groups=2", "model.kv_channels=16"],
}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_flop_counter_mode(overrides):
    """Routed experts through the per-expert loop, whose matmuls FlopCounterMode counts itself."""
    cfg = tiny_cfg(*overrides)
    with mock.patch.object(experts, "grouped_mm_available", lambda device: False):
        reference = measured_flops(cfg)
    ours = training_flops_per_step(cfg.model, SEQ, BATCH * SEQ, causal=False)["total"]
    assert ours == reference, f"ours {ours:,.0f} vs FlopCounterMode {reference:,}: {ours - reference:+,.0f}"


def test_matches_flop_counter_mode_grouped_gemm():
    """The grouped-GEMM path (torch._grouped_mm, unknown to FlopCounterMode: given its formula)."""

    def grouped_mm(a, b, *args, out_shape=None, **kwargs):
        if len(a) == 2 and len(b) == 3:  # [T, K] x [E, K, N] -> [T, N]
            return 2 * a[0] * a[1] * b[2]
        if len(a) == 2 and len(b) == 2:  # weight gradient: [K, T] x [T, N] -> [E, K, N]
            return 2 * a[0] * a[1] * b[1]
        raise AssertionError(f"unexpected _grouped_mm shapes {a} x {b}")

    cfg = tiny_cfg()
    reference = measured_flops(cfg, {torch.ops.aten._grouped_mm: grouped_mm})
    ours = training_flops_per_step(cfg.model, SEQ, BATCH * SEQ, causal=False)["total"]
    assert ours == reference, f"ours {ours:,.0f} vs FlopCounterMode {reference:,}: {ours - reference:+,.0f}"


def test_structure_responds_to_architecture():
    cfg = tiny_cfg()
    m = cfg.model
    h, x3 = m.hidden_size, 3
    base = training_flops_per_token(m, SEQ)
    assert sum(base["components"].values()) == pytest.approx(base["total"])
    assert sum(base["parts"].values()) == pytest.approx(base["total"])

    # layer 0 dense -> MoE: the dense SwiGLU leaves, router + top-k experts + shared expert arrive
    all_moe = training_flops_per_token(dataclasses.replace(m, moe_layer_freq=1), SEQ)
    dense_mlp = x3 * 6 * h * m.ffn_hidden_size
    moe_ffn = x3 * (2 * h * m.num_moe_experts + 6 * h * m.moe_ffn_hidden_size * m.moe_router_topk
                    + 6 * h * m.moe_shared_expert_intermediate_size)
    assert all_moe["total"] - base["total"] == pytest.approx(moe_ffn - dense_mlp)
    assert "dense_mlp" not in all_moe["components"]

    # each MTP depth: eh_proj + one decoder layer (the last layer's, MoE) + the output head
    per_depth = base["parts"]["mtp"] / m.mtp_num_layers
    one = training_flops_per_token(dataclasses.replace(m, mtp_num_layers=1), SEQ)
    none = training_flops_per_token(dataclasses.replace(m, mtp_num_layers=0), SEQ)
    assert one["total"] - none["total"] == pytest.approx(per_depth)
    assert none["parts"]["mtp"] == 0 and none["parts"]["main"] == pytest.approx(base["parts"]["main"])
    moe_layer = all_moe["parts"]["main"] - all_moe["components"]["output_head"] / (1 + m.mtp_num_layers)
    moe_layer /= m.num_layers
    assert per_depth == pytest.approx(x3 * 2 * 2 * h * h + moe_layer + x3 * 2 * h * m.vocab_size)

    # routed experts scale with top-k (active experts only), nothing else changes
    top4 = training_flops_per_token(dataclasses.replace(m, moe_router_topk=4), SEQ)
    assert top4["components"]["routed_experts"] == pytest.approx(2 * base["components"]["routed_experts"])
    assert top4["total"] - top4["components"]["routed_experts"] == pytest.approx(
        base["total"] - base["components"]["routed_experts"])
    assert "attention_sparse" not in base["components"] and "dsa_indexer" not in base["components"]

    # causal counts half the score matrix; per step = per token x tokens
    full = training_flops_per_token(m, SEQ, causal=False)
    assert full["components"]["attention_core"] == pytest.approx(2 * base["components"]["attention_core"])
    step = training_flops_per_step(m, SEQ, 1000)
    assert step["total"] == pytest.approx(1000 * base["total"]) and step["per_token"] == base["total"]


def glm5_744b():
    return load_config("configs/models/glm5-744b.yaml").model


def test_glm5_744b_per_token_is_plausible():
    """~6 x 39.9B active parameters (GLM-5 report) per token, plus attention and MTP."""
    m = glm5_744b()
    seq = 4096
    no_mtp = training_flops_per_token(dataclasses.replace(m, mtp_num_layers=0), seq)
    matmul_params = (no_mtp["total"] - no_mtp["components"]["attention_core"]) / 6
    # 39.88B active without embedding/head, minus the DSA indexer (0.73B, not run densely) and
    # norms, plus the untied output head (0.95B)
    assert 39.5e9 < matmul_params < 40.5e9
    causal_attention = 3 * 2 * m.num_attention_heads * (256 + 256) * seq / 2 * m.num_layers
    assert no_mtp["components"]["attention_core"] == pytest.approx(causal_attention)
    with_mtp = training_flops_per_token(m, seq)
    assert 2.9e11 < with_mtp["total"] < 3.1e11
    assert with_mtp["parts"]["mtp"] / with_mtp["total"] == pytest.approx(0.096, abs=0.01)  # 3 depths x ~1 layer + head


def test_dsa_sparse_attention_long_sequence():
    """At S = 4 x topk, sparse attention (absorbed MLA, topk keys per query beyond position topk)
    costs (576 + 512) x mean_t min(topk, t) against dense (256 + 256) x S / 2 per head and query."""
    m = glm5_744b()
    topk, seq = m.dsa_indexer_topk, 4 * m.dsa_indexer_topk
    dense = training_flops_per_token(m, seq)["components"]
    sparse = training_flops_per_token(m, seq, dsa_sparse=True)["components"]
    assert "attention_core" not in sparse and "attention_sparse" in sparse and "attention_core" in dense
    mean_keys = sum(min(topk, t) for t in range(1, seq + 1)) / seq  # the exact discrete average
    expected = (576 + 512) * mean_keys / ((256 + 256) * seq / 2)
    ratio = sparse["attention_sparse"] / dense["attention_core"]
    assert ratio == pytest.approx(expected, rel=1e-3)
    assert ratio < 1  # 0.93: S = 8192 is just below the ~8.7K break-even of the DSA cost model
    assert sparse_keys_per_query(seq, topk) == pytest.approx(mean_keys, rel=1e-3)
    # far past break-even the sparse part is a small fraction (topk keys against S / 2)
    long = 64 * topk
    far = training_flops_per_token(m, long, dsa_sparse=True)["components"]["attention_sparse"]
    assert far / training_flops_per_token(m, long)["components"]["attention_core"] < 0.07  # 0.066
    # the indexer: projections (weight gradients only) + scores over the causal keys, every layer + MTP
    n_i, d_i, layers = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim, m.num_layers + m.mtp_num_layers
    proj = 2 * (2 * m.q_lora_rank * n_i * d_i + 2 * m.hidden_size * (d_i + n_i))
    assert sparse["dsa_indexer"] == pytest.approx(layers * (proj + 3 * 2 * n_i * d_i * seq / 2))
    # everything but attention and the indexer is unchanged
    rest = {k: v for k, v in dense.items() if k != "attention_core"}
    assert rest == pytest.approx({k: v for k, v in sparse.items() if k not in ("attention_sparse", "dsa_indexer")})


def test_dsa_sparse_short_sequence_selects_every_key():
    """At S <= topk every causal key is selected: the same keys as dense causal attention, so the
    two differ only by the absorbed form's per-key cost, (576 + 512) / (256 + 256) = 2.125."""
    m = glm5_744b()
    for seq in (1024, m.dsa_indexer_topk):
        dense = training_flops_per_token(m, seq)["components"]["attention_core"]
        sparse = training_flops_per_token(m, seq, dsa_sparse=True)["components"]["attention_sparse"]
        assert sparse_keys_per_query(seq, m.dsa_indexer_topk) == seq / 2
        assert sparse / dense == pytest.approx(1088 / 512)


def test_dsa_needs_the_indexer():
    m = tiny_cfg("model.experimental_attention_variant=null").model
    with pytest.raises(ValueError, match="experimental_attention_variant"):
        training_flops_per_token(m, SEQ, dsa_sparse=True)


def test_peak_flops_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops("NVIDIA B200") == pytest.approx(2.25e15)
    assert peak_flops("cpu") is None and peak_flops(None) is None and peak_flops("NVIDIA T4") is None
    assert mfu(494.7e12, "NVIDIA H200") == pytest.approx(0.5)
    assert mfu(1e12, "cpu") is None
