"""The ablation runner end to end on the CPU smoke sweep, and its refusals of bad sweep files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import DatasetWriter
from data_pipeline.retrieval_probe import filler_tokens, make_probe
from pretrain.ablate.__main__ import main
from pretrain.eval import mtp_accept, retrieval, retrieval_copy
from pretrain.ablate.sweep import SweepError, is_sweep_file, load_sweep
from tests.ablate_helpers import write_sweep

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/ablations/smoke.yaml"


def _losses(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


def test_smoke_sweep_runs_skips_finished_and_resumes_unfinished(tmp_path, capsys, monkeypatch):
    out = tmp_path / "smoke"
    # Both runs at once (--parallel 2); the resumed run below, alone, must continue their losses exactly.
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no_mps"))
    assert main([str(SMOKE), "--output-dir", str(out), "--parallel", "2"]) == 0
    printed = capsys.readouterr().out
    assert "note: no NVIDIA MPS daemon found, so the GPU takes turns between the 2 runs" in printed
    muon, adamw = out / "muon/seed1234", out / "adamw/seed1234"
    reference = {"muon": _losses(muon), "adamw": _losses(adamw)}
    assert len(reference["muon"]) == 6 and reference["muon"] != reference["adamw"]
    results = json.loads((out / "results.json").read_text())
    rows = {r["variant"]: r for r in results["variants"]}
    assert list(rows) == ["muon", "adamw"]
    # The table's numbers are the runs' own: final loss = the last logged loss, average over the last 3.
    for name, losses in reference.items():
        metrics = rows[name]["metrics"]
        assert metrics["final_loss"]["mean"] == losses[-1]
        assert metrics["avg_loss"]["mean"] == pytest.approx(sum(losses[-3:]) / 3)
        assert metrics["valid_loss"]["mean"] is not None and metrics["tokens_per_sec"]["mean"] > 0
        assert rows[name]["flags"] == []  # same model, same FLOPs
    assert "| muon |" in (out / "results.md").read_text() and "| muon |" in printed
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Interrupt adamw after its step-3 checkpoint: drop the final one, as a killed run leaves it.
    ckpt = adamw / "checkpoints"
    shutil.rmtree(ckpt / "iter_0000006")
    (ckpt / "latest").write_text(json.dumps({"step_dir": "iter_0000003", "iteration": 3}))
    assert main([str(SMOKE), "--output-dir", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "muon/seed1234: finished (6 iterations), skipped" in printed
    assert "adamw/seed1234: resumes from iteration 3" in printed
    assert printed.count("-m pretrain.train") == 1

    assert main([str(SMOKE), "--output-dir", str(out)]) == 0
    assert "resumed from" in (adamw / "train.log").read_text()
    assert _losses(adamw) == reference["adamw"]  # exact resume: the same losses as the uninterrupted run
    assert _losses(muon) == reference["muon"]


    # The evaluations on a finished run's checkpoint, through their command lines, land in the table.
    prefix = str(tmp_path / "heldout")
    with DatasetWriter(prefix, np.uint16) as writer:  # 100 documents: the last 3 are outside data.split's train share
        for doc in range(100):
            writer.add_document(np.random.default_rng(doc).integers(0, 8192, 40).astype(np.uint16))
        writer.close({})
    assert mtp_accept.main(["--checkpoint", str(muon / "checkpoints"), "--data", prefix, "--draft-tokens", "2",
                            "--samples", "2", "--prompt-tokens", "16", "--new-tokens", "4",
                            "--json", str(muon / "eval_mtp_accept.json")]) == 0
    # Past the 3 trained depths the shared layer drafts on (its checkpoint loads into a 4-depth model).
    deeper = tmp_path / "accept4.json"
    assert mtp_accept.main(["--checkpoint", str(muon / "checkpoints"), "--data", prefix, "--draft-tokens", "4",
                            "--samples", "2", "--prompt-tokens", "16", "--new-tokens", "4", "--json", str(deeper)]) == 0
    assert "depths 4..4 apply the model's one MTP layer again" in capsys.readouterr().out
    written = json.loads(deeper.read_text())
    assert written["mtp_depths_trained"] == 3 and set(written["metrics"]) == {f"accept_len@{n}" for n in (1, 2, 3, 4)}
    assert mtp_accept.main(["--checkpoint", str(muon / "checkpoints"), "--data", prefix, "--draft-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mtp_accept: --draft-tokens must be >= 1, got 0"
    probes = tmp_path / "probes.jsonl"
    encode = lambda s: [ord(c) for c in s]  # noqa: E731  (any ids below the vocabulary do)
    probes.write_text("".join(json.dumps(p) + "\n" for p in make_probe(encode, filler_tokens(encode, None, 200),
                                                                       [48, 64], samples=2)))
    assert retrieval.main(["--checkpoint", str(muon / "checkpoints"), "--probes", str(probes),
                           "--json", str(muon / "eval_retrieval.json")]) == 0
    copies = tmp_path / "copies.jsonl"
    copies.write_text("".join(json.dumps(p) + "\n" for p in make_probe(encode, filler_tokens(encode, None, 200),
                                                                        [64], samples=2, kind="copy")))
    assert retrieval_copy.main(["--checkpoint", str(muon / "checkpoints"), "--probes", str(copies),
                                "--json", str(muon / "eval_retrieval_copy.json")]) == 0
    assert main([str(SMOKE), "--output-dir", str(out), "--report"]) == 0
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["variants"]}
    accept = rows["muon"]["metrics"]["accept_len@2"]["mean"]
    assert 1.0 <= accept <= 3.0 and 1.0 <= rows["muon"]["metrics"]["accept_len@1"]["mean"] <= 2.0
    assert rows["muon"]["metrics"]["retrieval@64"]["mean"] in (0.0, 0.5, 1.0)
    assert rows["muon"]["metrics"]["copy@64"]["mean"] in (0.0, 0.5, 1.0) and "copy_nll@64" in rows["muon"]["metrics"]
    assert "accept_len@2" in (out / "results.md").read_text()


@pytest.mark.parametrize("body, message", [
    ("variants:\n  - {name: a, overrides: [model.num_layerz=2]}\n", "unknown key model.num_layerz"),
    ("variants:\n  - {name: a}\n  - {name: a}\n", "variant name 'a' appears twice"),
    ("variants:\n  - {name: a, base: nope.yaml}\n", "base config not found"),
    ("variants:\n  - {name: a, overrides: [train.seed=3]}\n", "set by the sweep runner"),
    ("variants:\n  - {name: a, overrides: ['checkpoint.pretrained={checkpoint:b}']}\n  - {name: b}\n",
     "must name an earlier variant"),
    ("variants:\n  - {name: a, overides: []}\n", "unknown key 'overides' in variant a"),
    ("report: {evals: {bleu: []}}\nvariants:\n  - {name: a}\n", "unknown evaluation 'bleu'"),
])
def test_bad_sweep_files_fail_before_any_run_with_one_line(tmp_path, capsys, body, message):
    path = write_sweep(tmp_path, body)
    with pytest.raises(SweepError, match=message.replace("(", r"\(")):
        load_sweep(path, tmp_path / "out")
    assert main([str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and err.startswith("sweep error:") and message in err, err
    assert not (tmp_path / "out").exists()


def test_command_line_reports_a_bad_sweep_in_one_line(tmp_path):
    path = write_sweep(tmp_path, "variants:\n  - {name: a, overrides: [model.hidden_sise=8]}\n")
    proc = subprocess.run([sys.executable, "-m", "pretrain.ablate", str(path), "--output-dir", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "sweep error: variant a (seed 1): unknown key model.hidden_sise" in proc.stderr


def test_token_budget_sets_iterations_and_dependencies_point_at_the_same_seed(tmp_path):
    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nvariants:\n  - {name: dense, tokens: 3000}\n"
                            "  - {name: cont, overrides: ['checkpoint.pretrained={checkpoint:dense}']}\n")
    sweep = load_sweep(path, tmp_path / "out")
    dense, cont = sweep.runs
    assert dense.train_iters == 3  # ceil(3000 / (8 x 128)) with glm5-tiny's batch and sequence
    assert cont.train_iters == 1 and cont.depends_on == "dense"
    assert f"checkpoint.pretrained={tmp_path / 'out/dense/seed1/checkpoints'}" in cont.overrides


SWEEPS = [p for p in sorted((ROOT / "configs/ablations").glob("*.yaml")) if is_sweep_file(p)]


def test_the_shipped_sweeps_are_found():
    full = {"attention", "dsa", "mtp", "optimizer"}
    assert {p.stem for p in SWEEPS} == full | {f"{n}-short" for n in full} | {"attention-pilot", "smoke"}


def _own_overrides(sweep):
    """Each variant's own overrides: what follows the sweep-level ones every variant starts with."""
    lists = [v.overrides for v in sweep.variants]
    shared = 0
    while all(len(o) > shared and o[shared] == lists[0][shared] for o in lists):
        shared += 1
    return {v.name: v.overrides[shared:] for v in sweep.variants}


