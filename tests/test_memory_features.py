"""Long-context memory features leave the math alone: recompute, activation offloading, fused output loss.

Each feature changes what is kept between forward and backward, never what is computed: the tiny
GLM-5 (MLA, MoE, 3 depth-shared MTP depths, DSA) gives the losses and every gradient of the plain run
(fp32, relative max-abs error <= 1e-6) with each feature alone and combined, with DSA's indexer
carried (pretraining), trained on the dense KL (warm-up) and with sparse attention + sparse KL; and
under TP=2 (+SP) and PP=2 against the single-rank reference of tests/test_parallel_equivalence.py.

So that the tests can fail for the right reason, each feature also shows it did its job: recompute
saves fewer bytes for backward (counted with saved-tensor hooks around the forward), offloading moved
bytes through host buffers and prefetched layers (on CPU its round trip is a copy into a separate
buffer), the fused output loss never runs the output layer's forward (its logits never exist).
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import (
    BASE_OVERRIDES,
    LAYOUTS,
    RANK_ENV,
    SEED,
    TINY,
    compare_grads,
    make_batch,
    parallel_step,
    rank_reference,
    rel_err,
)
from tests.test_pipeline_equivalence import compare_stage_grads, pipeline_step

TOL = 1e-6
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
BLOCK = ["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1"]


def selective(*modules: str) -> List[str]:
    return ["model.recompute_granularity=selective", f"model.recompute_modules=[{','.join(modules)}]"]


OFFLOAD = ["model.activation_offload=true"]
DEEPSPEED = OFFLOAD + ["model.activation_offload_backend=deepspeed"]
CHUNKED = ["model.output_loss_backend=chunked", "model.output_chunk_size=5"]  # 32 rows: chunks of 5 and a 2
LIGER = ["model.output_loss_backend=liger"]
COMBINED = FULL + OFFLOAD + CHUNKED
WARMUP = ["model.dsa_indexer_loss_coeff=0.01"]  # dense attention, the indexer trained on the dense KL
SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.01", "model.dsa_indexer_use_sparse_loss=true"]

VARIANTS = {
    "pretraining": {
        "full uniform": FULL, "full block": BLOCK, "selective core_attn": selective("core_attn"),
        "selective moe": selective("moe"), "selective mlp": selective("mlp"),
        "selective shared_experts": selective("shared_experts"), "selective layernorm": selective("layernorm"),
        "offload": OFFLOAD, "offload + full": OFFLOAD + FULL, "offload + selective": OFFLOAD + selective("core_attn"),
        "deepspeed offload + full": DEEPSPEED + FULL,
        "chunked": CHUNKED, "liger": LIGER, "combined": COMBINED,
    },
    "warmup": {"full uniform": FULL, "selective core_attn": selective("core_attn"), "offload": OFFLOAD,
               "chunked": CHUNKED, "combined": COMBINED},
    "sparse": {"full uniform": FULL, "selective core_attn": selective("core_attn"), "offload": OFFLOAD,
               "deepspeed offload + full": DEEPSPEED + FULL,
               "chunked": CHUNKED, "combined": COMBINED},
}
BASES = {"pretraining": [], "warmup": WARMUP, "sparse": SPARSE}


def _forward_backward(model, tokens):
    """Per-token loss of `tokens` (backward of its mean), the bytes autograd saved outside any offload
    hook, and whether the output layer's own forward ran."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    saved, head_calls = [0], [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    hook = model.output_layer.register_forward_hook(lambda *_: head_calls.__setitem__(0, head_calls[0] + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, position_ids, attention_mask=None, labels=labels)
    loss.mean().backward()
    hook.remove()
    return loss.detach(), saved[0], head_calls[0]


