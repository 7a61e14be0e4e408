"""The whole tiny GLM-5 (MoE layer, 3 MTP depths through the same MoE layer type, seq_aux_loss) at EP=2 with the
per-rank dispatch (`model.moe_token_dispatcher_type=alltoall_dedup`) gives the single-rank loss and gradients.

Same procedure, reference and reduction rules as tests/test_parallel_equivalence.py's EP=2 (megatron's all-gather
dispatcher there): fp32 on gloo, relative max-abs error <= 1e-5 on every loss and gradient, on the bare model (local
gradients combined by the data/expert-parallel rules) and through megatron's DDP + finalize_model_grads.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.parallel_helpers import RANK_ENV, TOL, compare_grads, make_batch, rank_parallel, rank_reference, rel_err


@pytest.fixture(scope="module")
def runs():
    batch = make_batch()
    (reference,) = run_ranks(rank_reference, 1, batch, env=RANK_ENV)
    ranks = run_ranks(rank_parallel, 2, ["ep2_dedup"], batch, reference["state"], env=RANK_ENV)
    return reference, [r["ep2_dedup"] for r in ranks]


def test_ep2_dedup_matches_single_rank(runs):
    reference, ranks = runs
    for rank, r in enumerate(ranks):
        local = r["local"]
        assert (local["coords"]["ep_size"], local["coords"]["dp_size"]) == (2, 2)
        assert rel_err(local["loss"], reference["loss"][rank:rank + 1]) <= TOL
    worst = compare_grads(reference, [r["local"] for r in ranks], reduce=True)
    worst_ddp = compare_grads(reference, [r["ddp"] for r in ranks], reduce=False)
    print(f"\nEP=2 alltoall_dedup: worst relative max-abs error {worst:.2e} (local), {worst_ddp:.2e} (megatron DDP)")
