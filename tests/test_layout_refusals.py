"""Parallel layouts refused at config time with one line naming the keys (pretrain/config/cross_checks.py).

Rules added beside tests/test_config_validation.py's: the per-rank EP dispatch with expert tensor parallelism, and
interleaved pipeline stages whose micro-batches per step do not fill groups of PP (megatron's interleaved schedule
raises on that only once training starts).
"""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, validate_config
from tests.config_helpers import tiny

VPP = ["model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]", "parallel.pipeline_model_parallel_size=2",
       "parallel.virtual_pipeline_model_parallel_size=2", "train.micro_batch_size=1"]


def refused(cfg_or_overrides, world_size=None) -> str:
    with pytest.raises(ConfigError) as e:
        if world_size is None:
            tiny(*cfg_or_overrides)
        else:
            validate_config(cfg_or_overrides, world_size=world_size)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_vpp_needs_microbatches_in_groups_of_pp():
    # world 2 = PP 2 x DP 1: 3 micro-batches per step, not a multiple of PP 2
    message = refused(tiny(*VPP, "train.global_batch_size=3"), world_size=2)
    assert "parallel.virtual_pipeline_model_parallel_size" in message and "train.global_batch_size" in message
    validate_config(tiny(*VPP, "train.global_batch_size=4"), world_size=2)
    validate_config(tiny(*VPP[:-2], "train.micro_batch_size=1", "train.global_batch_size=3"), world_size=2)  # no VPP


def test_dedup_dispatch_needs_expert_tp_1():
    message = refused(["model.moe_token_dispatcher_type=alltoall_dedup", "parallel.expert_tensor_parallel_size=2"])
    assert "model.moe_token_dispatcher_type" in message and "parallel.expert_tensor_parallel_size" in message
    tiny("model.moe_token_dispatcher_type=alltoall_dedup", "parallel.expert_model_parallel_size=2")
