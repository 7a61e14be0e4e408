"""benchmarks/scaling.py on CPU: the dry run's plan (every run's config passes the layout checks for its GPUs),
`--only` with its baselines, argument refusals, and the table from fake run directories (ratios within one call,
the all-to-all share from a Chrome trace)."""

from __future__ import annotations

import json

import pytest

from benchmarks import scaling


def dry_run(capsys, *argv):
    assert scaling.main(["--out", "unused", "--dry-run", *argv]) == 0
    return capsys.readouterr().out


def test_dry_run_plans_every_layout_on_two_and_four_gpus(capsys):
    for gpus in (2, 4):
        out = dry_run(capsys, "--gpus", str(gpus))
        commands = {line.split("]")[0][1:]: line for line in out.splitlines() if line.startswith("[")}
        assert set(commands) == set(scaling.plan_runs(gpus, 4, []))
        assert f"--nproc-per-node {gpus} " in commands["ep"] and "--nproc-per-node 1 " in commands["gpu1"]
        assert f"parallel.expert_model_parallel_size={gpus}" in commands["ep_overlap"]
        assert "model.moe_shared_expert_overlap=true model.moe_overlap_chunks=2" in commands["ep_overlap"]
        assert "pipeline_model_parallel_layout=" in commands["pp2"]
        assert "virtual_pipeline_model_parallel_size=2" in commands["pp2"]
        # weak scaling: 8 micro-batches of 4 per data-parallel rank (PP: per pipeline)
        assert "train.global_batch_size=32 " in commands["gpu1"] + " "
        assert f"train.global_batch_size={32 * gpus} " in commands["ddp_m8"] + " "
        assert f"train.global_batch_size={128 * gpus} " in commands["zero2_m32"] + " "
        assert "optimizer.zero2_grad_reduce=microbatch_scatter" in commands["zero2_scatter_m32"]
        assert "parallel.grad_reduce_in_fp32=false" in commands["zero2_bf16_m32"]
        assert "optimizer.zero2_grad_reduce=step" in commands["zero2_step_m32"]
        assert "parallel.bucket_size=160000000" in commands["zero2_b160_m32"]
        assert "grad_reduce_in_fp32" not in commands["zero2_m32"]
        assert "zero2_grad_reduce" not in commands["zero2_m32"] and "overlap_p2p_comm=false" in commands["pp2_batched"]
        assert f"train.global_batch_size={16 * gpus} " in commands["pp2"] + " "
        assert "model.output_loss_backend=chunked" in commands["pp2_chunked"]
        assert "output_loss_backend" not in commands["pp2"]


def test_context_parallel_runs_on_two_and_four_gpus(capsys):
    """The CP matrix: 32K and 128K, dense and DSA sparse, with and without documents, against the 1-GPU run of the
    same shape; CP = 4 only on 4 GPUs."""
    two = dry_run(capsys, "--only", "cp,cp_long")
    names = [line.split("]")[0][1:] for line in two.splitlines() if line.startswith("[")]
    assert "cp4_128k" not in names and {"gpu1_32k", "gpu1_32k_docs", "gpu1_32k_dsa", "gpu1_128k", "gpu1_128k_docs"} <= set(names)
    commands = {line.split("]")[0][1:]: line for line in two.splitlines() if line.startswith("[")}
    work = commands["cp2_128k_docs_work"]
    assert all(k in work for k in ("data.seq_length=131072", "data.reset_attention_mask=true",
                                   "parallel.cp_chunk_assignment=work", "model.cp_attention=merged",
                                   "parallel.context_parallel_size=2", "model.dsa_sparse_attention=true"))
    assert "reset_attention_mask" not in commands["cp2_128k"] and "--nproc-per-node 1 " in commands["gpu1_128k_docs"]
    four = dry_run(capsys, "--gpus", "4", "--only", "cp4_128k_docs_work")
    assert "parallel.context_parallel_size=4" in four and "[gpu1_128k_docs]" in four


def test_only_adds_the_baselines(capsys):
    out = dry_run(capsys, "--only", "ep_bal,tp")
    names = [line.split("]")[0][1:] for line in out.splitlines() if line.startswith("[")]
    assert names == ["gpu1", "gpu1_bal", "ep_bal", "tp2"]
    run = [line.split("]")[0][1:] for line in dry_run(capsys, "--only", "ep").splitlines() if line.startswith("[")]
    assert run == ["gpu1", "ep"]  # a run's name selects that run: no group shadows it


