"""Config validation: every rule with a message naming the key, the world-size rules, and the defaults."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError, GLM5Config, load_config, validate_config
from tests.config_helpers import GLM5, tiny

# ---------------------------------------------------------------------------------------------
# validation: every rule, each with a message naming the key
# ---------------------------------------------------------------------------------------------

PP2_VPP2 = ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
            "model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]"]
GQA = ["model.multi_latent_attention=false", "model.experimental_attention_variant=null", "model.kv_channels=16"]

BAD = [
    # (id, overrides on top of the tiny config, a key the message must name)
    ("heads%tp", ["parallel.tensor_model_parallel_size=3"], "model.num_attention_heads"),
    ("groups|heads", GQA + ["model.num_query_groups=3"], "model.num_query_groups"),
    ("groups%tp", GQA + ["model.num_query_groups=2", "parallel.tensor_model_parallel_size=4"], "model.num_query_groups"),
    ("gqa-kv_channels", GQA[:2], "model.kv_channels"),
    ("vocab%tp", ["model.vocab_size=8191", "parallel.tensor_model_parallel_size=2"], "model.vocab_size"),
    ("ffn%tp", ["model.ffn_hidden_size=130", "parallel.tensor_model_parallel_size=4"], "model.ffn_hidden_size"),
    ("moe_ffn%etp", ["model.moe_ffn_hidden_size=30", "parallel.expert_tensor_parallel_size=4"],
     "model.moe_ffn_hidden_size"),
    ("shared%tp", ["model.moe_shared_expert_intermediate_size=30", "parallel.tensor_model_parallel_size=4"],
     "model.moe_shared_expert_intermediate_size"),
    ("kv_lora", ["model.kv_lora_rank=0"], "model.kv_lora_rank"),
    ("rope-odd", ["model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim"),
    ("rope-zero", ["model.qk_pos_emb_head_dim=0"], "model.qk_pos_emb_head_dim"),
    ("qk_head_dim", ["model.qk_head_dim=0"], "model.qk_head_dim"),
    ("v_head_dim", ["model.v_head_dim=-1"], "model.v_head_dim"),
    ("q_lora", ["model.q_lora_rank=0"], "model.q_lora_rank"),
    ("dsa-head-dim", ["model.dsa_indexer_head_dim=4"], "model.dsa_indexer_head_dim"),
    ("dsa-variant", ["model.experimental_attention_variant=gated_delta_net"], "model.experimental_attention_variant"),
    ("dsa-needs-mla", ["model.multi_latent_attention=false", "model.kv_channels=16"], "model.multi_latent_attention"),
    ("dsa-needs-q-lora", ["model.q_lora_rank=null"], "model.q_lora_rank"),
    ("cp-seq", ["parallel.context_parallel_size=3"], "data.seq_length (128) must be divisible by 2 x parallel"),
    ("cp-mla-without-q-lora", ["model.experimental_attention_variant=null", "model.q_lora_rank=null",
                               "parallel.context_parallel_size=2"], "parallel.context_parallel_size > 1 with MLA"),
    ("cp-sp-seq", ["data.seq_length=12", "parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=4",
                   "parallel.sequence_parallel=true"], "data.seq_length / parallel.context_parallel_size"),
    ("cp-work-seq", ["parallel.context_parallel_size=2", "parallel.cp_chunk_assignment=work",
                     "parallel.cp_chunks_per_rank=3"], "data.seq_length (128) must be divisible by parallel.context_"
                                                       "parallel_size x parallel.cp_chunks_per_rank (6)"),
    ("cp-work-gqa", GQA + ["model.num_query_groups=2", "parallel.context_parallel_size=2",
                           "parallel.cp_chunk_assignment=work"], "parallel.cp_chunk_assignment=work needs MLA"),
    ("cp-chunks-zigzag", ["parallel.cp_chunks_per_rank=4"],
     "parallel.cp_chunks_per_rank=4 needs parallel.cp_chunk_assignment=work"),
    ("cp-chunks-zero", ["parallel.cp_chunk_assignment=work", "parallel.cp_chunks_per_rank=0"],
     "parallel.cp_chunks_per_rank (0) must be at least 1"),
    ("cp-chunk-assignment", ["parallel.cp_chunk_assignment=lpt"], "set it to one of: zigzag, work"),
    ("experts%ep", ["model.num_moe_experts=6", "parallel.expert_model_parallel_size=4"], "model.num_moe_experts"),
    ("topk>experts", ["model.moe_router_topk=9"], "model.moe_router_topk"),
    ("freq-length", ["model.moe_layer_freq=[0,1,1]"], "model.moe_layer_freq"),
    ("freq-values", ["model.moe_layer_freq=[0,2]"], "model.moe_layer_freq"),
    ("freq-zero", ["model.moe_layer_freq=0"], "model.moe_layer_freq"),
    ("moe-needs-ffn", ["model.moe_ffn_hidden_size=null"], "model.moe_ffn_hidden_size"),
    ("ep-needs-moe", ["model.num_moe_experts=null", "parallel.expert_model_parallel_size=2"],
     "parallel.expert_model_parallel_size"),
    ("group-routing", ["model.moe_router_num_groups=3"], "model.moe_router_num_groups"),
    ("rope_type", ["model.rope_type=ntk"], "model.rope_type"),
    ("normalization", ["model.normalization=ScaleNorm"], "model.normalization"),
    ("transformer_impl", ["model.transformer_impl=te"], "model.transformer_impl"),
    ("dispatcher", ["model.moe_token_dispatcher_type=flex"], "model.moe_token_dispatcher_type"),
    ("score_fn", ["model.moe_router_score_function=relu"], "model.moe_router_score_function"),
    ("optimizer", ["optimizer.optimizer=sgd"], "optimizer.optimizer"),
    ("decay_style", ["optimizer.lr_decay_style=wsd"], "optimizer.lr_decay_style"),
    ("wandb_mode", ["logging.wandb_mode=cloud"], "logging.wandb_mode"),
    ("params_dtype", ["model.params_dtype=float16"], "model.params_dtype"),
    ("num_layers", ["model.num_layers=0"], "model.num_layers"),
    ("hidden", ["model.hidden_size=0"], "model.hidden_size"),
    ("heads", ["model.num_attention_heads=0"], "model.num_attention_heads"),
    ("mtp", ["model.mtp_num_layers=-1"], "model.mtp_num_layers"),
    ("seq>maxpos", ["data.seq_length=8192"], "data.seq_length"),
    ("micro", ["train.micro_batch_size=0"], "train.micro_batch_size"),
    ("global%micro", ["train.global_batch_size=10"], "train.global_batch_size"),
    ("sp-needs-tp", ["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    ("moe-tp-needs-sp", ["parallel.tensor_model_parallel_size=2"], "parallel.sequence_parallel=true"),
    ("layers%pp", ["parallel.pipeline_model_parallel_size=3"], "parallel.pipeline_model_parallel_size"),
    ("min_lr>lr", ["optimizer.min_lr=1.0"], "optimizer.min_lr"),
    ("warmup>=decay", ["optimizer.lr_warmup_iters=300"], "optimizer.lr_warmup_iters"),
    ("split", ["data.split=a,b"], "data.split"),
    ("zero2-reduce-needs-muon-zero2", ["optimizer.optimizer=muon", "optimizer.zero2_grad_reduce=step"],
     "optimizer.zero2_grad_reduce='step' applies to Muon's ZeRO-2 only"),
    ("zero2-reduce-adam", ["optimizer.optimizer=adam", "optimizer.use_distributed_optimizer=true",
                           "optimizer.zero2_grad_reduce=microbatch_scatter"], "optimizer.zero2_grad_reduce"),
    ("copy-engine-needs-muon-zero2", ["optimizer.zero2_reduce_transport=copy_engine"],
     "optimizer.zero2_reduce_transport='copy_engine' applies to Muon's ZeRO-2"),
    ("copy-engine-not-scatter", ["optimizer.optimizer=muon", "optimizer.use_distributed_optimizer=true",
                                 "optimizer.zero2_grad_reduce=microbatch_scatter",
                                 "optimizer.zero2_reduce_transport=copy_engine"], "optimizer.zero2_reduce_transport"),
    ("dataset-threads", ["data.num_dataset_builder_threads=0"], "data.num_dataset_builder_threads"),
    ("bucket-size", ["parallel.bucket_size=0"], "parallel.bucket_size is 0; it must be > 0 (or null)"),
    ("doc-mask", ["data.reset_attention_mask=true", "data.create_attention_mask=true"], "data.create_attention_mask"),
    ("doc-positions-gqa", ["data.reset_position_ids=true", "model.multi_latent_attention=false",
                           "model.experimental_attention_variant=null", "model.num_query_groups=2",
                           "model.kv_channels=16"], "data.reset_position_ids"),
    ("doc-positions-mla", ["data.reset_position_ids=true", "model.experimental_attention_variant=null"],
     "data.reset_position_ids"),
    ("profile", ["logging.profile_step_start=5"], "logging.profile_step_end"),
    ("vpp-needs-pp", ["parallel.virtual_pipeline_model_parallel_size=2"],
     "parallel.virtual_pipeline_model_parallel_size"),
    ("pageable-async", ["checkpoint.pinned_staging=false", "checkpoint.async_save=true"], "checkpoint.pinned_staging"),
    ("group-needs-vpp", ["parallel.microbatch_group_size_per_vp_stage=4"],
     "parallel.microbatch_group_size_per_vp_stage"),
]


@pytest.mark.parametrize("overrides, key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_rule(overrides, key):
    with pytest.raises(ConfigError) as e:
        tiny(*overrides)
    assert key in str(e.value)


def test_cp_work_assignment_validates_and_says_when_it_cannot_help(caplog):
    """parallel.cp_chunk_assignment=work: a valid key for MLA / DSA at CP > 1; without isolated documents
    (data.reset_attention_mask=false) the log says once that the zigzag split stays."""
    import logging

    from pretrain.notices import forget_said

    forget_said()
    with caplog.at_level(logging.INFO, logger="pretrain.config"):
        for extra in ([], ["data.reset_attention_mask=true"]):
            cfg = tiny("parallel.context_parallel_size=2", "parallel.cp_chunk_assignment=work", *extra)
            validate_config(cfg, world_size=2)
    assert (cfg.parallel.cp_chunk_assignment, cfg.parallel.cp_chunks_per_rank) == ("work", None)
    assert caplog.text.count("without data.reset_attention_mask") == 1


def test_choice_error_lists_the_options():
    with pytest.raises(ConfigError, match="set it to one of: rope, yarn"):
        tiny("model.rope_type=ntk")


@pytest.mark.parametrize(
    "world_size, overrides, key",
    [
        (3, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
         "parallel.tensor_model_parallel_size"),
        (4, [], "train.global_batch_size"),  # DP 4: 8 % (4 x 4) != 0
        (4, ["parallel.expert_model_parallel_size=8"], "parallel.expert_model_parallel_size"),
        (8, ["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=8"],
         "parallel.expert_model_parallel_size"),  # 8 / PP 2 = 4 ranks per stage < EP 8
        (2, ["parallel.context_parallel_size=4"], "parallel.context_parallel_size (4) is larger than the world"),
        # 32 / 4 = 8 micro-batches per step at DP 1: a group of 9 is more than there are, 1 < PP, 7 leaves a last
        # group of 1 < PP (3 and 6 leave 2: fine, below)
        *[(2, PP2_VPP2 + ["train.global_batch_size=32", f"parallel.microbatch_group_size_per_vp_stage={g}"],
           "parallel.microbatch_group_size_per_vp_stage") for g in (1, 7, 9)],
    ],
)
def test_world_size_rules(world_size, overrides, key):
    cfg = tiny(*overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=world_size)
    assert key in str(e.value)


def test_world_size_ok():
    for group in (2, 3, 4, 6, 8):
        grouped = tiny(*PP2_VPP2, "train.global_batch_size=32", f"parallel.microbatch_group_size_per_vp_stage={group}")
        validate_config(grouped, world_size=2)
    validate_config(tiny(), world_size=1)
    validate_config(tiny(), world_size=2)  # DP 2: 8 % (4 x 2) == 0
    validate_config(load_config(GLM5), world_size=1536)  # TP 8 x PP 6 x DP 32, EP 32


def test_defaults_validate():
    validate_config(GLM5Config())


def test_copy_engine_transport_needs_gpus_and_data_parallel_groups_inside_one_node(monkeypatch):
    """Refused before any process group: without GPUs, and where a pipeline stage's tp x cp x dp ranks (consecutive
    in megatron's rank order) cross a node; accepted where they fit in one."""
    from pretrain.training.preflight import check_copy_engine_transport

    ce = ["optimizer.optimizer=muon", "optimizer.use_distributed_optimizer=true",
          "optimizer.zero2_reduce_transport=copy_engine"]
    cfg = tiny(*ce)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="copy_engine needs GPUs"):
        check_copy_engine_transport(cfg, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="stage's 4 ranks .* inside one node of 2"):
        check_copy_engine_transport(cfg, 4)
    check_copy_engine_transport(cfg, 2)
    pp2 = tiny(*ce, "parallel.pipeline_model_parallel_size=2")
    check_copy_engine_transport(pp2, 4)  # two stages of 2 ranks, each inside a node of 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="stage's 12 ranks"):
        check_copy_engine_transport(cfg, 12)