@pytest.mark.parametrize("name", ["attention", "dsa", "mtp", "optimizer"])
def test_budget_sweeps_run_the_same_arms_as_the_full_ones(name):
    """A *-short sweep is its full sweep at a smaller budget: the same variants with the same own overrides
    (Muon vs AdamW: the full sweep runs the LRs that bracket each optimizer's best in the short one's search)."""
    folder = SWEEPS[0].parent
    full, short = load_sweep(folder / f"{name}.yaml"), load_sweep(folder / f"{name}-short.yaml")
    full_arms, short_arms = _own_overrides(full), _own_overrides(short)
    if name == "optimizer":
        assert len(full_arms) < len(short_arms)
        short_arms = {arm: short_arms.get(arm) for arm in full_arms}
    assert full_arms == short_arms
    iters = {r.variant: r.train_iters for r in full.runs}
    assert all(r.train_iters < iters[r.variant] for r in short.runs if r.variant in iters)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_shipped_sweeps_build_every_run_config(path):
    sweep = load_sweep(path)  # builds and validates every variant x seed config
    assert sweep.runs and all(r.train_iters >= 6 for r in sweep.runs)


def test_dry_runs_print_the_launch_commands(tmp_path, capsys):
    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nnproc_per_node: 2\nseeds: [1, 2]\nvariants:\n"
                            "  - {name: dense, seeds: [1]}\n"
                            "  - {name: cont, seeds: [1], overrides: ['checkpoint.pretrained={checkpoint:dense}']}\n"
                            "  - {name: other}\n")
    path.write_text(path.read_text().replace("seeds: [1]\nvariants", "variants", 1))
    out = str(tmp_path / "out")
    assert main([str(path), "--output-dir", out, "--dry-run", "--only", "dense", "other"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert lines == ["NPROC_PER_NODE=2 bash launch/train.sh --config configs/models/glm5-tiny.yaml "
                     f"optimizer.lr_warmup_iters=0 train.seed={seed} train.train_iters=1 "
                     f"logging.run_dir={out}/{name}/seed{seed} checkpoint.save={out}/{name}/seed{seed}/checkpoints "
                     "checkpoint.auto_resume=true" for name, seed in (("dense", 1), ("other", 1), ("other", 2))]
    assert main([str(path), "--output-dir", out, "--dry-run", "--only", "other", "--seeds", "2"]) == 0
    assert capsys.readouterr().out.count("launch/train.sh") == 1
    assert main([str(path), "--output-dir", out, "--dry-run", "--only", "cont"]) == 2
    assert "cont/seed1 starts from dense/seed1, which is not finished" in capsys.readouterr().err
    assert main([str(path), "--output-dir", out, "--dry-run", "--slurm"]) == 0
    sbatch = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sbatch")]
    assert len(sbatch) == 4 and all("--gpus-per-node=2" in s and " launch/slurm.sbatch --config" in s for s in sbatch)
    assert "'--dependency=afterok:<job id of dense/seed1>'" in sbatch[1] and "dependency" not in sbatch[0]


def test_report_flags_unfinished_runs_and_cuts_every_run_at_a_common_step(tmp_path):
    """An interrupted sweep: the plain report flags the runs short of their planned steps; `--at-step` reports
    every run as of one step (train loss average, last validation loss at or before it) and leaves out runs that
    had not reached it. The expected numbers are computed here from the records written."""
    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nreport: {average_last: 3}\n"
                            "variants:\n  - {name: a}\n  - {name: b}\n")
    path.write_text(path.read_text().replace("seeds: [1]", "seeds: [1, 2]").replace("tokens: 1024", "tokens: 10240"))
    sweep = load_sweep(path, tmp_path / "out")
    planned = sweep.runs[0].train_iters  # 10 with glm5-tiny's 8 x 128 tokens per step
    reached = {("a", 1): planned, ("a", 2): 7, ("b", 1): 8, ("b", 2): 4}
    loss = lambda v, s, k: 5.0 - 0.1 * k + 0.01 * s + (0.5 if v == "b" else 0.0)  # noqa: E731
    for run in sweep.runs:
        run.run_dir.mkdir(parents=True)
        rows = [{"step": k, "loss": loss(run.variant, run.seed, k), "tokens_per_sec": 100.0 * k, "mfu": 0.01,
                 "mem_peak_gb": 1.0, **({"valid_loss": 9.0 - k / 10 + run.seed} if k % 3 == 0 else {})}
                for k in range(1, reached[(run.variant, run.seed)] + 1)]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    from pretrain.ablate.report import collect

    rows = {r["variant"]: r for r in collect(sweep)["variants"]}
    assert rows["a"]["flags"] == [f"seed 2 unfinished: step 7 of {planned}"]
    assert rows["b"]["flags"] == [f"seed 1 unfinished: step 8 of {planned}", f"seed 2 unfinished: step 4 of {planned}"]

    cut = {r["variant"]: r for r in collect(sweep, at_step=6)["variants"]}
    for v in ("a", "b"):
        seeds = cut[v]["seeds"]
        want_avg = [np.mean([loss(v, s, k) for k in (4, 5, 6)]) for s in seeds]
        assert cut[v]["metrics"]["avg_loss"]["mean"] == pytest.approx(np.mean(want_avg))
        assert cut[v]["metrics"]["final_loss"]["mean"] == pytest.approx(np.mean([loss(v, s, 6) for s in seeds]))
        assert cut[v]["metrics"]["valid_loss"]["mean"] == pytest.approx(np.mean([8.4 + s for s in seeds]))
    assert cut["a"]["seeds"] == [1, 2] and cut["a"]["flags"] == []
    assert cut["b"]["seeds"] == [1] and cut["b"]["flags"] == [f"seed 2 left out: stopped at step 4 of {planned}"]
    assert cut["b"]["metrics"]["valid_loss"]["spread"] is None

    beyond = {r["variant"]: r for r in collect(sweep, at_step=planned + 5)["variants"]}  # past the planned end
    assert beyond["a"]["seeds"] == [1] and beyond["a"]["flags"] == [f"seed 2 left out: stopped at step 7 of {planned}"]
    assert beyond["a"]["metrics"]["final_loss"]["mean"] == pytest.approx(loss("a", 1, planned))

    # Evaluations: as of step 6, those of the step-6 checkpoint; at the end, those of the last one.
    a1 = next(r for r in sweep.runs if (r.variant, r.seed) == ("a", 1)).run_dir
    (a1 / "eval_probe_step6.json").write_text(json.dumps({"metrics": {"probe": 0.25}}))
    (a1 / "eval_probe.json").write_text(json.dumps({"metrics": {"probe": 0.75}}))
    assert collect(sweep, at_step=6)["variants"][0]["runs"]["1"]["probe"] == 0.25
    assert collect(sweep)["variants"][0]["runs"]["1"]["probe"] == 0.75

    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--report", "--at-step", "6"]) == 0
    assert "as of step 6" in (tmp_path / "out/results.md").read_text()
    assert (tmp_path / "out/loss_curves.png").stat().st_size > 0


def test_report_without_matplotlib_writes_the_table_and_says_how_to_get_the_plot(tmp_path, capsys, monkeypatch):
    """`pip install -e .` has no matplotlib: the report still writes results.md / results.json, and one printed
    line names the `plot` extra instead of a ModuleNotFoundError after the whole sweep has trained."""
    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nvariants:\n  - {name: a}\n")
    sweep = load_sweep(path, tmp_path / "out")
    for run in sweep.runs:
        run.run_dir.mkdir(parents=True)
        rows = [{"step": k, "loss": 5.0 - 0.1 * k, "tokens_per_sec": 100.0, "mfu": 0.01, "mem_peak_gb": 1.0}
                for k in range(1, run.train_iters + 1)]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--report"]) == 0
    printed = capsys.readouterr().out
    assert "| a |" in (tmp_path / "out/results.md").read_text() and "| a |" in printed
    assert json.loads((tmp_path / "out/results.json").read_text())["variants"][0]["variant"] == "a"
    assert not (tmp_path / "out/loss_curves.png").exists()
    hints = [line for line in printed.splitlines() if "matplotlib is" in line]
    assert hints == ["loss_curves.png not drawn: matplotlib is not installed (pip install -e '.[plot]', then "
                     "python -m pretrain.ablate SWEEP --report draws it)"]
