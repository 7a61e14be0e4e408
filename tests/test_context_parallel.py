"""Context parallelism (parallel/context_parallel.py) gives the single-rank losses and gradients.

The tiny GLM-5 (2 layers: dense then MoE with seq_aux_loss; fp32, no dropout) on 2 sequences of 32
tokens, one micro-batch through megatron's schedule with the training step's `forward_step` (which
splits the batch) inside megatron's DDP + `finalize_model_grads`, so the gradients compared are the
`main_grad`s an optimizer step sees (averaged over DP x CP). Reference: the same code on one rank
(CP = 1), with weights every parallel run loads (other seeds, so nothing can come from a shared
initialization). Compared at relative max-abs error 1e-5: the LM loss (token mean over the global
batch), the per-layer indexer losses, and every parameter's gradient (a DSA indexer's parameters relative to the
largest gradient of that indexer: `indexer_scales`).

Cases: dense MLA (no DSA: megatron's MLA at CP = 1, the latent layer at CP > 1), DSA sparse attention
with the sparse KL, DSA warm-up (dense attention, dense KL), GQA-8-style attention (4 heads, 2 groups),
packed documents as the data pipeline gives them (cu_seqlens and restarting position ids, which the training
step turns into the O(S) document layout; a loss mask with holes, so the CP ranks hold different numbers of loss
tokens), DSA sparse, DSA dense with the dense KL, and GQA (documents isolated, window positions), and the MTP
layer (2 depths, rolled labels crossing chunk boundaries). The dense core attention alone (all-gather, query chunks
as non-causal blocks plus causal squares merged by log-sum-exp, reduce-scatter; GQA shapes, without and with
packed documents, the zigzag split and chunks assigned by work, `parallel.cp_load_balance`) runs in the same spawns
at CP = 2 and 4 against its CP = 1 result: outputs and the gradients of q, k and v at 1e-5. CP = 2 runs every case;
4 ranks run CP = 4, TP = 2 x CP = 2 (with sequence parallelism,
which the MoE layer needs), PP = 2 x CP = 2 and EP = 2 x CP = 2 (DP = 2: both replicas get the whole
batch, so the DP average is the reference again, experts included). Chunks assigned by work
(`parallel.cp_chunk_assignment: work`: the training step's per-micro-batch assignment, carried in the document layout)
run the packed cases (DSA sparse, DSA dense KL, and dense MLA with MTP and merged blocks, window positions) at CP = 2
with 4 chunks per rank in the CP = 2 spawn, DSA sparse at CP = 4 with 2 per rank and dense MLA with MTP at
TP = 2 (sequence parallel) x CP = 2 in the 4-rank spawn, each assignment checked to differ from the zigzag split. Training with ZeRO-2 over DP x CP and checkpoints
across CP sizes: tests/test_context_parallel_training.py.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import EAGER_ENV as RANK_ENV, run_ranks  # RANK_ENV: jit_fuser functions eager
from tests.parallel_helpers import global_param_names, param_meta, rank_coords, rel_err, shard_like

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "glm5-tiny.yaml"
SEQ, BATCH, VOCAB, SEED = 32, 2, 512, 4321
TOL = 1e-5
BASE = [
    f"model.vocab_size={VOCAB}", f"data.seq_length={SEQ}", "model.dsa_indexer_topk=8", "model.mtp_num_layers=0",
    "model.moe_token_dispatcher_type=allgather", "model.params_dtype=float32", "model.bf16=false",
]
SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.1", "model.dsa_indexer_use_sparse_loss=true"]
WARMUP = ["model.dsa_indexer_loss_coeff=0.1"]  # dense attention, dense KL
CASES = {
    "mla": ["model.experimental_attention_variant=null"],
    "dsa_sparse": SPARSE,
    "dsa_warmup": WARMUP,
    "gqa": ["model.multi_latent_attention=false", "model.experimental_attention_variant=null",
            "model.num_query_groups=2", "model.kv_channels=16"],
    "packed": SPARSE,  # packed documents, positions restarting per document: DSA sparse
    "packed_warmup": WARMUP,  # the same documents through dense attention and the dense KL
    "packed_gqa": ["model.multi_latent_attention=false", "model.experimental_attention_variant=null",
                   "model.num_query_groups=2", "model.kv_channels=16"],  # documents isolated, window positions
    # the default model.cp_attention=merged runs above (each rank's chunks as non-causal blocks + causal squares
    # merged by lse); here the other path: each chunk as one bottom-right causal SDPA call
    "mla_bottom_right": ["model.experimental_attention_variant=null", "model.cp_attention=bottom_right"],
    "packed_warmup_bottom_right": WARMUP + ["model.cp_attention=bottom_right"],
    "mtp": WARMUP + ["model.mtp_num_layers=2"],
    # the long-context memory features under CP: full recompute, activation offload, chunked output loss
    "memory": SPARSE + ["model.mtp_num_layers=2", "model.recompute_granularity=full", "model.recompute_method=uniform",
                        "model.recompute_num_layers=1", "model.activation_offload=true",
                        "model.output_loss_backend=chunked", "model.output_chunk_size=5"],
    # dense MLA (no DSA) on packed documents (window positions: megatron's MLA at CP = 1 takes no others) with MTP,
    # merged blocks: the chunk-assignment runs' dense case
    "packed_mla_mtp": ["model.experimental_attention_variant=null", "model.mtp_num_layers=2"],
}
LAYOUTS = {
    "cp2": ["parallel.context_parallel_size=2"],
    "cp4": ["parallel.context_parallel_size=4"],
    "tp2_cp2": ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true"],
    "pp2_cp2": ["parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
    "ep2_cp2": ["parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2"],
    # chunks assigned by work per micro-batch (`parallel.cp_load_balance`), not the zigzag split
    "cp2_work": ["parallel.context_parallel_size=2", "parallel.cp_chunk_assignment=work", "parallel.cp_chunks_per_rank=4"],
    "cp4_work": ["parallel.context_parallel_size=4", "parallel.cp_chunk_assignment=work", "parallel.cp_chunks_per_rank=2"],
    "tp2_cp2_work": ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                     "parallel.sequence_parallel=true", "parallel.cp_chunk_assignment=work",
                     "parallel.cp_chunks_per_rank=4"],
}
WORK_CASES = ("packed", "packed_warmup", "packed_mla_mtp")  # run under cp2_work in the CP = 2 spawn
RUNS_4 = [("cp4", "packed"), ("tp2_cp2", "mtp"), ("pp2_cp2", "dsa_warmup"), ("ep2_cp2", "dsa_sparse")]
WORK_RUNS_4 = [("cp4_work", "packed"), ("tp2_cp2_work", "packed_mla_mtp")]  # in the 4-rank spawn too
CORE_CHECKS = {("cp2", "mla"), ("cp4", "packed")}  # runs after which the core attention check runs on those ranks


def config(case: str, layout: str = None):
    from pretrain.config import load_config

    return load_config(TINY, BASE + CASES[case] + (LAYOUTS[layout] if layout else []))


def make_batch(case: str) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(BATCH, SEQ),
             "position_ids": torch.arange(SEQ).expand(BATCH, -1)}
    if case in ("mtp", "memory"):  # holes in the loss mask, unevenly over the chunks
        batch["loss_mask"] = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).float()
    if case.startswith("packed"):  # documents crossing chunk boundaries (chunks of 16, 8 and 4 tokens)
        batch["loss_mask"] = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).float()
        # as the data pipeline gives them (`packing.collate_batch`): offsets into the [BATCH * SEQ] stream
        starts = [[0, 5, 19, 20], [0, 11, 30]]
        batch["cu_seqlens"] = torch.tensor([row * SEQ + s for row, row_starts in enumerate(starts)
                                            for s in row_starts] + [BATCH * SEQ], dtype=torch.int32)
        if case not in ("packed_gqa", "packed_mla_mtp"):  # positions restart per document (not for GQA / MLA)
            bounds = [row_starts + [SEQ] for row_starts in starts]
            batch["position_ids"] = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])])
                                                 for b in bounds])
    return batch


# ------------------------------------------------------------------------------------------------
# rank bodies
# ------------------------------------------------------------------------------------------------


def model_step(cfg, batch: dict, ref_state: dict = None) -> dict:
    """Build this rank's model (with `ref_state`'s weights), run one micro-batch through the schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from pretrain.model.builder import build_model
    from pretrain.model.dsa import DSAMetrics, IndexerLossAutoScaler
    from pretrain.training.step import forward_step

    model = build_model(cfg)
    names = global_param_names(model)
    coords = dict(rank_coords(), num_experts=cfg.model.num_moe_experts)
    meta = {names[n]: param_meta(p) for n, p in model.named_parameters()}
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    with torch.no_grad():
        if ref_state is None:  # the reference: randomized norms and expert biases
            gen = torch.Generator().manual_seed(SEED + 1)
            for name, t in tensors.items():
                if name.endswith("norm.weight"):
                    t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
                elif name.endswith("expert_bias"):
                    t.copy_(0.05 * torch.randn(t.shape, generator=gen))
        else:
            for name, t in tensors.items():
                t.copy_(shard_like(names[name], ref_state[names[name]], param_meta(t), coords))
    state = {names[n]: t.detach().clone() for n, t in tensors.items()}
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    ddp.zero_grad_buffer()
    model.config.finalize_model_grads_func = finalize_model_grads
    IndexerLossAutoScaler.set_loss_scale(torch.ones(1))
    DSAMetrics.clear()
    get_moe_layer_wise_logging_tracker().clear()  # sized by the first model that records (layers + MTP)
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, cp_group=ps.get_context_parallel_group(),
                                  cp_chunk_assignment=cfg.parallel.cp_chunk_assignment,
                                  cp_chunks_per_rank=cfg.parallel.cp_chunks_per_rank),
        data_iterator=iter([batch]), model=ddp, num_microbatches=1,
        seq_length=SEQ, micro_batch_size=BATCH, decoder_seq_length=SEQ, forward_only=False)
    lm = torch.zeros(2, dtype=torch.float64)
    for item in losses or []:
        lm += item["lm loss"].double()
    torch.distributed.all_reduce(lm)  # every rank's (sum, count) of its own tokens; TP ranks repeat theirs
    lm /= ps.get_tensor_model_parallel_world_size()
    indexer = DSAMetrics.collect(cfg.model.num_layers + 1, pp_group=ps.get_pipeline_model_parallel_group(),
                                 dp_group=ps.get_data_parallel_group(with_context_parallel=True))
    grads = {names[n]: p.main_grad.detach().clone() if p.requires_grad else None for n, p in model.named_parameters()}
    return {"loss": (lm[0] / lm[1]).item(), "indexer": indexer, "grads": grads, "meta": meta, "coords": coords,
            "state": state, "cp": ps.get_context_parallel_world_size()}