def deepspeed_on_cpu() -> List[int]:
    """Let DeepSpeed's CPU checkpointing run on a CPU-only host, counting the bytes it keeps on the host.

    DeepSpeed assumes activations live on an accelerator: its host copy `t.to("cpu")` of a CPU tensor
    is the tensor itself, which it then empties. A device-to-host copy is a new tensor; here, a clone is."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    copy_to_device, keep_on_host, kept = ds.copy_to_device, ds.get_cpu_activations_for_backward, [0]

    def copying(item, device, criterion_func):
        if isinstance(item, (tuple, list)):
            return type(item)(copying(v, device, criterion_func) for v in item)
        if torch.is_tensor(item) and criterion_func(item):
            return item.detach().clone()
        return copy_to_device(item, device, criterion_func)

    def counting(args, inputs):
        kept[0] += sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t) and t.is_floating_point())
        return keep_on_host(args, inputs)

    ds.copy_to_device, ds.get_cpu_activations_for_backward = copying, counting
    return kept


def rank_variants(rank: int, world_size: int, base: str, tokens: torch.Tensor) -> Dict[str, dict]:
    """The plain run and each variant from the same weights, one process."""
    from parallel import activation_offload
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.compat import patch_triton_interpreter
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    patch_triton_interpreter()  # Liger's kernels run in Triton's interpreter here
    activation_offload.MIN_OFFLOAD_BYTES = 1024  # the tiny model's activations are small
    deepspeed_kept = deepspeed_on_cpu()
    results, state = {}, None
    try:
        for name, extra in {"plain": [], **VARIANTS[base]}.items():
            activation_offload.reset_activation_offload()
            cfg = load_config(TINY, BASE_OVERRIDES + BASES[base] + extra)
            initialize_parallel(cfg.parallel, seed=SEED)
            model = build_model(cfg)
            if state is None:
                state = model.state_dict()
            model.load_state_dict(state)
            loss, saved, head_calls = _forward_backward(model, tokens)
            off = activation_offload.process_offloader()
            if cfg.model.activation_offload_backend == "deepspeed":
                off = None
                ds_kept, deepspeed_kept[0] = deepspeed_kept[0], 0
            results[name] = {
                "loss": loss, "saved": saved, "head_calls": head_calls,
                "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
                "offloaded": off.offloaded_bytes if off else 0, "prefetched": off.prefetched_groups if off else 0,
                "deepspeed_kept": ds_kept if cfg.model.activation_offload_backend == "deepspeed" else 0,
            }
        return results
    finally:
        activation_offload.reset_activation_offload()
        destroy_parallel()


@pytest.fixture(scope="module", params=sorted(BASES))
def runs(request):
    (results,) = run_ranks(rank_variants, 1, request.param, make_batch(), env=RANK_ENV, timeout=900)
    return request.param, results


def test_each_feature_leaves_losses_and_every_gradient_unchanged(runs):
    base, results = runs
    plain = results["plain"]
    assert plain["head_calls"] == 4  # the unfused path: main head + 3 MTP depths
    failures = []
    for name, res in results.items():
        # Liger yields only the masked sum, spread evenly over the tokens (pretrain/model/output_loss.py)
        got, want = (res["loss"].sum(), plain["loss"].sum()) if name == "liger" else (res["loss"], plain["loss"])
        if rel_err(got, want) > TOL:
            failures.append(f"{name}: loss {rel_err(got, want):.1e}")
        for pname, want in plain["grads"].items():
            got = res["grads"][pname]
            if (want is None) != (got is None):
                failures.append(f"{name}: {pname} has a gradient in one run only")
            elif want is not None and rel_err(got, want) > TOL:
                failures.append(f"{name}: {pname} {rel_err(got, want):.1e}")
    assert not failures, f"{base}:\n" + "\n".join(failures)
    if base != "pretraining":  # the indexer learns: its gradients are among those compared
        assert any(g is not None and g.abs().sum() > 0 for n, g in plain["grads"].items() if ".indexer." in n)


def test_each_feature_does_its_job(runs):
    base, results = runs
    plain = results["plain"]
    for name, res in results.items():
        if name == "plain":
            continue
        extra = VARIANTS[base][name]
        if "model.activation_offload_backend=deepspeed" in extra:
            assert res["deepspeed_kept"] > 0 and res["saved"] < plain["saved"], name  # unit inputs via the host
        elif "model.activation_offload=true" in extra:
            assert res["offloaded"] > 0 and res["prefetched"] > 0, name
        elif any(e.startswith("model.recompute_granularity") for e in extra):
            assert res["saved"] < plain["saved"], (name, res["saved"], plain["saved"])
        if any(e.startswith("model.output_loss_backend") for e in extra):
            assert res["head_calls"] == 0, name  # no logits: the fused loss reads the weight itself


def rank_tp2(rank: int, world_size: int, tokens: torch.Tensor, ref_state: dict) -> Dict[str, dict]:
    from parallel import activation_offload
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.config import load_config

    activation_offload.MIN_OFFLOAD_BYTES = 1024
    out = {}
    try:
        for name, extra in {"chunked": CHUNKED, "combined": COMBINED, "selective": selective("core_attn", "moe")}.items():
            activation_offload.reset_activation_offload()
            cfg = load_config(TINY, BASE_OVERRIDES + LAYOUTS["tp2"] + extra)
            initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)  # values come from ref_state
            out[name] = parallel_step(cfg, tokens, ref_state, ddp=False)
        return out
    finally:
        activation_offload.reset_activation_offload()
        destroy_parallel()


def rank_pp2(rank: int, world_size: int, tokens: torch.Tensor, ref_state: dict) -> Dict[str, dict]:
    from parallel import activation_offload
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.config import load_config

    activation_offload.MIN_OFFLOAD_BYTES = 1024
    out = {}
    try:
        for name, extra in {"combined": COMBINED, "offload": OFFLOAD}.items():
            activation_offload.reset_activation_offload()
            cfg = load_config(TINY, BASE_OVERRIDES + ["parallel.pipeline_model_parallel_size=2"] + extra)
            initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)
            out[name] = pipeline_step(cfg, tokens, ref_state, ddp=False)
        return out
    finally:
        activation_offload.reset_activation_offload()
        destroy_parallel()


@pytest.fixture(scope="module")
def reference():
    tokens = make_batch()
    (ref,) = run_ranks(rank_reference, 1, tokens, env=RANK_ENV)
    return tokens, ref


def test_tp2_with_memory_features_matches_single_rank(reference):
    tokens, ref = reference
    results = run_ranks(rank_tp2, 2, tokens, ref["state"], env=RANK_ENV, timeout=900)
    for name in results[0]:
        per_rank = [r[name] for r in results]
        for r in per_rank:
            assert rel_err(r["loss"], ref["loss"]) <= 1e-5, name
        compare_grads(ref, per_rank, reduce=True)  # the TP equivalence tests' tolerance (1e-5)


def test_pp2_with_memory_features_matches_single_rank(reference):
    tokens, ref = reference
    stages = run_ranks(rank_pp2, 2, tokens, ref["state"], env=RANK_ENV, timeout=900)
    for name in stages[0]:
        assert rel_err(stages[1][name]["loss"], ref["loss"].mean()) <= 1e-5, name
        compare_stage_grads(ref, [s[name]["grads"] for s in stages], combine_embedding=True)


def test_bad_memory_settings_fail_at_config_time(monkeypatch):
    import sys

    from pretrain.config import ConfigError, load_config

    cases = {
        "model.output_chunk_size is 0; it must be > 0": ["model.output_loss_backend=chunked", "model.output_chunk_size=0"],
        "chunked needs model.output_chunk_size": ["model.output_loss_backend=chunked"],
        "output_grad_weight_fp32=false is read only by": ["model.output_grad_weight_fp32=false"],
        "recompute_method and model.recompute_num_layers": ["model.recompute_granularity=full"],
        "recompute_modules needs": ["model.recompute_modules=[core_attn]"],
        "runs at parallel.tensor_model_parallel_size=1 only": LIGER + LAYOUTS["tp2"],
        "deepspeed offloads the inputs of full-recompute units": DEEPSPEED,
        "deepspeed restores DeepSpeed's RNG tracker": DEEPSPEED + FULL + ["model.attention_dropout=0.1"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as err:
            load_config(TINY, BASE_OVERRIDES + overrides)
        assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as on a machine without DeepSpeed
    for backend, package in {"deepspeed": DEEPSPEED + FULL, "liger": LIGER}.items():
        if backend == "liger":
            monkeypatch.setitem(sys.modules, "liger_kernel", None)
        with pytest.raises(ConfigError, match=f"needs .*pip install -e '\\.\\[{backend}\\]'") as err:
            load_config(TINY, BASE_OVERRIDES + package)
        assert "\n" not in str(err.value)


def test_output_grad_weight_fp32_reaches_the_chunked_loss(monkeypatch):
    """model.output_grad_weight_fp32 is handed to the chunked loss of the main head and every MTP depth (the
    accuracy of both settings against float64 is tests/test_output_loss_kernels.py's); with fp32 weights
    both accumulate in fp32 and agree."""
    import pretrain.model.output_loss as output_loss
    from parallel.initialize import ensure_single_rank
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    seen = []
    original = output_loss.chunked_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fp32_grad_weight"))
        return original(*args, **kwargs)

    monkeypatch.setattr(output_loss, "chunked_linear_cross_entropy", spy)
    ensure_single_rank()
    grads = {}
    for flag in (True, False):
        cfg = load_config(TINY, BASE_OVERRIDES + CHUNKED + [f"model.output_grad_weight_fp32={str(flag).lower()}"])
        torch.manual_seed(0)
        model = build_model(cfg)
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_length + 1), generator=torch.Generator().manual_seed(1))
        s = cfg.data.seq_length
        loss = model(ids[:, :-1], torch.arange(s).expand(2, -1), None, labels=ids[:, 1:])
        loss.sum().backward()
        grads[flag] = (loss.detach(), model.output_layer.weight.grad.clone())
    depths = 1 + (cfg.model.mtp_num_layers or 0)
    assert seen == [True] * depths + [False] * depths
    torch.testing.assert_close(grads[False][0], grads[True][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[False][1], grads[True][1], rtol=1e-5, atol=1e-7)
