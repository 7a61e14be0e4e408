"""The layout search (pretrain/layout/search.py): refusals with their reason, a known-good layout accepted, the
config validator agreeing with the arithmetic rules, check_stage for the curriculum, and a 2,048-GPU search in
seconds (docs/layout.md)."""

from __future__ import annotations

import contextlib
import io
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from pretrain.config import load_config
from pretrain.layout.search import (
    SearchOptions, bubble_refusal, check_stage, config_validator, fitting, refusal, search, splits,
)
from pretrain.layout.types import Layout, ModelDims, StepTime, Workload, cluster_preset

ROOT = Path(__file__).resolve().parents[1]
GLM5 = "configs/models/glm5-744b.yaml"
DENSE_STAGE = ["model.dsa_sparse_attention=false", "model.dsa_indexer_loss_coeff=0.0",
               "model.dsa_indexer_use_sparse_loss=false"]


@pytest.fixture(scope="module")
def glm5():
    cfg = load_config(GLM5, DENSE_STAGE)
    return cfg, ModelDims.from_config(cfg)


def stub_step(dims, layout, work, cluster) -> StepTime:
    """A stand-in time model (tests only): the ideal step stretched by the bubble and the recompute."""
    slow = 1 + (layout.bubble if layout.pp > 1 else 0) + {"none": 0, "selective": 0.1, "full": 0.33}[layout.recompute]
    total = slow * work.tokens_per_step / layout.gpus / 1000.0
    return StepTime(0, 0, 0, 0, 0, 0, 0, 0, 0, total, work.tokens_per_step / total / layout.gpus, 0.5 / slow)


GOOD = Layout(tp=8, pp=6, vpp=1, ep=32, cp=1, dp=32, micro_batch_size=1, num_microbatches=128,
              sequence_parallel=True, recompute="full")