def core_inputs(documents: bool) -> tuple:
    """(q, k, v, upstream gradient, attention_mask) of the core attention check: GQA shapes over the whole
    sequence, fp32; with `documents` the O(S) layout of documents crossing the CP=4 chunks of 4 tokens."""
    from pretrain.model.documents import document_layout

    gen = torch.Generator().manual_seed(SEED + 7)
    heads, groups, dk, dv = 4, 2, 16, 24
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((SEQ, BATCH, heads, dk), (SEQ, BATCH, groups, dk),
                                                                (SEQ, BATCH, groups, dv)))
    grad = torch.randn(SEQ, BATCH, heads * dv, generator=gen)
    layout = None
    if documents:
        starts = [[0, 5, 19, 20], [0, 11, 30]]
        cu = torch.tensor([r * SEQ + x for r, row in enumerate(starts) for x in row] + [BATCH * SEQ], dtype=torch.int32)
        layout = document_layout(cu, None, BATCH, SEQ)
    return q, k, v, grad, layout


def core_assignment(cp: int, layout):
    """The work-balanced chunk assignment (`parallel.cp_load_balance`) of the check's sequence: 4 cp chunks."""
    from parallel.cp_load_balance import balance, chunk_work

    starts = layout[:, 0] if layout is not None else torch.zeros(SEQ, dtype=torch.int64)
    return balance(chunk_work(starts, 4 * cp).tolist(), cp)