@pytest.mark.parametrize("argv, message", [(["--gpus", "3"], "--gpus must be 2 or 4"),
                                           (["--only", "ep9"], "unknown run or group 'ep9'"),
                                           (["--iters", "4"], "--iters must be at least 6")])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        scaling.main(["--out", "unused", "--dry-run", *argv])
    assert message in str(err.value) + capsys.readouterr().err


def fake_run(out, name, tokens_per_sec, a2a_us=None):
    run_dir = out / name
    (run_dir / "profile").mkdir(parents=True)
    rows = [{"step": s, "tokens_per_sec": tokens_per_sec if s >= 3 else 1.0, "mfu": 0.3, "mem_peak_gb": 10.0 + s}
            for s in range(1, 9)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if a2a_us is not None:
        events = [{"name": "ProfilerStep#7", "cat": "user_annotation", "dur": 1000},
                  {"name": "ProfilerStep#8", "cat": "user_annotation", "dur": 1000},
                  {"name": "ncclDevKernel_SendRecv(ncclDevComm*)", "cat": "kernel", "dur": a2a_us},
                  {"name": "ncclDevKernel_AllReduce_Sum_f32", "cat": "kernel", "dur": 700},
                  {"name": "sm90_gemm", "cat": "kernel", "dur": 900}]
        (run_dir / "profile" / "trace_rank0_steps7-8.json").write_text(json.dumps({"traceEvents": events}))


def test_table_ratios_and_all_to_all_share(tmp_path):
    runs = scaling.plan_runs(2, 4, [])
    fake_run(tmp_path, "gpu1", 1000.0)
    fake_run(tmp_path, "ep", 1800.0, a2a_us=500)
    meta = {"command": "python benchmarks/scaling.py --only ep", "gpu": "2 x test", "date": "today"}
    rows = [scaling.summarize(runs[name], tmp_path / name, 8) for name in ("gpu1", "ep")]
    assert rows[1]["comm_share"] == pytest.approx(0.25)  # 500 us of NCCL all-to-all in 2 x 1000 us
    assert rows[0]["tokens_per_sec_per_gpu"] == 1000.0 and rows[1]["tokens_per_sec_per_gpu"] == 900.0
    assert rows[1]["mem_peak_gb"] == 16.0  # steps 3 .. 6: the profiled steps 7-8 are left out
    scaling.write_tables(tmp_path, rows[:1], meta)  # main() records after every run, into one call
    text = scaling.write_tables(tmp_path, rows[1:], meta)
    assert "| ep | 2 | 900 | 0.90 | 30.0% | 16.0 GiB | 25% a2a | 0 |" in text and "2 x test" in text
    # a second call with its own baseline: the first call's runs keep their ratios only against their own call
    fake_run(tmp_path / "again", "gpu1", 500.0)
    again = scaling.summarize(runs["gpu1"], tmp_path / "again" / "gpu1", 8)
    text = scaling.write_tables(tmp_path, [again], dict(meta, command="second"))
    assert "| ep | 2 | 900 | - |" in text and "| gpu1 | 1 | 500 | 1.00 |" in text
    assert len(json.loads((tmp_path / "scaling.json").read_text())["calls"]) == 2


def test_breakdown_profiles_the_baselines_too(capsys, tmp_path):
    plain = dry_run(capsys, "--only", "ep")
    assert "logging.profile_step_start" not in [l for l in plain.splitlines() if l.startswith("[gpu1]")][0]
    out = dry_run(capsys, "--only", "ep", "--breakdown")
    assert "logging.profile_step_start=7" in [l for l in out.splitlines() if l.startswith("[gpu1]")][0]
    fake_run(tmp_path, "gpu1", 1000.0)  # a profiled baseline: its last two steps are left out of the medians
    row = scaling.summarize(scaling.plan_runs(2, 4, [])["gpu1"], tmp_path / "gpu1", 8, profiled=True)
    assert row["mem_peak_gb"] == 16.0
    scaling.write_breakdown(tmp_path / "gpu1", tmp_path / "gpu1.breakdown.md")  # no trace: says so
    assert "no rank-0 trace" in (tmp_path / "gpu1.breakdown.md").read_text()


def test_breakdown_table_from_a_trace(tmp_path):
    from tests.test_step_breakdown import synthetic_trace

    (tmp_path / "r" / "profile").mkdir(parents=True)
    (tmp_path / "r" / "profile" / "trace_rank0_steps7-8.json").write_text(json.dumps(synthetic_trace()))
    scaling.write_breakdown(tmp_path / "r", tmp_path / "r.breakdown.md")
    text = (tmp_path / "r.breakdown.md").read_text()
    assert "mla_proj" in text and "sm90_gemm_bwd" in text  # the part table and the largest kernels
    (tmp_path / "r" / "profile" / "trace_rank0_steps7-8.json").rename(tmp_path / "r" / "profile" / "trace_rank3_steps7-8.json")
    scaling.write_breakdown(tmp_path / "r", tmp_path / "r.rank3.breakdown.md", rank=3)  # another rank's trace
    assert "mla_proj" in (tmp_path / "r.rank3.breakdown.md").read_text()


def test_glm5_width_runs_have_their_own_configs(capsys):
    """The GLM-5-width slices run their configs at EP = N (width), TP = 2 x EP = N/2 (width_tp2, 4 GPUs) and CP = N
    (width_128k, mock windows: no corpus or tokenizer files), with no 1-GPU baseline (none fits one GPU)."""
    for gpus in (2, 4):
        out = dry_run(capsys, "--gpus", str(gpus), "--only", "glm5_width")
        commands = {line.split("]")[0][1:]: line for line in out.splitlines() if line.startswith("[")}
        assert set(commands) == ({"width", "width_128k"} | ({"width_tp2"} if gpus == 4 else set()))
        if gpus == 4:  # TP = 2 x EP = 2, expert TP 1 (alltoall_dedup), 8 micro-batches of 4 per DP rank (DP = 2)
            tp2 = commands["width_tp2"]
            assert all(f" {o}" in tp2 for o in ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                                               "parallel.expert_model_parallel_size=2", "train.global_batch_size=64"))
        width, long = commands["width"], commands["width_128k"]
        assert "--config configs/scaling/glm5-width.yaml " in width and "--config configs/scaling/glm5-width-128k.yaml " in long
        assert f"parallel.expert_model_parallel_size={gpus}" in width and f"--nproc-per-node {gpus} " in width
        assert f"train.global_batch_size={32 * gpus} " in width + " "  # 8 micro-batches of 4 per DP rank
        assert f"parallel.context_parallel_size={gpus}" in long and "train.global_batch_size=2 " in long + " "
        assert "data.mock=true" in long and "data.tokenizer=null" in long


