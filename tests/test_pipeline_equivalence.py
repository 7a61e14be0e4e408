"""Two pipeline stages (PP=2, 1F1B schedule) of the tiny GLM-5 give the single-rank gradients.

The reference and the tolerance are test_parallel_equivalence's: one rank runs forward + backward of
the mean per-token loss (fp32, no dropout, randomized norms and expert biases) and returns its state
and every parameter's gradient; here two ranks each build their stage with other seeds, load the
reference weights (renumbering the stage's decoder layers by megatron's layer offset), and run the
trainer's `forward_step` through megatron's pipeline schedule on the same batch (one micro-batch;
the schedule divides the token-mean loss by 1, as the reference's `loss.mean()`). Every parameter's
gradient on every stage is compared with the reference's (relative max-abs error <= 1e-5):

* stage 0 holds the embedding and layer 0 (dense); stage 1 holds layer 1 (MoE), the final norm, the
  output head and the MTP layer. MTP embeds its shifted tokens with the word embeddings, so stage 1
  holds a copy of them too: each stage's own gradient of that copy is part of the reference's, and
  their sum is all of it. `finalize_model_grads` forms that sum (megatron's embedding group), so
  after megatron's DDP both stages hold exactly the reference gradient;
* every other parameter lives on one stage, and its gradient is the reference's as it is.

(tests/test_training.py runs the full trainer at PP=2 and compares losses and the gradient norm over
steps; this file pins each gradient of one step.)
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import (
    BASE_OVERRIDES,
    RANK_ENV,
    SEED,
    SEQ,
    TINY,
    TOL,
    check_grad,
    global_param_names,
    make_batch,
    rank_reference,
    rel_err,
)

EMBEDDING = "embedding.word_embeddings.weight"


def pp2_config():
    from pretrain.config import load_config

    return load_config(TINY, BASE_OVERRIDES + ["parallel.pipeline_model_parallel_size=2"])


def pipeline_step(cfg, tokens: torch.Tensor, ref_state: dict, ddp: bool) -> dict:
    """This stage with the reference weights; forward + backward of `tokens` through the 1F1B schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pretrain.model.builder import build_model
    from pretrain.training.step import forward_step

    model = build_model(cfg)
    names = global_param_names(model)
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
        for name, t in tensors.items():
            t.copy_(ref_state[names[name]])  # TP = EP = 1: every tensor on its stage is whole
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch = {"tokens": inputs, "labels": labels, "loss_mask": torch.ones(labels.shape),
             "position_ids": torch.arange(SEQ).unsqueeze(0).expand_as(inputs), "attention_mask": None}
    chunk = model
    if ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        chunk = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        chunk.zero_grad_buffer()
        model.config.finalize_model_grads_func = finalize_model_grads
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, cp_group=None), data_iterator=iter([batch]), model=chunk, num_microbatches=1,
        seq_length=SEQ, micro_batch_size=tokens.shape[0], decoder_seq_length=SEQ, forward_only=False,
    )
    if ddp:
        grads = {names[n]: p.main_grad.detach().clone() if p.requires_grad else None
                 for n, p in model.named_parameters()}
    else:
        grads = {names[n]: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    loss = None
    if losses:  # the last stage: the schedule's (sum, count) of the LM loss
        total, count = losses[0]["lm loss"]
        loss = total / count
    return {"grads": grads, "loss": loss, "pre_process": model.pre_process, "post_process": model.post_process}


def rank_pipeline(rank: int, world_size: int, tokens: torch.Tensor, ref_state: dict) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel

    cfg = pp2_config()
    try:
        initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)  # other seeds: values come from ref_state
        return {"local": pipeline_step(cfg, tokens, ref_state, ddp=False),
                "ddp": pipeline_step(cfg, tokens, ref_state, ddp=True)}
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def runs() -> dict:
    tokens = make_batch()
    (reference,) = run_ranks(rank_reference, 1, tokens, env=RANK_ENV)
    stages = run_ranks(rank_pipeline, 2, tokens, reference["state"], env=RANK_ENV)
    return {"reference": reference, "stages": stages}


def compare_stage_grads(reference: dict, stage_grads: List[Dict[str, torch.Tensor]], combine_embedding: bool) -> float:
    """Every stage's gradient against the reference's; with `combine_embedding`, the embedding's as
    the sum over the stages holding it. Returns the worst relative error; asserts the stages together
    hold every reference parameter."""
    worst, failures, seen = 0.0, [], set()
    for stage, grads in enumerate(stage_grads):
        for name, got in grads.items():
            seen.add(name)
            want = reference["grads"][name]
            if name == EMBEDDING and combine_embedding:
                got = sum(g[name] for g in stage_grads if name in g)
            # want is None for the DSA indexer while attention is dense: no gradient anywhere
            err = check_grad(f"stage {stage} {name}", got, want, failures)
            if err is not None:
                worst = max(worst, err)
    assert seen == set(reference["grads"]), set(reference["grads"]) ^ seen
    assert not failures, "gradients differ from the single-rank run:\n" + "\n".join(failures)
    return worst


def test_stages_split_the_model(runs):
    first, last = (s["local"] for s in runs["stages"])
    assert (first["pre_process"], first["post_process"], last["pre_process"], last["post_process"]) == (
        True, False, False, True)
    assert EMBEDDING in first["grads"] and EMBEDDING in last["grads"]  # MTP's copy on the last stage
    assert any(n.startswith("decoder.layers.1.mlp.experts") for n in last["grads"])
    assert not any(n.startswith(("decoder.layers.1.", "mtp.", "output_layer")) for n in first["grads"])
    # each stage's share of the embedding gradient is far from all of it: the sum is needed
    ref = runs["reference"]["grads"][EMBEDDING]
    assert min(rel_err(first["grads"][EMBEDDING], ref), rel_err(last["grads"][EMBEDDING], ref)) > 100 * TOL


def test_pp2_loss_matches_single_rank(runs):
    loss = runs["stages"][1]["local"]["loss"]
    assert rel_err(loss, runs["reference"]["loss"].mean()) <= TOL


def test_pp2_gradients_match_single_rank(runs):
    worst = compare_stage_grads(runs["reference"], [s["local"]["grads"] for s in runs["stages"]], combine_embedding=True)
    print(f"\nPP=2: worst relative max-abs error {worst:.2e}")


def test_pp2_megatron_ddp_gradients_match_single_rank(runs):
    """After DDP + finalize_model_grads each stage holds the reference gradient, the embedding included."""
    worst = compare_stage_grads(runs["reference"], [s["ddp"]["grads"] for s in runs["stages"]], combine_embedding=False)
    print(f"\nPP=2 through megatron DDP: worst relative max-abs error {worst:.2e}")
