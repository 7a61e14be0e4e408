"""lab/dsa/dsa_selection_overlap.py: union sizes of neighbouring tokens' selections against Python sets, and the
script end to end on the tiny DSA model (its bounds: reduction 1 for one token per block, at most T for T) with its
refusals of bad arguments."""

import json
import random

import pytest
import torch

from lab.dsa.dsa_selection_overlap import block_union_sizes, first_keys_share, main, overlap_stats


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


def test_first_keys_share_counts_query_independent_rows():
    """Rows t >= k whose selection is exactly keys 0 .. k - 1 (tied scores under the tie rule), against a loop."""
    idx = _random_indices(2, 13, 4, 13, seed=7)
    idx[0, 5] = torch.arange(4)
    idx[1, 9] = torch.arange(4)
    idx[1, 2] = torch.arange(4)  # t < k: not counted
    want = sum(idx[i, t].tolist() == [0, 1, 2, 3] for i in range(2) for t in range(4, 13)) / (2 * 9)
    assert want >= 2 / 18 and first_keys_share(idx) == pytest.approx(want)


def test_script_on_a_warmup_config(tmp_path):
    """A warm-up config (dense KL, as its checkpoints are saved) runs too: the script turns the sparse indexer loss
    on with sparse attention, which the config rules require; each layer reports its first-k share."""
    out = tmp_path / "overlap.json"
    assert main(["--config", "configs/dsa/glm5-tiny-dsa-warmup.yaml", "--sequences", "1", "--blocks", "1,2",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["first_k_share"]) == set(record["layers"])
    assert all(0.0 <= v <= 1.0 for v in record["first_k_share"].values())
