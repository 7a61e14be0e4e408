"""Config loading, overrides, type checks, validation rules, shipped YAMLs and moe_layer_pattern."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from pretrain.ablate.sweep import is_sweep_file
from pretrain.config import (
    SECTIONS,
    ConfigError,
    GLM5Config,
    config_from_dict,
    config_to_dict,
    load_config,
    moe_layer_pattern,
    parse_moe_layer_freq,
    save_config,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
ABLATIONS = ROOT / "configs" / "ablations"
TINY = MODELS / "glm5-tiny.yaml"
PROXY = MODELS / "glm5-proxy.yaml"
GLM5 = MODELS / "glm5-744b.yaml"
# Sweep files (configs/ablations/*.yaml with `variants`) are checked by tests/test_ablate.py.
SHIPPED = sorted(MODELS.glob("*.yaml")) + [p for p in sorted(ABLATIONS.glob("*.yaml")) if not is_sweep_file(p)]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def tiny(*overrides: str) -> GLM5Config:
    return load_config(TINY, list(overrides))


# ---------------------------------------------------------------------------------------------
# base chains
# ---------------------------------------------------------------------------------------------


def test_base_chain_merges_child_over_base(tmp_path):
    write(tmp_path / "root.yaml", "model:\n  num_layers: 4\n  moe_layer_freq: 1\n  hidden_size: 32\n"
                                  "data:\n  data_path: [a, b]\n")
    write(tmp_path / "sub" / "mid.yaml", "base: ../root.yaml\nmodel:\n  hidden_size: 48\ntrain:\n  train_iters: 7\n")
    leaf = write(tmp_path / "sub" / "leaf.yaml", "base: mid.yaml\nmodel:\n  num_attention_heads: 2\n"
                                                 "data:\n  data_path: [c]\n")
    cfg = load_config(leaf)
    assert cfg.model.num_layers == 4  # from root
    assert cfg.model.hidden_size == 48  # mid overrides root
    assert cfg.model.num_attention_heads == 2  # leaf
    assert cfg.train.train_iters == 7
    assert cfg.data.data_path == ["c"]  # lists are replaced, not concatenated
    assert cfg.model.ffn_hidden_size == GLM5Config().model.ffn_hidden_size  # untouched keys keep defaults


@pytest.mark.parametrize("self_cycle", [False, True])
def test_base_cycle_is_detected(tmp_path, self_cycle):
    if self_cycle:
        a = write(tmp_path / "a.yaml", "base: a.yaml\n")
    else:
        a = write(tmp_path / "a.yaml", "base: b.yaml\n")
        write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle") as e:
        load_config(a)
    assert "a.yaml" in str(e.value)


def test_missing_base_names_the_child(tmp_path):
    a = write(tmp_path / "a.yaml", "base: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"not found: .*nope\.yaml \(the base of .*a\.yaml\)"):
        load_config(a)


def test_yaml_syntax_error_names_the_file(tmp_path):
    a = write(tmp_path / "broken.yaml", "model:\n  num_layers: [1,\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(a)


# ---------------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------------


def test_overrides_scalars_lists_null_and_megatron_string():
    cfg = tiny(
        "model.num_layers=4",
        "model.moe_layer_freq=[0,1,1,1]",
        "checkpoint.save=null",
        "checkpoint.load=/ckpt",
        "optimizer.lr=1",  # int where float expected: coerced
        "optimizer.min_lr=1e-5",
        "data.data_path=[\"0.3\", a, \"0.7\", b]",
    )
    assert cfg.model.num_layers == 4 and cfg.model.moe_layer_freq == [0, 1, 1, 1]
    assert cfg.checkpoint.save is None and cfg.checkpoint.load == "/ckpt"
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 1e-5
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    # Megatron-LM's string form is not YAML; unquoted on a command line it stays a string.
    cfg = tiny("model.num_layers=4", "model.moe_layer_freq=[0]*1+[1]*3")
    assert cfg.model.moe_layer_freq == "[0]*1+[1]*3"
    assert moe_layer_pattern(cfg.model) == [0, 1, 1, 1]


def test_override_interpolation():
    cfg = tiny("model.moe_shared_expert_intermediate_size=${model.moe_ffn_hidden_size}")
    assert cfg.model.moe_shared_expert_intermediate_size == cfg.model.moe_ffn_hidden_size


def test_mandatory_marker_must_be_filled(tmp_path):
    a = write(tmp_path / "a.yaml", f"base: {TINY}\ncheckpoint:\n  save: ???\n")
    with pytest.raises(ConfigError, match="checkpoint.save"):
        load_config(a)
    assert load_config(a, ["checkpoint.save=/x"]).checkpoint.save == "/x"


@pytest.mark.parametrize("bad", ["model.num_layers", "num_layers=4", "model.a.b=1", ".x=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="section.key=value"):
        tiny(bad)


# ---------------------------------------------------------------------------------------------
# unknown keys and types
# ---------------------------------------------------------------------------------------------


def test_unknown_key_in_file_suggests_closest(tmp_path):
    path = write(tmp_path / "x.yaml", "model:\n  num_layer: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"unknown key model.num_layer (in {path}); did you mean model.num_layers?"
    assert isinstance(e.value, ValueError)


def test_unknown_key_in_base_names_the_base(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  global_batch: 4\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"unknown key train.global_batch \(in .*base\.yaml\); "
                                          r"did you mean train.global_batch_size\?"):
        load_config(child)


def test_unknown_section_and_override_key():
    with pytest.raises(ConfigError, match=r"unknown section modle \(in override 'modle.x=1'\); did you mean model\?"):
        tiny("modle.x=1")
    with pytest.raises(ConfigError, match=r"unknown key model.hiden_size \(in override .*\); did you mean "
                                          r"model.hidden_size\?"):
        tiny("model.hiden_size=8")


def test_key_in_wrong_section_points_to_the_right_one():
    with pytest.raises(ConfigError, match="did you mean train.micro_batch_size"):
        tiny("model.micro_batch_size=2")


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid keys of checkpoint: save, load"):
        tiny("checkpoint.zzzz=1")


@pytest.mark.parametrize(
    "override, expected",
    [
        ('model.num_layers="4"', r"model.num_layers: expected an int, got str '4' .*without quotes"),
        ("model.num_layers=4.5", r"model.num_layers: expected an int, got float 4.5"),
        ("model.num_layers=true", r"model.num_layers: expected an int, got bool"),
        ("model.hidden_size=null", r"model.hidden_size: expected an int, got null"),
        ("model.bf16=1", r"model.bf16: expected a bool"),
        ("optimizer.lr=fast", r"optimizer.lr: expected a float, got str 'fast'"),
        ("data.data_path=x", r"data.data_path: expected a list of strings"),
        ("data.data_path=[1, 2]", r"data.data_path\[0\]: expected a string, got int 1"),
        ("model.q_lora_rank=abc", r"model.q_lora_rank: expected an int or null"),
        ("model.moe_layer_freq=1.5", r"model.moe_layer_freq: expected an int or a list of ints or a string"),
    ],
)
def test_type_errors(override, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        tiny(override)
    assert f"in override {override!r}" in str(e.value)


def test_type_error_in_file_names_the_file(tmp_path):
    path = write(tmp_path / "t.yaml", f"base: {TINY}\ntrain:\n  train_iters: '300'\n")
    with pytest.raises(ConfigError, match=r"train.train_iters: expected an int, got str '300' \(in .*t\.yaml\)"):
        load_config(path)


def test_config_from_dict_checks_keys_and_types():
    cfg = config_from_dict({"model": {"num_layers": 4, "moe_layer_freq": 2}})
    assert moe_layer_pattern(cfg.model) == [1, 0, 1, 0]
    with pytest.raises(ConfigError, match=r"unknown key model.layers \(in <dict>\)"):
        config_from_dict({"model": {"layers": 4}})


# ---------------------------------------------------------------------------------------------
# validation: every rule, each with a message naming the key
# ---------------------------------------------------------------------------------------------

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
    ("doc-mask", ["data.reset_attention_mask=true", "data.create_attention_mask=false"], "data.create_attention_mask"),
    ("profile", ["logging.profile_step_start=5"], "logging.profile_step_end"),
    ("vpp-needs-pp", ["parallel.virtual_pipeline_model_parallel_size=2"],
     "parallel.virtual_pipeline_model_parallel_size"),
]


@pytest.mark.parametrize("overrides, key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_rule(overrides, key):
    with pytest.raises(ConfigError) as e:
        tiny(*overrides)
    assert key in str(e.value)


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
    ],
)
def test_world_size_rules(world_size, overrides, key):
    cfg = tiny(*overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=world_size)
    assert key in str(e.value)


def test_world_size_ok():
    validate_config(tiny(), world_size=1)
    validate_config(tiny(), world_size=2)  # DP 2: 8 % (4 x 2) == 0
    validate_config(load_config(GLM5), world_size=1536)  # TP 8 x PP 6 x DP 32, EP 32


def test_defaults_validate():
    validate_config(GLM5Config())


# ---------------------------------------------------------------------------------------------
# shipped YAMLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    validate_config(cfg)
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    save_config(cfg, out)  # overwriting is fine
    assert load_config(out) == cfg
    assert os.listdir(out.parent) == ["config.yaml"]  # no temp file left behind


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.yaml")), ids=lambda p: p.name)
def test_model_configs_set_every_value_explicitly(path):
    import yaml

    doc = yaml.safe_load(path.read_text())
    for name, cls in SECTIONS.items():
        missing = {f.name for f in dataclasses.fields(cls)} - set(doc[name])
        assert not missing, f"{path.name} does not set {name}.{sorted(missing)}"


def test_glm5_matches_hf_reference():
    import transformers

    hf = transformers.GlmMoeDsaConfig()
    m = load_config(GLM5).model
    assert m.hidden_size == hf.hidden_size == 6144
    assert m.num_layers == hf.num_hidden_layers == 78
    assert m.num_attention_heads == hf.num_attention_heads == 64
    assert m.q_lora_rank == hf.q_lora_rank == 2048
    assert m.kv_lora_rank == hf.kv_lora_rank == 512
    assert m.qk_head_dim == hf.qk_nope_head_dim == 192
    assert m.qk_pos_emb_head_dim == hf.qk_rope_head_dim == 64
    assert m.v_head_dim == hf.v_head_dim == 256
    assert m.num_moe_experts == hf.n_routed_experts == 256
    assert m.moe_router_topk == hf.num_experts_per_tok == 8
    assert m.moe_ffn_hidden_size == hf.moe_intermediate_size == 2048
    assert m.moe_shared_expert_intermediate_size == hf.n_shared_experts * hf.moe_intermediate_size
    assert m.ffn_hidden_size == hf.intermediate_size == 12288
    assert m.vocab_size == hf.vocab_size == 154880
    assert m.moe_router_topk_scaling_factor == hf.routed_scaling_factor == 2.5
    assert m.dsa_indexer_n_heads == hf.index_n_heads == 32
    assert m.dsa_indexer_head_dim == hf.index_head_dim == 128
    assert m.dsa_indexer_topk == hf.index_topk == 2048
    assert m.max_position_embeddings == hf.max_position_embeddings == 202752
    assert m.layernorm_epsilon == hf.rms_norm_eps == 1e-5
    assert m.share_embeddings_and_output_weights == hf.tie_word_embeddings is False
    pattern = moe_layer_pattern(m)
    k = hf.first_k_dense_replace
    assert pattern == [0] * k + [1] * (hf.num_hidden_layers - k)
    assert pattern == [int(t == "sparse") for t in hf.mlp_layer_types]


def test_glm5_values_hf_defaults_do_not_carry():
    # The HF class defaults rope_theta to 1e4; the released model uses 1e6 (glm5_facts.md section 1).
    m = load_config(GLM5).model
    assert (m.rotary_base, m.rope_type, m.latent_layernorm_epsilon) == (1e6, "rope", 1e-6)
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (m.moe_router_bias_update_rate, m.moe_aux_loss_coeff) == (1e-3, 1e-4)
    assert (m.mtp_num_layers, m.mtp_use_repeated_layer, m.experimental_attention_variant) == (3, True, "dsa")
    assert m.bf16 is True
    assert load_config(GLM5).data.seq_length == 4096


def test_tiny_and_proxy_shapes():
    t = load_config(TINY)
    assert (t.model.num_layers, t.model.hidden_size, t.model.vocab_size, t.model.transformer_impl) == (2, 64, 8192,
                                                                                                        "local")
    assert moe_layer_pattern(t.model) == [0, 1]
    assert (t.train.micro_batch_size, t.train.global_batch_size, t.model.bf16) == (4, 8, False)
    p = load_config(PROXY)
    assert moe_layer_pattern(p.model) == [0] + [1] * 11
    assert (p.model.qk_head_dim, p.model.qk_pos_emb_head_dim, p.model.v_head_dim) == (192, 64, 256)


def test_attention_ablations():
    proxy = load_config(PROXY)
    mla256 = load_config(ABLATIONS / "attn-mla256.yaml")
    assert mla256.model == proxy.model and mla256.optimizer == proxy.optimizer and mla256.train == proxy.train
    mla192 = load_config(ABLATIONS / "attn-mla192.yaml").model
    assert (mla192.num_attention_heads, mla192.qk_head_dim, mla192.qk_pos_emb_head_dim, mla192.v_head_dim) == (
        24, 128, 64, 128)
    gqa = load_config(ABLATIONS / "attn-gqa8.yaml").model
    assert not gqa.multi_latent_attention and gqa.experimental_attention_variant is None
    assert (gqa.num_attention_heads, gqa.num_query_groups, gqa.kv_channels) == (16, 8, 128)
    # Everything outside attention is the proxy's.
    assert dataclasses.replace(gqa, multi_latent_attention=True, num_query_groups=None, kv_channels=None,
                               experimental_attention_variant="dsa") == proxy.model


def test_config_to_dict_sections():
    d = config_to_dict(load_config(TINY))
    assert list(d) == list(SECTIONS)
    assert d["model"]["moe_layer_freq"] == [0, 1]


# ---------------------------------------------------------------------------------------------
# moe_layer_pattern
# ---------------------------------------------------------------------------------------------


def _model(num_layers, freq, experts=8):
    return dataclasses.replace(GLM5Config().model, num_layers=num_layers, moe_layer_freq=freq, num_moe_experts=experts)


@pytest.mark.parametrize(
    "layers, freq, expected",
    [
        (4, 1, [1, 1, 1, 1]),
        (5, 2, [1, 0, 1, 0, 1]),  # megatron: layer i is MoE when i % N == 0
        (3, [0, 1, 1], [0, 1, 1]),
        (78, "[0]*3+[1]*75", [0] * 3 + [1] * 75),
        (4, "([0]+[1])*2", [0, 1, 0, 1]),
        (4, "2*[1]+[0,0]", [1, 1, 0, 0]),
        (4, " [0,1,1,1] ", [0, 1, 1, 1]),
        (6, "3", [1, 0, 0, 1, 0, 0]),  # a bare int string means every N-th layer, as in Megatron-LM
    ],
)
def test_moe_layer_pattern(layers, freq, expected):
    assert moe_layer_pattern(_model(layers, freq)) == expected


def test_moe_layer_pattern_dense_model():
    assert moe_layer_pattern(_model(3, "[1]*3", experts=None)) == [0, 0, 0]


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "[0]*n",
        "[0]*-1",
        "[0]*10**9",
        "[0]*100000000",
        "[[0]]*2",
        "[0.5]",
        "[True]",
        "[0]*[1]",
        "[0]+1",
        "lambda: 0",
        "[0] if 1 else [1]",
        "[0",
    ],
)
def test_moe_layer_freq_parser_rejects_code(text):
    with pytest.raises(ConfigError, match="model.moe_layer_freq"):
        parse_moe_layer_freq(text)


def test_moe_layer_freq_code_rejected_at_load():
    with pytest.raises(ConfigError, match="unsupported expression Call"):
        tiny("model.moe_layer_freq=__import__('os')")
