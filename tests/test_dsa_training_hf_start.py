"""An HF checkpoint as the start of DSA training: transformers' logits after conversion, and the conversion CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import List

import torch

from tests.dsa_helpers import (
    ROOT,
    convert,
    hf_dir,  # noqa: F401  (a module-scoped fixture)
    relative_error,
    saved_tensors,
    single_rank_model,
)

# ------------------------------------------------------------------------------------------------
# an HF checkpoint as the starting point
# ------------------------------------------------------------------------------------------------


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1), None)


def test_hf_to_checkpoint_starts_a_model_with_transformers_logits(hf_dir, tmp_path, capsys):
    from transformers import GlmMoeDsaForCausalLM

    from pretrain.config import load_config
    from pretrain.convert.cli import main as convert_cli
    from pretrain.training.pretrained import WEIGHTS_MARKER, load_pretrained_weights

    path, hf = hf_dir
    out = convert(path, tmp_path / "weights")
    assert (out / WEIGHTS_MARKER).is_file()
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.model.mtp_num_layers == 3 and cfg.model.dsa_sparse_attention  # the HF import sets both
    model = single_rank_model(cfg)
    assert load_pretrained_weights(str(out), [model]) == []  # the HF checkpoint has the indexers
    seq = 24
    assert hf.config.index_topk >= seq  # every causal key is selected: sparse attention is dense here
    ids = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = _logits(model, ids)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) <= 1e-5

    # the sparse regime: the same weights with index_topk below the sequence length
    sparse_hf_dir = tmp_path / "hf_sparse"
    shutil.copytree(path, sparse_hf_dir)
    config = json.loads((sparse_hf_dir / "config.json").read_text())
    config["index_topk"] = 6
    (sparse_hf_dir / "config.json").write_text(json.dumps(config))
    sparse_out = convert(sparse_hf_dir, tmp_path / "weights_sparse")
    sparse_cfg = load_config(str(sparse_out / "config.yaml"))
    assert sparse_cfg.model.dsa_sparse_attention and sparse_cfg.model.dsa_indexer_topk == 6
    sparse_model = single_rank_model(sparse_cfg)
    assert load_pretrained_weights(str(sparse_out), [sparse_model]) == []
    sparse_ref_model = GlmMoeDsaForCausalLM.from_pretrained(str(sparse_hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        sparse_ref = sparse_ref_model(ids).logits
    assert relative_error(_logits(sparse_model, ids), sparse_ref) <= 1e-5
    assert relative_error(sparse_ref, ref) > 1e-3  # top-6 of 24 keys really differs from dense

    # the CLI refuses an existing output directory, with a message and exit code 2
    capsys.readouterr()
    assert convert_cli(["hf-to-checkpoint", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and str(out) in err and "Traceback" not in err


def _run_killing_group(cmd: List[str], timeout: float) -> tuple:
    """(exit code or None on timeout, stderr); on timeout the command's whole process group (it and the
    writer processes it forked) is killed."""
    import signal

    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err


def test_hf_to_checkpoint_cli_finishes_without_psutil(hf_dir, tmp_path, capsys):
    """Regression (megatron's forked checkpoint writer hung without psutil before the writer patch).
    `python -m pretrain.convert.cli hf-to-checkpoint HF OUT` in a fresh process (about 5 s here when it
    works) exits 0 with the tensors of an in-process conversion; the CLI then refuses that OUT with 2 (in this
    process: the refusal needs no fresh one)."""
    path, _ = hf_dir
    cli_out = tmp_path / "weights_cli"
    cmd = [sys.executable, "-m", "pretrain.convert.cli", "hf-to-checkpoint", str(path), str(cli_out)]
    code, err = _run_killing_group(cmd, timeout=25)
    assert code is not None, f"hf-to-checkpoint did not finish in 25 s:\n{err[-2000:]}"
    assert code == 0, err[-2000:]
    a, b = saved_tensors(cli_out, tmp_path), saved_tensors(convert(path, tmp_path / "weights"), tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from pretrain.convert.cli import main as convert_cli

    capsys.readouterr()
    assert convert_cli(["hf-to-checkpoint", str(path), str(cli_out)]) == 2
    assert "exists" in capsys.readouterr().err
