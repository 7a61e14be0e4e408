"""Config loading: base chains, overrides, unknown keys and type errors, and moe_layer_freq / moe_layer_pattern."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pretrain.config import (
    ConfigError,
    GLM5Config,
    config_from_dict,
    load_config,
    moe_layer_pattern,
    parse_moe_layer_freq,
)
from tests.config_helpers import TINY, tiny


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


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