def core_attention_check(cp: int) -> dict:
    """This CP rank's output and gradients of its own q, k, v rows through `SDPACoreAttention.forward` (the gather,
    the merged blocks, the gather's reduce-scatter), and the same with the chunks assigned by work (gather, reduce-
    scatter and attention rows in that assignment); `cp` 1 is the reference, in one process."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from parallel.context_parallel import cp_size_and_rank, gather_sequence, split_sequence
    from pretrain.model.core_attention import SDPACoreAttention
    from pretrain.model.documents import attention_plan, query_blocks

    config = SimpleNamespace(cp_attention="merged", context_parallel_size=cp, attention_dropout=0.0, kv_channels=16, num_attention_heads=4,
                             experimental_attention_variant=None)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=16, v_channels=24, softmax_scale=0.25)
    size, rank = cp_size_and_rank(attn.cp_group)
    assert size == cp
    out = {}
    for documents in (False, True):
        for balanced in (False, True) if cp > 1 else (False,):
            *qkv, grad, layout = core_inputs(documents)
            assignment = core_assignment(cp, layout) if balanced else None
            q, k, v = [split_sequence(t, 0, cp, rank, assignment).clone().requires_grad_() for t in qkv]
            if assignment is None:
                result = attn(q, k, v, layout)
            else:
                keys, values = (gather_sequence(t, 0, attn.cp_group, assignment) for t in (k, v))
                if layout is not None:
                    plan = attention_plan(layout, query_blocks(q.shape[0], cp, rank, assignment=assignment))
                    result = attn.attend_documents(q, keys, values, plan)
                else:
                    result = attn.attend_cp_causal(q, keys, values, cp, rank, assignment)
            result.backward(split_sequence(grad, 0, cp, rank, assignment))
            out[(documents, balanced)] = [result.detach()] + [t.grad for t in (q, k, v)]
    return out


def rank_models(rank: int, world_size: int, runs: List[tuple], ref_states: dict) -> dict:
    """(layout, case) runs in turn on these ranks; layout None is the single-rank reference."""
    from parallel import activation_offload
    from parallel.initialize import destroy_parallel, initialize_parallel

    activation_offload.MIN_OFFLOAD_BYTES = 256  # the tiny model's activations are small
    out = {}
    try:
        for layout, case in runs:
            activation_offload.reset_activation_offload()
            cfg = config(case, layout)
            initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)
            out[(layout, case)] = model_step(cfg, make_batch(case), ref_states.get(case))
            offloader = activation_offload.process_offloader()
            out[(layout, case)]["offloaded"] = offloader.offloaded_bytes if offloader else 0
            if (layout, case) in CORE_CHECKS:
                out[(layout, case)]["core"] = core_attention_check(cfg.parallel.context_parallel_size)
        return out
    finally:
        activation_offload.reset_activation_offload()
        destroy_parallel()


def rank_gather(rank: int, world_size: int, cp: int) -> dict:
    """gather_sequence over a CP group of `cp` ranks against a naive gather and reduce."""
    import torch.distributed as dist

    from parallel.context_parallel import gather_sequence, split_sequence

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(cp)))
    full = torch.arange(2 * 4 * cp * 3, dtype=torch.float64).view(2, 4 * cp, 3)  # [b, S, d], sequence dim 1
    local = split_sequence(full, 1, cp, rank).clone().requires_grad_()
    gathered = gather_sequence(local, 1, group)
    upstream = torch.randn(gathered.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    gathered.backward(upstream)
    return {"gathered": gathered.detach(), "grad": local.grad, "upstream": upstream}


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict:
    (ref,) = run_ranks(rank_models, 1, [(None, case) for case in CASES], {}, env=RANK_ENV)
    return {case: ref[(None, case)] for case in CASES}


@pytest.fixture(scope="module")
def cp2(reference) -> dict:
    states = {case: r["state"] for case, r in reference.items()}
    runs = [("cp2", case) for case in CASES] + [("cp2_work", case) for case in WORK_CASES]
    results = run_ranks(rank_models, 2, runs, states, env=RANK_ENV)
    return {case if layout == "cp2" else (layout, case): [r[(layout, case)] for r in results] for layout, case in runs}


@pytest.fixture(scope="module")
def four_ranks(reference) -> dict:
    states = {case: reference[case]["state"] for _, case in RUNS_4}
    states.update({case: reference[case]["state"] for _, case in WORK_RUNS_4})
    results = run_ranks(rank_models, 4, RUNS_4 + WORK_RUNS_4, states, env=RANK_ENV)
    return {layout: [r[(layout, case)] for r in results] for layout, case in RUNS_4 + WORK_RUNS_4}


# ------------------------------------------------------------------------------------------------
# comparisons
# ------------------------------------------------------------------------------------------------


def indexer_scales(grads: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The largest gradient entry of each layer's DSA indexer, by the indexer's name prefix. The indexer learns from
    its own loss only: its gradients are ~1e-6 of the others' here, and its norm's bias gradient (~4e-7) is a sum
    whose terms cancel, so that tensor's own maximum is no scale for fp32 rounding (relative error 1.06e-5 measured
    on an AVX-512 CPU, 7e-7 against the indexer's largest gradient). The indexer's parameters are compared as one."""
    scales: Dict[str, float] = {}
    for name, g in grads.items():
        if g is not None and ".indexer." in name:
            prefix = name.split(".indexer.")[0]
            scales[prefix] = max(scales.get(prefix, 0.0), g.abs().max().item())
    return scales


