"""Data errors are one line naming the key and the file, before any process group or model: in a run
(`pretrain.train`) and in a curriculum plan's validation (`python -m pretrain.curriculum --validate-only`)."""

import os
import subprocess
import sys

from tests.test_training import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _train(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--config", "configs/models/glm5-tiny.yaml",
         f"logging.run_dir={tmp_path}", "model.vocab_size=1024", "data.mock=false", *overrides],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )


def _one_line_before_any_work(proc, tmp_path, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the framework's INFO notices (logging) may precede it; the error itself is one line
    lines = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "[rank0]" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_min_document_length_without_documents_fails_before_the_model(stdlib_data, tmp_path):
    prefix = stdlib_data / "json"
    proc = _train(tmp_path, f"data.data_path=[{prefix}]", f"data.tokenizer={stdlib_data / 'tokenizer.json'}",
                  "data.min_document_length=[1000000]")
    _one_line_before_any_work(proc, tmp_path, "data.min_document_length", str(prefix), ">= 1000000 tokens")


def test_missing_prefix_fails_naming_it(stdlib_data, tmp_path):
    proc = _train(tmp_path, f"data.data_path=[{tmp_path / 'nowhere'}]", f"data.tokenizer={stdlib_data / 'tokenizer.json'}")
    _one_line_before_any_work(proc, tmp_path, "data.data_path", str(tmp_path / "nowhere"))


def _validate(*args):
    return subprocess.run([sys.executable, "-m", "pretrain.curriculum", "--validate-only", *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_plan_validation_checks_the_data_files():
    """The 744B plan's data lives on the cluster: here its validation fails on the first missing file,
    and with --skip-data-check it passes and says, in one line, what it did not check."""
    plan = "configs/curriculum/glm5-744b.yaml"
    proc = _validate("--plan", plan)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"plan error: plan {plan}, stage pretrain-ramp: ")
    assert "data.tokenizer ('data/glm5/tokenizer.json') does not exist" in proc.stderr
    skipped = _validate("--skip-data-check", "--plan", plan)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert skipped.stdout.count("data not checked (--skip-data-check)") == 1


def test_plan_validation_names_the_stage_whose_data_is_short(stdlib_data, tmp_path):
    data = [f"data.data_path=[{stdlib_data / 'json'}]", f"data.tokenizer={stdlib_data / 'tokenizer.json'}",
            "data.mock=false", "model.vocab_size=1024", "data.min_document_length=[1000000]", f"run_dir={tmp_path}"]
    proc = _validate("--plan", "configs/curriculum/tiny.yaml", *data)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "stage ctx256" in proc.stderr and "data.min_document_length" in proc.stderr
