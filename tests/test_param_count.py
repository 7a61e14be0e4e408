"""Parameter counts on the meta device: the released 744B model and the shipped configs."""

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from pretrain.config import load_config
from pretrain.convert.hf_config import hf_config_from_model
from pretrain.model.summary import active_parameters, count_parameters, format_summary


def hf_count(model_cfg) -> int:
    """Parameters + router correction biases of transformers' model for the same config."""
    hf = hf_config_from_model(model_cfg)
    for key in ("architectures", "model_type"):
        hf.pop(key)
    hf["num_nextn_predict_layers"] = 0
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**hf))
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


def test_glm5_744b_parameter_count():
    cfg = load_config("configs/models/glm5-744b.yaml")
    counts = count_parameters(cfg)
    main, mtp = sum(counts["main"].values()), sum(counts["mtp"].values())
    assert main + mtp == 753_864_139_008  # GLM-5 with its MTP layer
    assert round(main / 1e9, 2) == 743.91  # the paper's "744B"
    assert main == hf_count(cfg.model)
    # ~39.9B active per token, excluding the embedding and the output head
    active = active_parameters(cfg, counts) - counts["main"]["embedding"] - counts["main"]["output_layer"]
    assert round(active / 1e9, 1) == 39.9
    assert "753,864,139,008" in format_summary(cfg, counts)


@pytest.mark.parametrize("path", ["configs/models/glm5-proxy.yaml", "configs/ablations/attn-mla192.yaml"])
def test_shipped_configs_match_transformers_count(path):
    cfg = load_config(path)
    counts = count_parameters(cfg)
    assert sum(counts["main"].values()) == hf_count(cfg.model)


def test_proxy_is_one_gpu_sized():
    counts = count_parameters(load_config("configs/models/glm5-proxy.yaml"))
    total = sum(counts["main"].values()) + sum(counts["mtp"].values())
    assert 1e9 <= total <= 3e9