def check_against_reference(ref: dict, ranks: List[dict]) -> float:
    failures, worst = [], 0.0
    indexers = indexer_scales(ref["grads"])
    for rank, res in enumerate(ranks):
        err = abs(res["loss"] - ref["loss"]) / abs(ref["loss"])
        if not err <= TOL:
            failures.append(f"rank {rank}: loss {res['loss']} vs {ref['loss']}")
        assert set(res["indexer"]) == set(ref["indexer"]), (sorted(res["indexer"]), sorted(ref["indexer"]))
        for key, value in ref["indexer"].items():
            if not abs(res["indexer"][key] - value) <= TOL * max(abs(value), 1e-3):
                failures.append(f"rank {rank}: {key} {res['indexer'][key]} vs {value}")
        for name, got in res["grads"].items():
            want = ref["grads"][name]
            if want is None or got is None:
                if (want is None) != (got is None):
                    failures.append(f"rank {rank} {name}: gradient on one side only")
                continue
            want = shard_like(name, want, res["meta"][name], res["coords"])
            if ".indexer." in name:
                err = (got - want).abs().max().item() / indexers[name.split(".indexer.")[0]]
            else:
                err = rel_err(got, want)
            worst = max(worst, err)
            if not err <= TOL:
                failures.append(f"rank {rank} {name}: relative max-abs error {err:.2e}")
    assert not failures, "context-parallel run differs from the single-rank run:\n" + "\n".join(failures)
    return worst


