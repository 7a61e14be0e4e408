"""The 744B curriculum's long stages with packed documents: they validate because documents cost O(S) on the host
(no [s, s] mask at any stage), and a plan that asks for the dense mask or for per-document positions where RoPE
would ignore them is refused with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_pipeline.packing import collate_batch, pack_sample
from pretrain.curriculum.plan import PlanError, load_plan
from pretrain.training.step import with_documents

ROOT = Path(__file__).resolve().parents[1]
PLAN = str(ROOT / "configs/curriculum/glm5-744b.yaml")
EOD, PAD = 0, -1


def test_every_stage_isolates_documents_and_validates():
    plan = load_plan(PLAN)
    assert max(s.seq_length for s in plan.stages) == 202752
    for s in plan.stages:
        d = s.cfg.data
        assert d.reset_attention_mask and d.reset_position_ids and not d.create_attention_mask, s.name


def test_host_bytes_per_sample_are_linear_at_the_longest_stage():
    """pack_sample and the batch's document layout at 202,752 tokens: under 8 MiB in all (the dense mask alone
    would be 38 GiB), the same bytes per token as at 4K."""
    per_token = []
    for s in (4096, 202752):
        gen = torch.Generator().manual_seed(0)
        text = torch.randint(1, 1000, (s + 1,), generator=gen)
        text[torch.randint(0, s, (max(1, s // 3000),), generator=gen)] = EOD
        batch = with_documents(collate_batch([pack_sample(text, EOD, PAD, True, True, False)]))
        nbytes = sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))
        per_token.append(nbytes / s)
    assert per_token[1] * 202752 < 8 * 2**20
    assert per_token[1] <= 1.01 * per_token[0]


@pytest.mark.parametrize("override, key", [
    ("data.create_attention_mask=true", "data.create_attention_mask"),
    ("model.experimental_attention_variant=null", "data.reset_position_ids"),  # megatron's MLA at the 4K stages
])
def test_a_plan_that_cannot_run_is_refused_in_one_line(override, key):
    with pytest.raises(PlanError) as e:
        load_plan(PLAN, [override])
    assert key in str(e.value) and "\n" not in str(e.value)
