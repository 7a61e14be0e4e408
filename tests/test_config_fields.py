"""The rules that sit on config fields (schema.py): `Literal` choices, one-line docstrings, and the
one-field rules (context parallelism accepted for every attention variant; the torch-native backend by default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pretrain.ablate.sweep import is_sweep_file
from pretrain.config import SECTIONS, ConfigError, GLM5Config, load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "glm5-tiny.yaml"


def tiny(*overrides: str) -> GLM5Config:
    return load_config(TINY, list(overrides))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.transformer_impl=auto", "model.transformer_impl is 'auto' (in override 'model.transformer_impl=auto'); "
                                        "set it to one of: local, transformer_engine"),
        ("model.moe_router_dtype=bf16", "model.moe_router_dtype is 'bf16' (in override 'model.moe_router_dtype=bf16'); "
                                        "set it to one of: fp32, fp64, null"),
        ("model.experimental_attention_variant=nsa", "model.experimental_attention_variant is 'nsa' (in override "
                                                     "'model.experimental_attention_variant=nsa'); set it to one of: dsa, null"),
        ("model.dsa_indexer_types=[full,half]", "model.dsa_indexer_types[1] is 'half' (in override "
                                                "'model.dsa_indexer_types=[full,half]'); set it to one of: full, shared"),
        ("optimizer.muon_router=1", "optimizer.muon_router is 1 (in override 'optimizer.muon_router=1'); "
                                    "set it to one of: adamw, muon"),
    ],
)
def test_literal_error_is_one_line_naming_key_source_and_choices(override, expected):
    with pytest.raises(ConfigError) as e:
        tiny(override)
    assert str(e.value) == expected


def test_literal_rules_hold_for_configs_built_in_python():
    """validate_config checks the same Literal types as the loader (no second list of choices)."""
    from pretrain.config import ModelConfig, OptimizerConfig

    with pytest.raises(ConfigError, match=r"model.normalization is 'ScaleNorm' \(in the config object\); "
                                          "set it to one of: RMSNorm, LayerNorm"):
        validate_config(GLM5Config(model=ModelConfig(normalization="ScaleNorm")))
    with pytest.raises(ConfigError, match="optimizer.lr_decay_style is 'wsd'"):
        validate_config(GLM5Config(optimizer=OptimizerConfig(lr_decay_style="wsd")))


def test_every_literal_field_has_the_choices_its_docstring_or_megatron_names():
    """The choices written on the fields, spelled out (an independent copy of what users may write)."""
    import typing

    expected = {
        "model.normalization": {"RMSNorm", "LayerNorm"},
        "model.rope_type": {"rope", "yarn"},
        "model.transformer_impl": {"local", "transformer_engine"},
        "model.moe_token_dispatcher_type": {"auto", "allgather", "alltoall", "alltoall_dedup"},
        "model.moe_router_score_function": {"sigmoid", "softmax"},
        "model.moe_router_load_balancing_type": {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"},
        "model.moe_router_dtype": {"fp32", "fp64", None},
        "model.experimental_attention_variant": {"dsa", None},
        "model.dsa_indexer_types": {"full", "shared", None},
        "model.dsa_kernel_backend": {"auto", "triton", "reference"},
        "model.params_dtype": {"float32", "bfloat16"},
        "model.recompute_granularity": {"full", "selective", None},
        "model.recompute_method": {"uniform", "block", None},
        "model.recompute_modules": {"core_attn", "mlp", "moe", "shared_experts", "layernorm", None},
        "model.cp_attention": {"bottom_right", "merged"},
        "model.output_loss_backend": {"unfused", "chunked", "liger"},
        "model.activation_offload_backend": {"torch", "deepspeed"},
        "train.trainable_params": {"all", "dsa_indexer"},
        "parallel.cp_chunk_assignment": {"zigzag", "work"},
        "optimizer.optimizer": {"adam", "muon"},
        "optimizer.muon_ns_dtype": {"bfloat16", "float32"},
        "optimizer.zero2_grad_reduce": {"microbatch", "step", "microbatch_scatter"},
        "optimizer.zero2_reduce_transport": {"nccl", "copy_engine"},
        "optimizer.muon_router": {"adamw", "muon"},
        "optimizer.muon_indexer": {"adamw", "muon"},
        "optimizer.lr_decay_style": {"constant", "linear", "cosine"},
        "logging.wandb_mode": {"offline", "online", "disabled"},
    }

    def literal_values(tp):
        if typing.get_origin(tp) is typing.Literal:
            return set(typing.get_args(tp))
        values = set()
        for arm in typing.get_args(tp):
            values |= {None} if arm is type(None) else literal_values(arm)
        return values

    found = {}
    for section, cls in SECTIONS.items():
        for key, tp in typing.get_type_hints(cls).items():
            values = literal_values(tp)
            if values - {None}:
                found[f"{section}.{key}"] = values
    assert found == expected


def test_every_field_has_a_one_line_docstring():
    import ast
    import inspect

    from pretrain.config.field_docs import field_docs, reference

    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        fields = [f.name for f in dataclasses.fields(cls)]
        assert sorted(docs) == sorted(fields), f"{name}: fields without a docstring: {set(fields) - set(docs)}"
        for key, doc in docs.items():
            assert doc and "\n" not in doc and len(doc) <= 120, f"{name}.{key}: {doc!r}"
        # independent reading: the first string line after the field's line, with no other field between
        lines = [line.strip() for line in inspect.getsource(cls).splitlines()]
        starts = tuple(f"{f}:" for f in fields)
        for key in fields:
            i = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
            j = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('"""'))
            assert not any(line.startswith(starts) for line in lines[i + 1:j]), f"{name}.{key} has no docstring"
            assert ast.literal_eval(lines[j]) == docs[key], key
    assert "parallel:\n  tensor_model_parallel_size: 1  # int" in reference()


@pytest.mark.parametrize("extra", [[], ["model.experimental_attention_variant=null"],
                                   ["model.multi_latent_attention=false", "model.experimental_attention_variant=null",
                                    "model.num_query_groups=2", "model.kv_channels=16"]], ids=["dsa", "mla", "gqa"])
def test_context_parallelism_passes_validation(extra):
    """CP = 2 is a valid layout for each attention variant (it used to be refused)."""
    cfg = tiny(*extra, "parallel.context_parallel_size=2")
    validate_config(cfg, world_size=2)
    assert cfg.parallel.context_parallel_size == 2


def test_shipped_configs_use_the_torch_native_backend():
    # configs/curriculum/ holds plans, configs/nccl/ NCCL options, and sweep files are sweeps: tests/test_curriculum.py,
    # tests/test_nccl_options.py, tests/test_ablate.py
    shipped = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not {"curriculum", "nccl"} & set(p.parts)
                     and not is_sweep_file(p))
    assert len(shipped) > 10
    for path in shipped:
        assert load_config(path).model.transformer_impl == "local", path.name
