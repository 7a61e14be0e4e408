"""benchmarks/multi_gpu_compare.py (the pass rule of the 4-GPU equivalence runs) and summarize_scaling.py, on
synthetic runs whose differences are written down here by hand."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import multi_gpu_compare as mgc

ROOT = Path(__file__).resolve().parents[1]


def write_run(out: Path, name: str, losses, grad_norms, tokens_per_sec=None):
    (out / name).mkdir(parents=True)
    with open(out / name / "metrics.jsonl", "w") as f:
        for step, (loss, g) in enumerate(zip(losses, grad_norms), start=1):
            row = {"step": step, "loss": loss, "grad_norm": g}
            if tokens_per_sec:
                row.update(tokens_per_sec=tokens_per_sec[step - 1], tflops_per_gpu=100.0, mfu=0.1, mem_peak_gb=10.0)
            f.write(json.dumps(row) + "\n")


def vec(values):
    return torch.tensor(values, dtype=torch.float64)


class FakeReader:
    """Weights per run as given; the compare code must pair them as W - W_ref over W_ref - W_0."""

    def __init__(self, weights):
        self.by_dir = weights

    def weights(self, ckpt: Path):
        return self.by_dir[ckpt.parent.name]

    def distance(self, a, b):
        return math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in a))


REF = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]


def write_runs(out: Path):
    write_run(out, "ref", REF, [1.0] * 7)
    write_run(out, "floor", [x + 1e-3 for x in REF], [1.01] * 7)  # floor: 1e-3 loss, 1% grad norm
    write_run(out, "good", [REF[0]] + [x - 2e-3 for x in REF[1:]], [1.0, 1.02] + [1.0] * 5)
    write_run(out, "bad", [x + 0.05 for x in REF], [1.0] * 7)
    write_run(out, "z2_fp32_micro", REF, [1.0] * 7)
    # resumed at step 5: steps 1-5 copied, 6-7 its own (step 7 off by 4e-3)
    write_run(out, "z2_resume_dp2", REF[:6] + [REF[6] + 4e-3], [1.0] * 7)


def test_losses_and_grad_norms_alone_without_weights(tmp_path):
    """--no-weights: the curves are judged by the same rule, the drift is neither measured nor required."""
    write_runs(tmp_path)
    rows = {r["run"]: r for r in mgc.compare(tmp_path, ["floor", "good", "bad", "z2_resume_dp2"], None)}
    assert all("drift" not in r for r in rows.values())
    assert rows["good"]["pass"] and not rows["bad"]["pass"]
    assert set(rows["good"]["tolerance"]) == {"loss_step1", "loss_max", "grad_norm_max"}
    assert rows["z2_resume_dp2"]["reference"] == "z2_fp32_micro"  # read although not listed in the runs


def test_measures_and_pass_rule(tmp_path):
    write_runs(tmp_path)
    w0 = {"a": torch.zeros(4, dtype=torch.float64)}
    w_ref = {"a": vec([3.0, 4.0, 0.0, 0.0])}  # moved by 5
    weights = {"init": w0, "ref": w_ref, "floor": {"a": vec([3.0, 4.0, 0.1, 0.0])},
               "good": {"a": vec([3.0, 4.0, 0.0, 0.2])}, "bad": {"a": vec([3.0, 4.0, 5.0, 0.0])},
               "z2_fp32_micro": w_ref, "z2_resume_dp2": {"a": vec([3.0, 4.0, 0.0, 0.05])}}
    table = mgc.compare(tmp_path, ["floor", "good", "bad", "z2_fp32_micro", "z2_resume_dp2"], FakeReader(weights))
    rows = {r["run"]: r for r in table}
    assert "pass" not in rows["floor"]
    assert math.isclose(rows["floor"]["drift"], 0.1 / 5)
    good = rows["good"]
    assert good["loss_step1"] == 0.0 and math.isclose(good["loss_max"], 2e-3, rel_tol=1e-6)
    assert math.isclose(good["grad_norm_max"], 0.02, rel_tol=1e-6) and math.isclose(good["drift"], 0.2 / 5)
    # tolerances: max(3 x floor, minimum): loss max(3e-3, 5e-3), grad norm max(3e-2, 3e-2), drift max(6e-2, 5e-2)
    assert math.isclose(good["tolerance"]["drift"], 0.06) and good["pass"]
    assert not rows["bad"]["pass"] and math.isclose(rows["bad"]["loss_max"], 0.05, rel_tol=1e-6)
    resumed = rows["z2_resume_dp2"]
    assert resumed["reference"] == "z2_fp32_micro" and resumed["steps"] == "6-7"
    assert resumed["loss_step1"] == 0.0 and math.isclose(resumed["loss_max"], 4e-3, rel_tol=1e-6)
    assert math.isclose(resumed["drift"], 0.05 / 5) and resumed["pass"]
    assert "| bad | ref |" in mgc.markdown(table) and "**no**" in mgc.markdown(table)


def test_summarize_scaling_baselines(tmp_path):
    write_run(tmp_path, "gpu1", [1.0] * 4, [1.0] * 4, [0, 0, 100.0, 100.0])
    write_run(tmp_path, "dp4", [1.0] * 4, [1.0] * 4, [0, 0, 360.0, 360.0])
    write_run(tmp_path, "gpu1_32k", [1.0] * 4, [1.0] * 4, [0, 0, 50.0, 50.0])
    write_run(tmp_path, "cp2dp2_32k", [1.0] * 4, [1.0] * 4, [0, 0, 100.0, 100.0])
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "summarize_scaling.py"), str(tmp_path), "gpu1",
                    "dp4:4", "gpu1_32k:1:gpu1_32k", "cp2dp2_32k:4:gpu1_32k"], check=True, capture_output=True)
    table = {r["run"]: r for r in json.loads((tmp_path / "scaling.json").read_text())}
    assert math.isclose(table["dp4"]["scaling_efficiency"], 0.9)  # 360 / 4 per GPU against 100
    assert math.isclose(table["gpu1_32k"]["scaling_efficiency"], 1.0)
    assert math.isclose(table["cp2dp2_32k"]["scaling_efficiency"], 0.5)  # 100 / 4 against 50