BAD = {  # kind of refusal: a layout of GLM-5 (64 heads, 78 layers, 256 experts) breaking only that rule
    "heads % tp": replace(GOOD, tp=3, dp=64),
    "layers % (pp*vpp)": replace(GOOD, pp=4, dp=48),
    "experts % ep": replace(GOOD, ep=48),
    "seq % (2*cp)": replace(GOOD, cp=3, dp=32),
    "global batch % (mbs*dp)": replace(GOOD, dp=24, num_microbatches=170),
    "micro-batches % pp with vpp": replace(GOOD, vpp=13, num_microbatches=127, dp=32),
    "ep*etp vs tp*cp*dp": replace(GOOD, ep=128, etp=8),
    "moe needs sp": replace(GOOD, sequence_parallel=False),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_arithmetic_refusals_name_their_rule(glm5, kind):
    _, dims = glm5
    reason = refusal(dims, BAD[kind], Workload(4096, 4096))
    assert reason is not None and reason.startswith(kind + ":"), (kind, reason)
    assert refusal(dims, GOOD, Workload(4096, 4096)) is None


def test_config_validator_agrees_with_the_arithmetic(glm5):
    """The good layout passes megatron-facing validation; each arithmetic refusal is one the validator refuses too."""
    cfg, dims = glm5
    work = Workload(4096, 4096)
    validate = config_validator(cfg, work)
    assert validate(GOOD) is None
    for kind in ("heads % tp", "layers % (pp*vpp)", "experts % ep", "global batch % (mbs*dp)", "ep*etp vs tp*cp*dp"):
        assert validate(BAD[kind]) is not None, kind


def test_bubble_and_memory_refusals(glm5):
    _, dims = glm5
    # the plan's DSA stages: PP 6 with one micro-batch per pipeline idles 5/6 of the step
    dsa = replace(GOOD, cp=8, dp=14, num_microbatches=1)
    assert bubble_refusal(dsa, 0.10).startswith("bubble: (PP - 1) / (VPP x m) = 5 / (1 x 1)")
    assert bubble_refusal(GOOD, 0.10) is None  # 5 / 128
    assert bubble_refusal(replace(GOOD, vpp=13, num_microbatches=12), 0.10) is None  # 5 / 156
    # 744B on one 8-GPU node: no recompute/offload setting fits an 80 GB GPU
    cluster = cluster_preset("h100-nvl-ib400", 8)
    cand, reason, _ = fitting(dims, Layout(tp=8, ep=8, dp=1, sequence_parallel=True, num_microbatches=8),
                              Workload(4096, 8), cluster, SearchOptions())
    assert cand is None and reason.startswith("memory:"), reason
    # the good layout fits, with its cheapest recompute kept
    cand, reason, _ = fitting(dims, replace(GOOD, recompute="none"), Workload(4096, 4096), cluster, SearchOptions())
    assert reason is None and cand.memory.needed <= 0.9 * cluster.memory_bytes


def test_check_stage_for_the_curriculum(glm5):
    cfg, _ = glm5
    from pretrain.config import config_from_dict, config_to_dict

    def stage(**over):
        data = config_to_dict(cfg)
        for key, value in over.items():
            section, name = key.split("__")
            data[section][name] = value
        return config_from_dict(data)

    good = stage(parallel__context_parallel_size=1, train__global_batch_size=4096, train__micro_batch_size=1,
                 model__recompute_granularity="full", model__recompute_method="uniform", model__recompute_num_layers=1,
                 model__output_loss_backend="chunked", model__output_chunk_size=4096)
    assert check_stage(good, world_size=1536) is None  # the model config's example layout: TP 8 x PP 6 x DP 32
    # one GPU more: DP 32 would still divide the batch, but megatron needs TP x PP x CP x DP = the world size
    reason = check_stage(good, world_size=1537)
    assert reason is not None and "world size % (tp*pp*cp): 1537 GPUs over TP x PP x CP = 48" in reason, reason
    dsa = stage(parallel__context_parallel_size=8, data__seq_length=202752, train__global_batch_size=14,
                model__recompute_granularity="full", model__recompute_method="uniform", model__recompute_num_layers=1,
                model__output_loss_backend="chunked", model__output_chunk_size=8192)
    reason = check_stage(dsa, world_size=5376)
    assert reason is not None and "bubble" in reason and "\n" not in reason, reason


def test_search_of_2048_gpus_runs_in_seconds(glm5):
    cfg, dims = glm5
    work = Workload(4096, 16384)
    start = time.perf_counter()
    result = search(dims, work, cluster_preset("h100-nvl-ib400", 2048), SearchOptions(), stub_step,
                    validate=config_validator(cfg, work))
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, elapsed
    assert result.considered > 10_000 and result.ranked
    # without the model's stage costs the search keeps even stages: of 78 layers over a power-of-two GPU count
    # only PP 1 or 2 divides both
    assert result.refused["layers % (pp*vpp)"] > 0 and {c.layout.pp for c in result.ranked} <= {1, 2}
    best = result.ranked[0]
    assert all(c.step.tokens_per_s_per_gpu <= best.step.tokens_per_s_per_gpu for c in result.ranked)
    assert config_validator(cfg, work)(best.layout) is None


def test_uneven_stages_open_pp4_and_pp8_on_2048_gpus(glm5):
    """With the stage costs, a PP x VPP that does not divide the 78 layers gets pipeline_split's balanced
    layout instead of a refusal: PP 4 and 8 layouts rank, each within the bubble bound, each layout string
    placing every layer, the embedding, MTP and the loss (the config resolves it), the even splits kept."""
    from pretrain.config.pipeline_layout import stage_entries
    from pretrain.layout.search import pipeline_costs

    cfg, dims = glm5
    work = Workload(4096, 8192)
    opts = SearchOptions(pipeline_costs=pipeline_costs(cfg, work), max_vpp=2, micro_batches=(1,))
    result = search(dims, work, cluster_preset("h100-nvl-ib400", 2048), opts, stub_step)
    found = {c.layout.pp for c in result.ranked}
    assert {4, 8} <= found, found
    assert result.refused["layers % (pp*vpp)"] == 0
    validate = config_validator(cfg, work)
    for pp in (4, 8):
        best = next(c for c in result.ranked if c.layout.pp == pp)
        lay = best.layout
        assert lay.pipeline_layout and (lay.pp - 1) / (lay.vpp * lay.num_microbatches) <= opts.bubble_bound
        par = replace(cfg.parallel, pipeline_model_parallel_size=lay.pp,
                      virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
                      pipeline_model_parallel_layout=lay.pipeline_layout)
        stages = stage_entries(cfg.model, par)
        assert sum(s.count("t") for s in stages) == 78 and len(stages) == lay.pp * lay.vpp
        assert validate(lay) is None, lay.short()
        # the memory's rank layers are the layout's: every layer once over the pipeline ranks
        from pretrain.layout.memory import rank_layers
        assert sorted(i for r in range(lay.pp) for i in rank_layers(dims, lay, r)) == list(range(78))
    assert all(c.layout.pipeline_layout is None for c in result.ranked if 78 % (c.layout.pp * c.layout.vpp) == 0)


def test_check_stage_reads_the_configured_layout(glm5):
    """check_stage takes a stage's uneven stages from its layout keys: its layers are checked as placed."""
    from pretrain.layout.memory import rank_layers
    from pretrain.layout.search import layout_of

    cfg, dims = glm5
    text = "Et*18|t*20|t*20|t*20m*3|L"
    par = replace(cfg.parallel, pipeline_model_parallel_size=5, pipeline_model_parallel_layout=text)
    stage = replace(cfg, parallel=par)
    layout, _ = layout_of(stage, 5 * 8 * 64)
    assert [len(rank_layers(dims, layout, r)) for r in range(5)] == [18, 20, 20, 20, 0]
    reason = check_stage(stage, world_size=5 * 8 * 64)
    assert reason is None or "layers" not in reason, reason
    first = replace(cfg.parallel, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=18)
    layout, _ = layout_of(replace(cfg, parallel=first), 4 * 8 * 64)
    assert [len(rank_layers(dims, layout, r)) for r in range(4)] == [18, 20, 20, 20]


def test_cli_refuses_to_rank_without_the_time_model(monkeypatch, capsys):
    import pretrain.layout.search as search_module
    from pretrain.layout.__main__ import main

    def missing(cluster, *variant):
        raise RuntimeError("the layout planner's time model (pretrain.layout.timing) is not available: test")

    monkeypatch.setattr(search_module, "default_step_fn", missing)
    code = main(["--config", "configs/models/glm5-tiny.yaml", "--seq", "128", "--global-batch", "8", "--gpus", "8"])
    assert code == 2 and "time model" in capsys.readouterr().err


def test_cli_plans_a_cut_of_a_config_whose_example_layout_it_does_not_divide(capsys):
    """The 744B config's example layout (TP 8 x PP 6, EP 32) does not fit a 2-layer cut; the planner searches the
    layout itself, so the config's parallel section does not stop it. A cut of GLM-5's dense first layers has no
    expert to place: no layout with EP > 1 is considered and none holds MoE dispatch buffers."""
    from pretrain.layout.__main__ import main

    def plan(seq, pattern):
        return main(["--config", GLM5, "--seq", str(seq), "--global-batch", "4", "--cluster", "h200-nvl-ib400",
                     "--gpus", "2", "--top", "50", "model.num_layers=2", "model.mtp_num_layers=0",
                     f"model.moe_layer_freq={pattern}"])

    assert plan(4096, "[0,1]") == 0
    assert " ep2 " in capsys.readouterr().out
    assert plan(131072, "[0,0]") == 0
    dense = capsys.readouterr().out
    ranked = [line for line in dense.splitlines() if line.startswith("#")]
    assert ranked and all(" ep1 etp1 " in line for line in ranked), ranked
    assert "moe_dispatch_buffers" not in dense and "ep*etp" not in dense


def test_stage_memory_peaks_at_a_save_only_when_its_copies_outgrow_the_activations():
    """A run that saves checkpoints, synchronously or not, peaks at the larger of the step (state + activations)
    and the save (state + the routed experts' copies, memory.save_copies_terms; `search.saves_checkpoints`): on
    glm5-proxy at 4K the step (the soak measured 60.5 GiB with saves of either kind), at 128 tokens per micro-batch
    the save."""
    from pretrain.layout.from_config import layout_of
    from pretrain.layout.search import stage_memory

    estimates = {}
    for name, overrides in {"async": ["checkpoint.save=/tmp/ckpt", "checkpoint.async_save=true"],
                            "sync": ["checkpoint.save=/tmp/ckpt", "checkpoint.async_save=false"],
                            "no saves": ["checkpoint.save=null", "checkpoint.async_save=true"]}.items():
        for seq in (4096, 128):
            cfg = load_config("configs/models/glm5-proxy.yaml", [*overrides, f"data.seq_length={seq}"])
            estimates[name, seq] = stage_memory(cfg, *layout_of(cfg, 1))
    for seq in (4096, 128):
        assert estimates["async", seq].terms == estimates["sync", seq].terms
    assert estimates["sync", 4096].terms == estimates["no saves", 4096].terms  # the step's peak
    at_save = estimates["sync", 128]
    copies = at_save.terms.pop("checkpoint_save_copies")
    # glm5-proxy, one GPU: 12 MoE layers (11 + MTP's) x 48 experts x 3 x 2048 x 512 elements, bf16 weight +
    # fp32 main weight + fp32 Muon momentum
    assert copies == 12 * 48 * 3 * 2048 * 512 * (2 + 4 + 4)
    step = estimates["no saves", 128]
    # between steps: the state the step holds too, no activations
    assert set(at_save.terms) == {"weights", "main_weights", "gradients", "optimizer_state"}
    assert all(step.terms[k] == v for k, v in at_save.terms.items())
    assert copies + sum(at_save.terms.values()) > step.total


def test_the_layouts_zero2_gradient_reduce_reaches_memory_and_time(glm5):
    """A layout's optimizer.zero2_grad_reduce reaches the search's memory and time models (before 2026-11-29 the CLI
    ranked every layout as a per-micro-batch reduce). `step` keeps a full fp32 gradient buffer per rank and reduces
    once per step; `microbatch` keeps 1/dp of it and reduces every micro-batch. References: the parameters the rank
    holds (the memory model's own count is not used) and the exposed reduce's micro-batch count."""
    from pretrain.layout.search import default_step_fn

    _, dims = glm5
    cluster = cluster_preset("h100-nvl-ib400", 2048)
    work = Workload(4096, 4096)
    got = {}
    for mode in ("microbatch", "step"):
        layout = replace(GOOD, optimizer="muon", zero="zero2", recompute="full", zero2_grad_reduce=mode)
        assert f"optimizer.zero2_grad_reduce={mode}" in layout.overrides()
        cand, reason, _ = fitting(dims, layout, work, cluster, SearchOptions())
        assert reason is None, reason
        step = default_step_fn(cluster)(dims, cand.layout, work, cluster)
        got[mode] = (cand.memory.terms.get("gradients", 0.0), step.dp_comm_exposed)
    rank_params = dims.total_params / (layout.tp * layout.pp)  # an upper bound: experts are further split by EP
    extra_grads = got["step"][0] - got["microbatch"][0]
    assert extra_grads > 0 and extra_grads <= 4 * rank_params  # a full fp32 buffer for the rank's parameters
    assert got["microbatch"][1] > 10 * got["step"][1] > 0  # 128 reduces per step against one


def test_the_search_tries_both_reduce_modes_unless_pinned(tmp_path):
    """The reduce mode is a searched dimension: for Muon's ZeRO-2 every split comes in both modes (AdamW's in
    neither), `python -m pretrain.layout` says so, and an optimizer.zero2_grad_reduce override or
    --zero2-grad-reduce pins one mode (the config key is read, not ignored)."""
    from pretrain.layout.__main__ import main

    dims = ModelDims.from_config(load_config(str(ROOT / "configs/models/glm5-proxy.yaml")))
    work = Workload(4096, 64)
    cluster = cluster_preset("h200-nvl-ib400", 8)
    muon = list(splits(dims, work, cluster, SearchOptions()))
    modes = Counter(lay.zero2_grad_reduce for lay in muon)
    assert modes["microbatch"] == modes["step"] > 0 and set(modes) == {"microbatch", "step"}
    adam = list(splits(dims, work, cluster, SearchOptions(optimizer="adam", zero=("ddp", "zero2"))))
    assert {lay.zero2_grad_reduce for lay in adam} == {"microbatch"}
    pinned = list(splits(dims, work, cluster, SearchOptions(zero2_grad_reduce="step")))
    assert {lay.zero2_grad_reduce for lay in pinned} == {"step"} and len(pinned) == modes["step"]
    base = ["--config", str(ROOT / "configs/models/glm5-proxy.yaml"), "--seq", "4096", "--global-batch", "64",
            "--cluster", "h200-nvl-ib400", "--gpus", "8", "--top", "3"]
    for extra, expect, table in ((["--table", str(tmp_path / "a.tsv")], "searched (microbatch, step)", "a.tsv"),
                                 (["optimizer.use_distributed_optimizer=true", "optimizer.zero2_grad_reduce=step",
                                   "--table", str(tmp_path / "b.tsv")],
                                  "pinned to step", "b.tsv"),
                                 (["--zero2-grad-reduce", "microbatch", "--table", str(tmp_path / "c.tsv")],
                                  "pinned to microbatch", "c.tsv")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(base + extra)
        assert expect in out.getvalue(), out.getvalue()[:400]
        rows = (tmp_path / table).read_text().splitlines()
        column = rows[0].split("\t").index("zero2_grad_reduce")
        seen = {r.split("\t")[column] for r in rows[1:]}
        assert seen == ({"microbatch", "step"} if table == "a.tsv" else {expect.split()[-1]}), (table, seen)