def test_breakdown_of_named_runs_only(capsys):
    out = dry_run(capsys, "--only", "pp2,ep", "--breakdown", "pp2")
    lines = {line.split("]")[0][1:]: line for line in out.splitlines() if line.startswith("[")}
    assert "logging.profile_step_start=7" in lines["pp2"] and "logging.profile_step_start=7" in lines["ep"]  # EP: a2a
    assert "logging.profile_step_start" not in lines["gpu1"]
    # a pipeline's breakdown profiles both ends: rank 0 (first stage) and the last rank (last stage); the others one
    assert "logging.profile_ranks=[0,1]" in lines["pp2"] and "profile_ranks" not in lines["ep"]


def test_every_pipeline_run_gets_the_balanced_layout_when_named_alone(capsys):
    """pp2_chunked or pp2_batched without pp2 still run PP = 2 x VPP = 2 on the balanced layout (they ran plain PP = 2
    on megatron's even split when only pp2 triggered the layout)."""
    for name in ("pp2_chunked", "pp2_batched"):
        line = [l for l in dry_run(capsys, "--only", name).splitlines() if l.startswith(f"[{name}]")][0]
        assert "parallel.pipeline_model_parallel_layout=" in line and "virtual_pipeline_model_parallel_size=2" in line


def test_runs_use_the_given_devices_and_calibration(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert scaling.visible_devices() == ["2", "3"]  # a 2-GPU call on the second half of a 4-GPU host
    assert scaling.calibrated_kind("4 x NVIDIA H200") == "h200" and scaling.calibrated_kind("1 x NVIDIA H100 80GB HBM3") == "h100"
    assert scaling.calibrated_kind("2 x NVIDIA A100-SXM4-80GB") is None
