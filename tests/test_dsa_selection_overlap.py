"""benchmarks/dsa_selection_overlap.py: union sizes of neighbouring tokens' selections against Python sets, and the
script end to end on the tiny DSA model (its bounds: reduction 1 for one token per block, at most T for T) with its
refusals of bad arguments."""

import json
import random

import pytest
import torch

from benchmarks.dsa_selection_overlap import block_union_sizes, main, overlap_stats


def _random_indices(b, s, k, keys, seed):
    rng = random.Random(seed)
    out = torch.full((b, s, k), -1, dtype=torch.int64)
    for i in range(b):
        for t in range(s):
            chosen = rng.sample(range(keys), rng.randint(0, k))  # ragged: -1 padding after the selections
            out[i, t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
    return out


@pytest.mark.parametrize("block", [1, 2, 3, 4])
def test_union_sizes_and_reduction_match_python_sets(block):
    idx = _random_indices(2, 11, 6, 20, seed=block)
    got = block_union_sizes(idx, block)
    n = 11 // block
    want = [[len({int(j) for t in range(m * block, (m + 1) * block) for j in idx[i, t] if j >= 0}) for m in range(n)]
            for i in range(2)]
    assert got.tolist() == want
    stats = overlap_stats(idx, [block])[str(block)]
    pairs = sum(int((idx[i, t] >= 0).sum()) for i in range(2) for t in range(n * block))
    assert stats["reduction"] == pytest.approx(pairs / sum(map(sum, want)))
    assert stats["union_per_k"] == pytest.approx(sum(map(sum, want)) / (2 * n) / 6)


def test_script_on_the_tiny_model_and_its_refusals(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    assert main(["--config", "configs/models/glm5-tiny.yaml", "--sequences", "1", "--blocks", "1,4",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["topk"] == 64 and set(record["all_layers"]) == {"1", "4"} and len(record["layers"]) >= 1
    for row in record["layers"].values():
        assert row["1"]["reduction"] == pytest.approx(1.0)  # one token per block: every pair its own atomic
        assert 1.0 <= row["4"]["reduction"] <= 4.0 and row["4"]["union_per_k"] <= 4.0
    with pytest.raises(SystemExit):
        main(["--config", "configs/models/glm5-tiny.yaml", "--blocks", "0"])
    assert "--blocks takes positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "configs/models/glm5-tiny.yaml", "model.experimental_attention_variant=null"])
    assert "is not a DSA model" in capsys.readouterr().err
