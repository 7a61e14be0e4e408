"""GPU, 2 ranks over NCCL: the per-rank EP dispatch (`alltoall_dedup`) against megatron's alltoall dispatcher in bf16.

glm5-tiny's MoE layer with 16 experts, top-4, EP = 2, 4,096 tokens per rank, the trained-router path (real top-k
routing): the same weights and tokens through `DedupTokenDispatcher` and through megatron-core's own
`MoEAlltoAllTokenDispatcher` methods; outputs, input gradients and every parameter gradient agree within bf16
rounding of reordered sums. Also the rows handed to the all-to-all: fewer with the per-rank dispatch. The same layer
with both all-to-all overlaps on (`pretrain/model/moe_overlap.py`: shared expert under the async dispatch, two chunks
after routing, NCCL async work) against the plain per-rank dispatch, in the same bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SEQ, BATCH, EXPERTS, TOPK = 1024, 4, 16, 4


def rank_compare(rank: int, world_size: int) -> dict:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.config import load_config
    from pretrain.model import ep_dispatch
    from pretrain.model.builder import build_model

    cfg = load_config("configs/models/glm5-tiny.yaml", [
        f"data.seq_length={SEQ}", f"model.num_moe_experts={EXPERTS}", f"model.moe_router_topk={TOPK}",
        "model.moe_token_dispatcher_type=alltoall_dedup", f"parallel.expert_model_parallel_size={world_size}"])
    initialize_parallel(cfg.parallel, seed=5)
    try:
        layer = build_model(cfg).decoder.layers[1].mlp.cuda().bfloat16()
        assert type(layer.token_dispatcher) is ep_dispatch.DedupTokenDispatcher
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(SEQ, BATCH, cfg.model.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        results = {}
        for name in ("dedup", "overlap", "megatron"):
            # the overlapped forward (moe_overlap_chunks=2 + moe_shared_expert_overlap) on the same weights
            layer.shared_under_dispatch, layer.overlap_chunks = (True, 2) if name == "overlap" else (False, 1)
            if name == "megatron":
                layer.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher  # megatron's own methods
            rows = []
            real = ep_dispatch.all_to_all
            ep_dispatch.all_to_all = lambda group, t, out_s, in_s: rows.append(t.shape[0]) or real(group, t, out_s, in_s)
            try:
                for p in layer.parameters():
                    p.grad = None
                xi = x.clone().requires_grad_(True)
                out, _ = layer(xi)
                out.backward(grad)
                torch.cuda.synchronize()
            finally:
                ep_dispatch.all_to_all = real
            results[name] = {"out": out.float(), "dx": xi.grad.float(), "rows": rows,
                             "grads": {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}}
        return results
    finally:
        destroy_parallel()


def test_dedup_matches_megatron_alltoall_in_bf16_on_two_gpus():
    from tests.distributed import run_ranks

    ranks = run_ranks(rank_compare, 2)
    for rank, res in enumerate(ranks):
        ours, ref = res["dedup"], res["megatron"]
        torch.testing.assert_close(ours["out"], ref["out"], rtol=2e-2, atol=2e-2, msg=f"rank {rank} output")
        torch.testing.assert_close(ours["dx"], ref["dx"], rtol=2e-2, atol=2e-2, msg=f"rank {rank} input grad")
        assert ours["grads"].keys() == ref["grads"].keys() and len(ours["grads"]) >= 4
        for name in ours["grads"]:
            scale = ref["grads"][name].abs().max()
            torch.testing.assert_close(ours["grads"][name] / scale, ref["grads"][name] / scale, rtol=2e-2, atol=2e-2,
                                       msg=f"rank {rank} {name}")
        over = res["overlap"]
        torch.testing.assert_close(over["out"], ours["out"], rtol=2e-2, atol=2e-2, msg=f"rank {rank} overlap output")
        torch.testing.assert_close(over["dx"], ours["dx"], rtol=2e-2, atol=2e-2, msg=f"rank {rank} overlap input grad")
        assert over["grads"].keys() == ours["grads"].keys()
        for name in ours["grads"]:
            scale = ours["grads"][name].abs().max()
            torch.testing.assert_close(over["grads"][name] / scale, ours["grads"][name] / scale, rtol=2e-2, atol=2e-2,
                                       msg=f"rank {rank} overlap {name}")
        # dispatch rows: ours once per (token, rank) <= megatron's once per (token, expert) = tokens x k
        assert ours["rows"] and ours["rows"][0] < SEQ * BATCH * TOPK
