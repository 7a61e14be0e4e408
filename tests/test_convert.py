"""HF <-> ours conversion: bitwise round trip, CLI, and clear failures on bad checkpoints."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.config import load_config
from pretrain.convert import ConversionError, export_hf, import_hf, load_hf_model
from pretrain.convert.cli import main as convert_cli
from pretrain.convert.safetensors_io import SafetensorsDir
from tests.hf_fixtures import read_all_tensors, write_hf_checkpoint


@pytest.mark.parametrize("shard", [None, "30KB"])
def test_round_trip_is_bitwise(tmp_path, shard):
    hf_dir, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    write_hf_checkpoint(str(hf_dir), 11, layers=3, dense=1, mtp=True, max_shard_size=shard)
    import_hf(str(hf_dir), str(ours), max_shard_bytes=40_000)
    assert len([n for n in os.listdir(ours) if n.endswith(".safetensors")]) > 1  # sharded output
    cfg = load_config(str(ours / "config.yaml"))
    assert cfg.model.mtp_num_layers == 3 and cfg.model.experimental_attention_variant == "dsa"
    mine = SafetensorsDir(str(ours))
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wk.weight" in mine
    export_hf(str(ours), str(back))
    original, returned = read_all_tensors(str(hf_dir)), read_all_tensors(str(back))
    assert original.keys() == returned.keys()
    assert any(k.startswith("model.layers.3.") for k in returned)  # the MTP layer
    assert any(".indexer." in k for k in returned)
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype, name
        assert torch.equal(returned[name], tensor), name
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


def test_packed_expert_layout_reads_like_per_expert(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2F, H]) converts identically."""
    per_expert, packed = tmp_path / "a", tmp_path / "b"
    write_hf_checkpoint(str(per_expert), 12, layers=2, mtp=False)
    tensors = read_all_tensors(str(per_expert))
    layer = "model.layers.1.mlp.experts."
    n = 8
    gate_up = torch.stack([torch.cat([tensors.pop(f"{layer}{e}.gate_proj.weight"), tensors.pop(f"{layer}{e}.up_proj.weight")]) for e in range(n)])
    down = torch.stack([tensors.pop(f"{layer}{e}.down_proj.weight") for e in range(n)])
    tensors[layer + "gate_up_proj"], tensors[layer + "down_proj"] = gate_up, down
    packed.mkdir()
    save_file(tensors, str(packed / "model.safetensors"))
    (packed / "config.json").write_text((per_expert / "config.json").read_text())
    import_hf(str(per_expert), str(tmp_path / "oa"))
    import_hf(str(packed), str(tmp_path / "ob"))
    a, b = read_all_tensors(str(tmp_path / "oa")), read_all_tensors(str(tmp_path / "ob"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_import_export(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    write_hf_checkpoint(str(hf_dir), 13, layers=2, mtp=True)
    assert convert_cli(["import-hf", str(hf_dir), str(tmp_path / "ours")]) == 0
    assert convert_cli(["export-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    # refusing to overwrite is a clear error, not a traceback
    assert convert_cli(["import-hf", str(hf_dir), str(tmp_path / "ours")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_shape_mismatch_names_the_tensor(tmp_path):
    write_hf_checkpoint(str(tmp_path), 14, layers=2, mtp=False)
    _edit_config(tmp_path, kv_lora_rank=8)
    with pytest.raises(ConversionError, match=r"decoder\.layers\.0\.self_attention\.linear_kv_down_proj\.weight.*\(24, 64\).*\(16, 64\)"):
        load_hf_model(str(tmp_path))


def test_missing_tensor_names_it(tmp_path):
    write_hf_checkpoint(str(tmp_path), 15, layers=2, mtp=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.indexer.wk.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.self_attn\.indexer\.wk\.weight"):
        import_hf(str(tmp_path), str(tmp_path / "out"))


def test_more_layers_in_config_than_checkpoint(tmp_path):
    write_hf_checkpoint(str(tmp_path), 16, layers=2, mtp=False)
    config = json.loads((tmp_path / "config.json").read_text())
    _edit_config(tmp_path, num_hidden_layers=3, mlp_layer_types=config["mlp_layer_types"] + ["sparse"],
                 indexer_types=["full"] * 3)
    with pytest.raises(ConversionError, match=r"model\.layers\.2\."):
        load_hf_model(str(tmp_path))


def test_unsupported_checkpoints_are_refused(tmp_path):
    write_hf_checkpoint(str(tmp_path), 17, layers=2, mtp=False)
    for bad in (["full", "sometimes"], ["full"]):  # an unknown kind; one entry per layer is required
        _edit_config(tmp_path, indexer_types=bad)
        with pytest.raises(ConversionError, match="indexer_types"):
            load_hf_model(str(tmp_path))
    _edit_config(tmp_path, indexer_types=["full", "full"], model_type="llama")
    with pytest.raises(ConversionError, match="glm_moe_dsa"):
        load_hf_model(str(tmp_path))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(str(tmp_path / "nowhere"))


def test_interrupted_import_leaves_nothing(tmp_path, monkeypatch):
    hf_dir = tmp_path / "hf"
    write_hf_checkpoint(str(hf_dir), 18, layers=2, mtp=False)
    calls = {"n": 0}
    original = SafetensorsDir.get

    def failing_get(self, name):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return original(self, name)

    monkeypatch.setattr(SafetensorsDir, "get", failing_get)
    with pytest.raises(KeyboardInterrupt):
        import_hf(str(hf_dir), str(tmp_path / "out"), max_shard_bytes=10_000)
    assert not (tmp_path / "out").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".partial")]
