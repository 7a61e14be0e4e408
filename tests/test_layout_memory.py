"""The layout planner's memory terms against counted references (pretrain/layout/memory.py, docs/layout.md).

- Parameters per pipeline rank: the builder's meta-device model under TP / PP / VPP / EP / ETP splits, each
  rank built in this one process over a fake process group of the layout's world size (no memory, no
  ranks spawned), against `memory.rank_parameters` (total, routed-expert share, Muon/AdamW split by shape).
- Activations: every storage autograd saves during a CPU forward of small MoE + DSA + MTP models
  (`SavedTensors`), at two sizes, under selective and full recompute, with dense attention, the DSA warm-up
  (indexer KL) and sparse DSA, against the activation model (single rank: CP and TP shards are not counted).
"""

from __future__ import annotations

import pytest
import torch

from pretrain.config import load_config
from pretrain.layout.activations import layer_terms
from pretrain.layout.memory import head_terms, rank_parameters, state_terms
from pretrain.layout.types import Layout, ModelDims, Workload

TINY = "configs/models/glm5-tiny.yaml"
# glm5-tiny at 4 layers (1 dense, 3 MoE): every piece of GLM-5, enough layers for PP 2 x VPP 2
FOUR_LAYERS = ["model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]"]


def _fake_world(world: int, rank: int, parallel) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # a process group an earlier test of this pytest process left behind
        from parallel.initialize import destroy_parallel

        destroy_parallel()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        create_gloo_process_groups=False,
    )


