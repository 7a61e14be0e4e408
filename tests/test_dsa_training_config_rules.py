"""The DSA config rules: each broken rule is refused naming its key, and the nearest valid config loads."""

from __future__ import annotations

import pytest

from tests.dsa_helpers import TINY

# ------------------------------------------------------------------------------------------------
# the DSA config rules
# ------------------------------------------------------------------------------------------------

DSA_RULES = [
    # (overrides that break a rule, the key the message names, overrides that satisfy it)
    (["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.5", "model.dsa_indexer_use_sparse_loss=false"],
     "model.dsa_indexer_use_sparse_loss",
     ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.5", "model.dsa_indexer_use_sparse_loss=true"]),
    (["model.dsa_sparse_attention=true", "model.attention_dropout=0.1"], "model.attention_dropout",
     ["model.dsa_sparse_attention=false", "model.attention_dropout=0.1"]),
    (["model.dsa_indexer_types=[full]"], "model.dsa_indexer_types", ["model.dsa_indexer_types=[full,full]"]),
    (["model.dsa_indexer_types=[full,full,full]"], "model.dsa_indexer_types",
     ["model.dsa_indexer_types=[full,shared]"]),
    (["model.dsa_indexer_types=[full,sparse]"], "model.dsa_indexer_types", ["model.dsa_indexer_types=[full,shared]"]),
    (["model.dsa_indexer_types=[shared,full]"], "model.dsa_indexer_types[0]", ["model.dsa_indexer_types=[full,full]"]),
    (["model.dsa_indexer_types=[full,shared]", "parallel.pipeline_model_parallel_size=2"], "model.dsa_indexer_types",
     ["model.dsa_indexer_types=[full,full]", "parallel.pipeline_model_parallel_size=2"]),
    (["train.trainable_params=dsa_indexer", "model.dsa_indexer_loss_coeff=0.0"], "train.trainable_params",
     ["train.trainable_params=dsa_indexer", "model.dsa_indexer_loss_coeff=1.0"]),
    (["train.trainable_params=dsa_indexer", "model.dsa_indexer_loss_coeff=1.0",
      "model.experimental_attention_variant=null"], "train.trainable_params",
     ["train.trainable_params=dsa_indexer", "model.dsa_indexer_loss_coeff=1.0"]),
    (["model.dsa_indexer_hadamard=true", "model.dsa_indexer_head_dim=12"], "model.dsa_indexer_hadamard",
     ["model.dsa_indexer_hadamard=true", "model.dsa_indexer_head_dim=16"]),
    (["model.dsa_chunk_size=0"], "model.dsa_chunk_size", ["model.dsa_chunk_size=8"]),
    (["model.dsa_chunk_size=-4"], "model.dsa_chunk_size", ["model.dsa_chunk_size=null"]),
    (["model.dsa_kernel_backend=cuda"], "model.dsa_kernel_backend", ["model.dsa_kernel_backend=triton"]),
    (["model.dsa_sparse_recompute_attention=true"], "model.dsa_sparse_recompute_attention",
     ["model.dsa_sparse_recompute_attention=true", "model.dsa_sparse_attention=true"]),
    (["model.dsa_key_partition_mib=24"], "model.dsa_key_partition_mib",
     ["model.dsa_key_partition_mib=24", "model.dsa_sparse_attention=true"]),
    (["model.dsa_key_partition_mib=-1", "model.dsa_sparse_attention=true"], "model.dsa_key_partition_mib",
     ["model.dsa_key_partition_mib=0", "model.dsa_sparse_attention=true"]),
    (["model.dsa_key_partition_mib=-0.5"], "model.dsa_key_partition_mib",
     ["model.dsa_key_partition_mib=0", "model.deterministic_mode=true"]),
    (["model.dsa_key_partition_mib=24", "model.dsa_sparse_attention=true", "model.deterministic_mode=true"],
     "model.dsa_key_partition_mib", ["model.dsa_key_partition_mib=null", "model.dsa_sparse_attention=true",
                                     "model.deterministic_mode=true"]),
    (["model.dsa_indexer_fp8=true"], "model.dsa_indexer_fp8",
     ["model.dsa_indexer_fp8=true", "model.dsa_indexer_use_sparse_loss=true", "model.dsa_indexer_loss_coeff=1.0"]),
]


@pytest.mark.parametrize("bad, key, good", DSA_RULES, ids=[f"{i}-{r[1]}" for i, r in enumerate(DSA_RULES)])
def test_dsa_config_rules(bad, key, good):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), bad)
    assert key in str(err.value)
    load_config(str(TINY), good)  # the nearest valid config loads


def test_pipeline_rule_names_the_stage_starting_layers():
    from pretrain.config import ConfigError, load_config

    types = "model.dsa_indexer_types=[full,shared,full,shared]"
    base = [types, "model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]"]
    load_config(str(TINY), [*base, "parallel.pipeline_model_parallel_size=2"])  # layers 0 and 2 start stages
    with pytest.raises(ConfigError, match=r"layers \[1, 3\]") as err:
        load_config(str(TINY), [*base, "parallel.pipeline_model_parallel_size=4"])
    assert "model.dsa_indexer_types" in str(err.value)