def test_split_and_positions_match_a_naive_split():
    from parallel.context_parallel import local_positions, split_batch, split_sequence

    for cp in (1, 2, 4):
        seq = 8 * cp
        x = torch.arange(3 * seq).view(3, seq)
        pieces = []
        for r in range(cp):
            chunks = [list(range(k * seq // (2 * cp), (k + 1) * seq // (2 * cp))) for k in range(2 * cp)]
            naive = chunks[r] + chunks[2 * cp - 1 - r]  # chunks r and 2cp - 1 - r
            assert local_positions(seq // cp, cp, r).tolist() == naive
            assert torch.equal(split_sequence(x, 1, cp, r), x[:, naive])
            mask = torch.rand(2, 1, seq, seq) > 0.5
            got = split_batch({"tokens": x, "attention_mask": mask, "cu_seqlens": torch.tensor([0, seq])}, cp, r)
            assert torch.equal(got["attention_mask"], mask[:, :, naive, :])  # query rows only
            assert torch.equal(got["cu_seqlens"], torch.tensor([0, seq]))
            pieces += naive
        assert sorted(pieces) == list(range(seq))  # every token on exactly one rank
    with pytest.raises(ValueError, match="multiple of 4"):
        split_sequence(torch.zeros(1, 6), 1, 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_gather_and_its_backward_match_a_naive_reference(cp):
    from parallel.context_parallel import split_sequence

    results = run_ranks(rank_gather, cp, cp)
    full = torch.arange(2 * 4 * cp * 3, dtype=torch.float64).view(2, 4 * cp, 3)
    total = sum(r["upstream"] for r in results)  # d(sum_r <upstream_r, gather>) / d gather
    for rank, r in enumerate(results):
        assert torch.equal(r["gathered"], full)
        assert torch.allclose(r["grad"], split_sequence(total, 1, cp, rank))


def test_reference_is_meaningful(reference):
    """The cases can fail: finite losses near log(vocab), trained indexers, unequal loss masks."""
    for case, ref in reference.items():
        assert math.isclose(ref["loss"], math.log(VOCAB), rel_tol=0.15), case
        trains_indexer = case not in ("mla", "mla_bottom_right", "gqa", "packed_gqa", "packed_mla_mtp")
        assert bool(ref["indexer"]) == trains_indexer, case
        indexer_grads = [g for n, g in ref["grads"].items() if ".indexer." in n]
        if trains_indexer:
            assert indexer_grads and all(g is not None and g.abs().max() > 0 for g in indexer_grads), case
        else:
            assert not indexer_grads, case  # plain MLA / GQA: no indexer at all
    assert "indexer_loss/mtp" in reference["mtp"]["indexer"]
    mask = make_batch("packed")["loss_mask"]
    assert mask[:, :8].sum() != mask[:, 8:16].sum()  # CP=2 ranks hold different numbers of loss tokens
    # the training step hands the packed cases' documents to attention (isolated; positions restart but GQA's)
    from pretrain.model.documents import attention_plan, query_blocks
    from pretrain.training.step import with_documents

    for case in ("packed", "packed_warmup", "packed_gqa"):
        plan = attention_plan(with_documents(make_batch(case))["document_layout"], query_blocks(SEQ))
        assert plan.isolated and plan.positions_reset == (case != "packed_gqa"), case
    assert reference["packed"]["loss"] != reference["dsa_sparse"]["loss"]


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_matches_single_rank(cp2, reference, case):
    assert all(r["cp"] == 2 for r in cp2[case])
    if case == "memory":  # offloading ran (and so did the other features: config validation reads them)
        assert all(r["offloaded"] > 0 for r in cp2[case]) and reference[case]["offloaded"] > 0
    worst = check_against_reference(reference[case], cp2[case])
    print(f"\nCP=2 {case}: worst relative max-abs gradient error {worst:.2e}")


@pytest.mark.parametrize("layout, case", sorted(CORE_CHECKS))
def test_core_attention_matches_cp1(request, layout, case):
    """CP = 2 and 4 against CP = 1 (plain causal SDPA, per-document SDPA calls): each rank's output rows and the
    gradients of its q, k, v rows, without and with documents, zigzag and work-balanced chunks."""
    from parallel.context_parallel import split_sequence
    from parallel.cp_load_balance import zigzag

    ranks = request.getfixturevalue("cp2")[case] if layout == "cp2" else request.getfixturevalue("four_ranks")[layout]
    cp = len(ranks)
    reference = core_attention_check(1)
    for (documents, balanced), got_ranks in ((key, [r["core"][key] for r in ranks]) for key in ranks[0]["core"]):
        want = reference[(documents, False)]
        assignment = core_assignment(cp, core_inputs(documents)[-1]) if balanced else None
        if balanced:  # the assignment is not the zigzag split (else the check would repeat the plain one)
            assert sorted(map(sorted, assignment)) != sorted(map(sorted, zigzag(cp))) and len(assignment[0]) == 4
        for rank, got in enumerate(got_ranks):
            for name, g, full in zip(("out", "dq", "dk", "dv"), got, want):
                err = rel_err(g, split_sequence(full, 0, cp, rank, assignment))
                assert err <= TOL, f"CP={cp} rank {rank} documents={documents} balanced={balanced} {name}: {err:.2e}"


@pytest.mark.parametrize("layout, case", [("cp2_work", case) for case in WORK_CASES] + WORK_RUNS_4)
def test_chunks_assigned_by_work_match_single_rank(request, reference, layout, case):
    """`parallel.cp_chunk_assignment: work`: the training step assigns each rank chunks of the packed batch by their
    causal work (not the zigzag split); split, RoPE positions, the latent and indexer-key gathers, document pieces,
    DSA top-k, MTP's shift of tokens and labels and the loss follow it: losses and every gradient equal CP = 1's."""
    from parallel.cp_load_balance import zigzag
    from pretrain.model.documents import layout_assignment
    from pretrain.training.step import with_chunk_assignment, with_documents

    cfg = config(case, layout)
    cp = cfg.parallel.context_parallel_size
    batch = with_chunk_assignment(with_documents(make_batch(case)), cp, cfg.parallel.cp_chunk_assignment,
                                  cfg.parallel.cp_chunks_per_rank)
    assignment = layout_assignment(batch["document_layout"], cp)
    assert assignment is not None and len(assignment[0]) == cfg.parallel.cp_chunks_per_rank
    if len(assignment[0]) == 2:  # as many chunks as the zigzag split: a different assignment
        assert set(assignment) != set(zigzag(cp))
    ranks = (request.getfixturevalue("cp2")[(layout, case)] if layout == "cp2_work"
             else request.getfixturevalue("four_ranks")[layout])
    assert all(r["cp"] == cp for r in ranks)
    worst = check_against_reference(reference[case], ranks)
    print(f"\n{layout} {case}: worst relative max-abs gradient error {worst:.2e}")


@pytest.mark.parametrize("layout, case", RUNS_4)
def test_four_ranks_match_single_rank(four_ranks, reference, layout, case):
    worst = check_against_reference(reference[case], four_ranks[layout])
    print(f"\n{layout} {case}: worst relative max-abs gradient error {worst:.2e}")



def test_chunk_work_counts_attended_pairs_and_balance_assigns_every_chunk_once():
    """`parallel.cp_load_balance` against a dense count: chunk work = the (query, key) pairs of the block-diagonal
    causal mask in the chunk's rows; zigzag balances one document exactly; `balance` gives every rank as many chunks,
    each chunk once, and on packed documents a lower maximum than zigzag."""
    from parallel.cp_load_balance import balance, chunk_work, imbalance, rank_work, token_work, zigzag

    gen = torch.Generator().manual_seed(SEED)
    s, cp = 64, 4
    cuts = sorted(set(torch.randint(1, s, (5,), generator=gen).tolist()))
    doc = torch.zeros(s, dtype=torch.int64)
    for c in cuts:
        doc[c:] += 1
    starts = torch.tensor([min(j for j in range(s) if doc[j] == doc[i]) for i in range(s)])
    pairs = ((doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()).sum(1)
    assert torch.equal(token_work(starts), pairs)
    assert torch.equal(token_work(starts, topk=3), pairs.clamp(max=3))
    for n in (2 * cp, 4 * cp):
        assert torch.equal(chunk_work(starts, n), pairs.view(n, -1).sum(1))
        assignment = balance(chunk_work(starts, n).tolist(), cp)
        assert sorted(k for chunks in assignment for k in chunks) == list(range(n))
        assert {len(chunks) for chunks in assignment} == {n // cp}
    work = chunk_work(starts, 8 * cp).tolist()
    zz = rank_work(chunk_work(starts, 2 * cp).tolist(), zigzag(cp))
    assert imbalance(rank_work(work, balance(work, cp))) < imbalance(zz)
    one_document = chunk_work(torch.zeros(s, dtype=torch.int64), 2 * cp).tolist()
    assert imbalance(rank_work(one_document, zigzag(cp))) == 0.0
    with pytest.raises(ValueError, match="cannot be shared equally"):
        balance([1, 2, 3], 2)


def test_work_assignment_rides_in_the_layout_and_windows_without_documents_keep_zigzag(caplog):
    """The step's assignment (`with_chunk_assignment`) is the LPT balance of the batch's chunk work, carried as the
    layout's third row (rows 0 and 1 untouched) and read back whole; batches without isolated documents, and the
    zigzag key, leave the batch as it was (the former said once in the log)."""
    import logging

    from parallel.cp_load_balance import balance, chunk_work
    from pretrain.model.documents import layout_assignment
    from pretrain.notices import forget_said
    from pretrain.training.step import with_chunk_assignment, with_documents

    batch = with_documents(make_batch("packed"))
    got = with_chunk_assignment(batch, 2, "work", 4)["document_layout"]
    assert got.shape == (BATCH, 3, SEQ) and torch.equal(got[:, :2], batch["document_layout"])
    assert layout_assignment(got, 2) == balance(chunk_work(batch["document_layout"][:, 0], 8).tolist(), 2)
    assert layout_assignment(got, 1) is None and layout_assignment(batch["document_layout"], 2) is None
    assert with_chunk_assignment(batch, 2, "zigzag", None) is batch
    forget_said()
    plain = with_documents(make_batch("mla"))
    with caplog.at_level(logging.INFO, logger="pretrain.training.step"):
        assert with_chunk_assignment(plain, 2, "work", 4) is plain
        assert with_chunk_assignment(plain, 2, "work", 4) is plain
    assert caplog.text.count("keeps the zigzag split") == 1