def counted_rank_parameters(cfg, world: int, rank: int):
    """(pipeline rank, {total, expert, muon}) of the model chunks global rank `rank` builds."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pretrain import compat
    from pretrain.model.builder import build_model_chunks

    compat.install()
    _fake_world(world, rank, cfg.parallel)
    try:
        with torch.device("meta"):
            chunks = build_model_chunks(cfg)
        counts = {"total": 0, "expert": 0, "muon": 0}
        for chunk in chunks:
            tensors = list(chunk.named_parameters())
            tensors += [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
            for name, t in tensors:
                counts["total"] += t.numel()
                counts["expert"] += t.numel() if ".experts." in name else 0
                # Muon takes the matrices but the embedding, the output layer and the router (muon_router: adamw)
                matrix = t.dim() == 2 and not any(k in name for k in ("embedding", "output_layer", "router"))
                counts["muon"] += t.numel() if matrix else 0
        return ps.get_pipeline_model_parallel_rank(), counts
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


SPLITS = {  # name: (overrides, world size)
    "tp2 sp": (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], 2),
    "pp2 ep2": (["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"], 4),
    "tp2 pp2 vpp2 ep4": (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                          "parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
                          "parallel.expert_model_parallel_size=4"], 8),
    "ep2 etp2": (["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2",
                  "model.mtp_use_repeated_layer=false"], 4),
    # uneven stages from megatron's layout string: 1 + 3 layers, then MTP alone before an L-only last stage
    "pp2 layout": (["parallel.pipeline_model_parallel_size=2", "parallel.pipeline_model_parallel_layout=Et|tttmmmL"], 2),
    "pp3 layout mtp before L": (["parallel.pipeline_model_parallel_size=3",
                                 "parallel.pipeline_model_parallel_layout=Ett|ttmmm|L"], 3),
}


def _layout(cfg, world: int) -> Layout:
    p = cfg.parallel
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size or 1, ep=p.expert_model_parallel_size,
                  etp=p.expert_tensor_parallel_size, cp=p.context_parallel_size,
                  dp=world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size),
                  sequence_parallel=p.sequence_parallel, pipeline_layout=p.pipeline_model_parallel_layout)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_parameters_per_rank_match_the_built_model(split):
    overrides, world = SPLITS[split]
    cfg = load_config(TINY, FOUR_LAYERS + overrides)
    dims, layout = ModelDims.from_config(cfg), _layout(cfg, world)
    seen = set()
    # the first and the last pipeline rank; every rank of an uneven layout (one rank per stage there)
    for rank in range(world) if layout.pipeline_layout else (0, world - 1):
        pp_rank, counted = counted_rank_parameters(cfg, world, rank)
        shards = rank_parameters(dims, layout, pp_rank)
        model = {"total": sum(s.elements for s in shards),
                 "expert": sum(s.elements for s in shards if s.group == "expert"),
                 "muon": sum(s.elements for s in shards if s.optimizer == "muon")}
        assert model == counted, (split, pp_rank, model, counted)
        seen.add(pp_rank)
    assert seen == (set(range(layout.pp)) if layout.pipeline_layout else {0, layout.pp - 1})


def test_whole_model_and_744b_counts():
    """Unsplit, the per-piece counts add up to the builder's total (summary.count_parameters) and to the
    published 744B (743,911,218,432 without MTP)."""
    from pretrain.model.summary import count_parameters

    cfg = load_config(TINY, FOUR_LAYERS)
    counts = count_parameters(cfg)
    assert ModelDims.from_config(cfg).total_params == sum(counts["main"].values()) + sum(counts["mtp"].values())
    dims = ModelDims.from_config(load_config("configs/models/glm5-744b.yaml"))
    assert dims.total_params - dims.mtp_layer_params == 743_911_218_432
    assert sum(s.elements for s in rank_parameters(dims, Layout(), 0)) == dims.total_params


def test_state_bytes_follow_the_optimizer_and_sharding():
    """Hand-computed: 1,000 Muon and 100 AdamW elements, DP 4: DDP keeps everything whole, ZeRO-2 shards
    main weights, gradients and state (Muon 1 fp32, AdamW 2 fp32 per element)."""
    from pretrain.layout.memory import ZERO2_BUCKET_ELEMENTS, ZERO2_BUCKETS_IN_FLIGHT, ParamShard

    shards = [ParamShard(1000, "muon", "dense", 500), ParamShard(100, "adamw", "dense", 100)]
    ddp = state_terms(shards, Layout(dp=4, zero="ddp"))
    assert ddp == {"weights": 2200, "main_weights": 4400, "gradients": 4400, "optimizer_state": 4800}
    z = state_terms(shards, Layout(dp=4, zero="zero2"))
    assert (z["main_weights"], z["gradients"], z["optimizer_state"]) == (1100, 1100, 1200)
    assert z["zero2_ownership_slack"] == (500 - 1100 / 4) * 16  # the 500-element tensor beyond a 275 share
    step = state_terms(shards, Layout(dp=4, zero="zero2", zero2_grad_reduce="step"))
    assert step["gradients"] == 4400 and "gradient_buckets" not in step
    assert z["gradient_buckets"] == 4 * ZERO2_BUCKET_ELEMENTS * ZERO2_BUCKETS_IN_FLIGHT
    adam = state_terms(shards, Layout(dp=4, zero="zero2", optimizer="adam"))  # megatron's distributed optimizer
    assert (adam["gradients"], adam["optimizer_state"]) == (4400, 1100 * 8 / 4)


# ------------------------------------------------------------------------------------------------
# activations
# ------------------------------------------------------------------------------------------------

SIZES = [  # (overrides, micro-batch, seq): two shapes whose every width differs
    (["model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=1000"], 2, 32),
    (["model.hidden_size=96", "model.num_attention_heads=6", "model.vocab_size=1500", "model.ffn_hidden_size=160",
      "model.moe_ffn_hidden_size=48", "model.kv_lora_rank=24", "model.q_lora_rank=40"], 1, 96),
]
RECOMPUTE = {"none": [], "selective": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe]"],
             "full": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                      "model.recompute_num_layers=1"]}
DSA = {"dense": [],  # pretraining: dense attention, the indexer carried untrained
       "warm-up": ["model.dsa_indexer_loss_coeff=0.01"],  # dense attention, the indexer's dense KL
       "sparse": ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.01",
                  "model.dsa_indexer_use_sparse_loss=true"]}
CASES = [("dense", "none"), ("dense", "selective"), ("dense", "full"), ("warm-up", "none"), ("sparse", "selective")]
# Largest relative error over these cases when the test was written: 0.06% (the main head's labels and a few
# scalars are not modeled); the bound sits a few times above it, well below any one term's share.
ACTIVATION_TOLERANCE = 0.002


def saved_bytes(cfg, b: int, s: int, monkeypatch) -> int:
    """Bytes of the unique storages autograd holds after one training forward of `cfg` on CPU (flash SDPA, as on GPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import pretrain.model.core_attention as core_attention
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain import compat
    from pretrain.model.builder import build_model
    from pretrain.training.saved_activations import SavedTensors

    compat.install()
    # megatron's fused activations are torch.compile'd (jit_fuser); a compiled function that an earlier test ran
    # under a dispatch mode (FlopCounterMode in test_flops) falls back to eager, which saves more than the fused
    # graph the model describes: start from a fresh compile cache
    torch._dynamo.reset()
    monkeypatch.setattr(core_attention, "sdpa_kernel",
                        lambda backends, set_priority=False: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
    # megatron's MoE loss tracker is process-wide and sized by the first model that records (its layers + MTP): a
    # deeper model of an earlier test in this process would index past it
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    initialize_parallel(cfg.parallel, seed=7)
    try:
        model = build_model(cfg)
        ids = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(s))
        with SavedTensors(exclude=list(model.parameters()), sites=False) as saved:
            loss = model(ids[:, :-1], torch.arange(s)[None].expand(b, s), None, labels=ids[:, 1:])
        total = saved.total_bytes
        del loss  # the graph and what it saved go with it (no backward needed)
        return total
    finally:
        destroy_parallel()


def modeled_saved_bytes(cfg, b: int, s: int, recompute: str) -> float:
    dims = ModelDims.from_config(cfg)
    layout, work = Layout(micro_batch_size=b, recompute=recompute, output_loss_backend="unfused"), Workload(s, b)
    layers = sum(sum(layer_terms(dims, layout, work, i, 4, recompute).values()) for i in range(dims.num_layers))
    head = head_terms(dims, layout, work, 4)
    return layers + head["final_norm"] + head["loss_inputs"] + head.get("mtp", 0.0) + head["output_logits_saved"]


@pytest.mark.parametrize("attention,recompute", CASES)
def test_activation_model_matches_saved_tensors(attention, recompute, monkeypatch):
    errors = []
    for overrides, b, s in SIZES:
        cfg = load_config(TINY, FOUR_LAYERS + overrides + RECOMPUTE[recompute] + DSA[attention]
                          + [f"data.seq_length={s}", "model.dsa_indexer_topk=16"])
        counted, modeled = saved_bytes(cfg, b, s, monkeypatch), modeled_saved_bytes(cfg, b, s, recompute)
        errors.append((modeled - counted) / counted)
    assert max(abs(e) for e in errors) <= ACTIVATION_TOLERANCE, (attention, recompute, errors)


def test_save_copies_are_what_megatrons_checkpoint_factories_copy():
    """`memory.save_copies_terms` against the bytes megatron-core's save actually copies: glm5-tiny built on CPU (fp32
    weights, one Muon momentum per matrix), its sharded state with one optimizer entry per parameter made as
    megatron's optimizers make them (`make_sharded_optimizer_tensor`), the factories applied as a save applies them,
    and every tensor counted whose storage is no parameter's or optimizer tensor's."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory, apply_factories
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    import torch.distributed as dist

    from pretrain import compat
    from pretrain.layout.memory import save_copies_terms
    from pretrain.model.builder import build_model_chunks
    from pretrain.training.checkpoint_state import model_sharded_state

    cfg = load_config(TINY, FOUR_LAYERS)
    compat.install()
    _fake_world(1, 0, cfg.parallel)
    try:
        chunks = build_model_chunks(cfg)
        state = model_sharded_state(chunks)
        owned = {t.untyped_storage().data_ptr() for c in chunks for t in c.parameters()}
        buffers = {t.untyped_storage().data_ptr() for c in chunks for t in c.buffers()}  # the routers' expert bias
        # the parameters' entries (not buffers, not objects): the optimizer keeps state for these
        model_entries = [v for v in nested_values(state) if isinstance(v, ShardedBase) and torch.is_tensor(v.data)
                         and v.data.untyped_storage().data_ptr() in owned]
        momenta = {id(e): torch.zeros_like(e.data) for e in model_entries}
        state["optimizer"] = [make_sharded_optimizer_tensor(e, momenta[id(e)], "optimizer.state.momentum")
                              for e in model_entries]
        assert any(isinstance(e, ShardedTensorFactory) for e in model_entries)  # the grouped experts' factories
        owned |= buffers | {t.untyped_storage().data_ptr() for t in momenta.values()}
        apply_factories(state)
        copied = sum(v.data.numel() * v.data.element_size() for v in nested_values(state) if isinstance(v, ShardedBase)
                     and torch.is_tensor(v.data) and v.data.untyped_storage().data_ptr() not in owned)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    dims = ModelDims.from_config(cfg)
    layout = Layout(optimizer="muon", zero="ddp")
    predicted = sum(save_copies_terms(rank_parameters(dims, layout, 0), layout, bf16=False).values())
    assert copied > 0 and predicted == copied, (predicted, copied)

