"""Data errors are one line naming the key and the file, before any process group or model: in a run
(`pretrain.train`) and in a curriculum plan's validation (`python -m pretrain.curriculum --validate-only`)."""

import os
import subprocess
import sys

import pytest

from tests.distributed import run_command_lines
from tests.test_training import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _train_argv(run_dir, *overrides):
    return ["--config", "configs/models/glm5-tiny.yaml", f"logging.run_dir={run_dir}", "model.vocab_size=1024",
            "data.mock=false", *overrides]


@pytest.fixture(scope="module")
def refused(stdlib_data, tmp_path_factory):
    """The refused command lines of the tests below, in one process (`tests.distributed.run_command_lines`: torch and
    megatron-core imported once, not ~9 s per command line); the plan validation's own command line runs as a real
    process in test_plan_validation_checks_the_data_files."""
    root = tmp_path_factory.mktemp("preflight")
    prefix, tokenizer = stdlib_data / "json", f"data.tokenizer={stdlib_data / 'tokenizer.json'}"
    calls = {
        "min_length": ("pretrain.train", _train_argv(root / "min_length", f"data.data_path=[{prefix}]", tokenizer,
                                                     "data.min_document_length=[1000000]"), {}),
        "missing": ("pretrain.train", _train_argv(root / "missing", f"data.data_path=[{root / 'nowhere'}]", tokenizer),
                    {}),
        "plan_short": ("pretrain.curriculum", ["--validate-only", "--plan", "configs/curriculum/tiny.yaml",
                                               f"data.data_path=[{prefix}]", tokenizer, "data.mock=false",
                                               "model.vocab_size=1024", "data.min_document_length=[1000000]",
                                               f"run_dir={root / 'plan'}"], {}),
    }
    return root, run_command_lines(calls, cwd=str(ROOT))


def _one_line_before_any_work(got, run_dir, *needles):
    assert got["code"] == 2, got["stderr"][-3000:]
    # the framework's INFO notices (logging) may precede it; the error itself is one line
    lines = [line for line in got["stderr"].strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("config error: "), got["stderr"][-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in got["stderr"] and not got["process_group"]
    assert not (run_dir / "metrics.jsonl").exists()


def test_min_document_length_without_documents_fails_before_the_model(stdlib_data, refused):
    root, results = refused
    _one_line_before_any_work(results["min_length"], root / "min_length", "data.min_document_length",
                              str(stdlib_data / "json"), ">= 1000000 tokens")


def test_missing_prefix_fails_naming_it(refused):
    root, results = refused
    _one_line_before_any_work(results["missing"], root / "missing", "data.data_path", str(root / "nowhere"))


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


def test_plan_validation_names_the_stage_whose_data_is_short(refused):
    got = refused[1]["plan_short"]
    assert got["code"] == 2 and got["stderr"].count("\n") == 1, got["stderr"][-2000:]
    assert "stage ctx256" in got["stderr"] and "data.min_document_length" in got["stderr"]
    assert not got["process_group"]
