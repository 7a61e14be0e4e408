"""The DSA continued-pretraining recipe via the trainer: warm-up freezing, micro-batches, weight-only starts, launch."""

# References the code under test does not compute itself:
#
# * the dense checkpoint's own saved tensors, read with torch.distributed.checkpoint directly (not
#   through megatron's loader), for what a warm-up loads;
# * the model's state dict before training, for what a frozen warm-up must leave untouched;
# * a run whose global batch is a single micro-batch, for the 2-micro-batch indexer gradient;
# * means computed here from metrics.jsonl, for the numbers of the recipe's report.

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import free_port, run_command_line, run_ranks_eager as run_ranks  # comparisons run in ranks
from tests.dsa_helpers import (
    ROOT,
    TINY,
    convert,
    hf_dir,  # noqa: F401  (a module-scoped fixture)
    is_indexer,
    relative_error,
    saved_tensors,
    single_rank_model,
)

WARMUP = ROOT / "configs/dsa/glm5-tiny-dsa-warmup.yaml"
SPARSE = ROOT / "configs/dsa/glm5-tiny-dsa-sparse.yaml"
DENSE_CONTINUE = ROOT / "configs/dsa/glm5-tiny-dense-continue.yaml"
# Every layer with attention: the two decoder layers and the (shared) MTP layer.
ATTENTION_LAYERS = ("decoder.layers.0.", "decoder.layers.1.", "mtp.layers.0.")
PER_LAYER = ("layer_01", "layer_02", "mtp")


def data_overrides(data: Path, seq: int = 64) -> List[str]:
    """The tiny model on the stdlib corpus of `stdlib_data` (no run dir, no checkpoint paths)."""
    return [
        "model.vocab_size=1024", f"data.seq_length={seq}", "data.mock=false", f"data.data_path=[{data / 'json'}]",
        f"data.tokenizer={data / 'tokenizer.json'}", "data.split=90,10,0",
    ]


def run_overrides(data: Path, run_dir: Path, *extra: str, seq: int = 64) -> List[str]:
    """A run in `run_dir` that neither loads nor saves anything unless `extra` says so (the recipe's
    configs point at runs/ in the repository, which may hold real checkpoints)."""
    return [
        *data_overrides(data, seq), "train.micro_batch_size=4", "train.global_batch_size=8", "train.eval_interval=null",
        "optimizer.lr_warmup_iters=0", "checkpoint.load=null", "checkpoint.save=null", "checkpoint.pretrained=null",
        f"logging.run_dir={run_dir}", "logging.log_interval=100", *extra,
    ]


def read_metrics(run_dir: Path) -> List[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def step_dir(ckpt: Path) -> Path:
    steps = sorted(ckpt.glob("iter_*"))
    assert steps, f"no step dir in {ckpt}"
    return steps[-1]


def saved_layout(name: str, tensor: torch.Tensor, saved: Dict[str, torch.Tensor]):
    """(checkpoint key, the model tensor in the checkpoint's layout). Grouped-GEMM expert weights are
    stored per expert as SequentialMLP's fc1 [E, 2F, H] / fc2 [E, H, F]; in memory weight1 holds
    [E, H, 2F] and weight2 [E, F, H]."""
    if name.endswith("mlp.experts.weight1"):
        key = name[: -len("weight1")] + "experts.linear_fc1.weight"
        e, _, h = saved[key].shape
        return key, tensor.reshape(e, h, -1).transpose(1, 2)
    if name.endswith("mlp.experts.weight2"):
        key = name[: -len("weight2")] + "experts.linear_fc2.weight"
        e, h, _ = saved[key].shape
        return key, tensor.reshape(e, -1, h).transpose(1, 2)
    return name, tensor


# ------------------------------------------------------------------------------------------------
# rank bodies (module level: run_ranks starts fresh rank processes that import them)
# ------------------------------------------------------------------------------------------------


def _train_stage(rank, world_size, config: str, overrides: List[str]) -> dict:
    """Build a Trainer (which loads checkpoint.pretrained), train, and report the model's state dict
    before and after training and which parameters were trainable."""
    from pretrain.config import load_config
    from megatron.core.utils import unwrap_model

    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(config, overrides))
    model = unwrap_model(trainer.model[0])

    def state():
        return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    before = state()
    params = sorted(n for n, _ in model.named_parameters())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    trainer.train()
    return {"before": before, "after": state(), "params": params, "trainable": trainable}


def _indexer_gradients(rank, world_size, overrides: List[str]) -> dict:
    """One warm-up train_step whose optimizer step only records the reduced gradients (main_grad)."""
    from pretrain.config import load_config
    from megatron.core.utils import unwrap_model

    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(str(WARMUP), overrides))
    model = unwrap_model(trainer.model[0])
    grads: Dict[str, torch.Tensor] = {}

    def record_step(grad_norm):
        for name, param in model.named_parameters():
            if param.requires_grad:
                grads[name] = param.main_grad.detach().clone()
        return True

    trainer.optimizer_step = record_step
    values = trainer.train_step()
    return {"grads": grads, "values": values, "num_microbatches": trainer.num_microbatches}


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_ckpt(stdlib_data, tmp_path_factory):
    """A dense MLA tiny model (no DSA, so no indexer tensors) trained 2 steps, checkpointed."""
    root = tmp_path_factory.mktemp("dense")
    run_ranks(_train_stage, 1, str(TINY), run_overrides(
        stdlib_data, root / "run", "model.experimental_attention_variant=null", "train.train_iters=2",
        f"checkpoint.save={root / 'ckpt'}"))
    return root / "ckpt"


# ------------------------------------------------------------------------------------------------
# 1. the recipe's stages through the trainer
# ------------------------------------------------------------------------------------------------


def test_warmup_freezes_all_but_the_indexer_then_sparse_and_dense_stages(stdlib_data, dense_ckpt, tmp_path):
    steps = 2
    saved = saved_tensors(step_dir(dense_ckpt), tmp_path)
    # The dense run really trained the MoE correction biases (they start at 0), so leaving them
    # unchanged below is the warm-up's doing.
    biases = [k for k in saved if k.endswith("router.expert_bias")]
    assert len(biases) == 2 and all(saved[k].abs().sum() > 0 for k in biases)

    warm_ckpt = tmp_path / "warmup_ckpt"
    warm = run_ranks(_train_stage, 1, str(WARMUP), run_overrides(
        stdlib_data, tmp_path / "warmup", f"train.train_iters={steps}", f"checkpoint.pretrained={dense_ckpt}",
        f"checkpoint.save={warm_ckpt}"))[0]
    before, after = warm["before"], warm["after"]
    indexer = sorted(k for k in before if is_indexer(k))
    others = sorted(k for k in before if not is_indexer(k))
    for prefix in ATTENTION_LAYERS:
        assert any(k.startswith(prefix) for k in indexer), f"no indexer in {prefix}"

    # loaded: every non-indexer tensor is the checkpoint's, bit for bit; the dense checkpoint has no
    # indexer tensors, and nothing it holds is left out
    model_weights = {k for k in saved if not k.startswith("optimizer.") and "_extra_state" not in k}
    assert not any(is_indexer(k) for k in saved)
    mapped = set()
    for name in others:
        key, value = saved_layout(name, before[name], saved)
        assert key in saved, f"{name} ({key}) is not in the dense checkpoint"
        assert torch.equal(value, saved[key]), f"{name} differs from the checkpoint's {key}"
        mapped.add(key)
    assert mapped == model_weights

    # trained: only indexer parameters; everything else (MoE expert biases included) bitwise unchanged
    assert warm["trainable"] == indexer
    assert any(k.endswith("router.expert_bias") for k in others)
    changed = [k for k in others if not torch.equal(before[k], after[k])]
    assert not changed, f"frozen tensors changed in the warm-up: {changed}"
    unchanged = [k for k in indexer if torch.equal(before[k], after[k])]
    assert not unchanged, f"indexer tensors did not train: {unchanged}"

    rows = read_metrics(tmp_path / "warmup")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert not r["skipped"] and math.isfinite(r["loss"])
        for key in ("indexer_loss", "topk_recall"):
            per_layer = [r[f"{key}/{label}"] for label in PER_LAYER]
            assert all(v is not None and math.isfinite(v) for v in [r[key], *per_layer]), (key, r)
            assert r[key] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-6)
        assert all(v >= 0 for v in [r["indexer_loss"], *(r[f"indexer_loss/{x}"] for x in PER_LAYER)])
        assert all(0.0 <= v <= 1.0 for v in [r["topk_recall"], *(r[f"topk_recall/{x}"] for x in PER_LAYER)])

    # the two later stages start from the warm-up's checkpoint, with the same data (a fresh run's data
    # iterator starts at sample 0) and the same number of steps (the same sample order)
    later = [f"train.train_iters={steps}", f"checkpoint.pretrained={warm_ckpt}"]
    sparse = run_ranks(_train_stage, 1, str(SPARSE), run_overrides(stdlib_data, tmp_path / "sparse", *later))[0]
    dense = run_ranks(_train_stage, 1, str(DENSE_CONTINUE), run_overrides(stdlib_data, tmp_path / "dense", *later))[0]
    for stage in (sparse, dense):
        # both load the warm-up's trained weights, indexer included
        assert set(stage["before"]) == set(after)
        assert all(torch.equal(stage["before"][k], after[k]) for k in after)
    # everything trains in the sparse stage; dense continuation (no indexer loss, nothing reads the
    # indexer) trains everything but the indexer
    assert sparse["trainable"] == sparse["params"]
    assert dense["trainable"] == [n for n in dense["params"] if not is_indexer(n)]
    sparse_rows, dense_rows = read_metrics(tmp_path / "sparse"), read_metrics(tmp_path / "dense")
    assert len(sparse_rows) == len(dense_rows) == steps
    for r in sparse_rows:
        assert r["indexer_loss"] is not None and math.isfinite(r["indexer_loss"]) and r["indexer_loss"] >= 0
        assert all(math.isfinite(r[f"indexer_loss/{x}"]) for x in PER_LAYER)
    # Dense continuation and the warm-up see the same first batch with the same non-indexer weights and
    # dense attention: the same LM loss. Sparse attention (top-16 of 64 keys) changes it.
    assert dense_rows[0]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)
    assert sparse_rows[0]["loss"] != pytest.approx(dense_rows[0]["loss"], rel=1e-6)


# ------------------------------------------------------------------------------------------------
# 2. the indexer loss's gradient over micro-batches
# ------------------------------------------------------------------------------------------------


def test_indexer_gradient_is_averaged_over_microbatches(stdlib_data, tmp_path):
    """Two micro-batches of 2 sequences and one of the same 4 sequences: the same indexer gradient
    (the KL is a token mean per micro-batch, every micro-batch has the same number of tokens). Without
    the 1/num_microbatches scale the first would be twice the second."""
    common = ["train.train_iters=1", "train.global_batch_size=4"]
    two = run_ranks(_indexer_gradients, 1, run_overrides(
        stdlib_data, tmp_path / "two", *common, "train.micro_batch_size=2", seq=32))[0]
    one = run_ranks(_indexer_gradients, 1, run_overrides(
        stdlib_data, tmp_path / "one", *common, "train.micro_batch_size=4", seq=32))[0]
    assert two["num_microbatches"] == 2 and one["num_microbatches"] == 1
    # the same tokens: the same LM loss and mean indexer loss
    assert two["values"]["loss"] == pytest.approx(one["values"]["loss"], rel=1e-6)
    assert two["values"]["indexer_loss"] == pytest.approx(one["values"]["indexer_loss"], rel=1e-5)
    # only the indexer has gradients (warm-up), and each of them is the single micro-batch's
    assert sorted(two["grads"]) == sorted(one["grads"])
    assert two["grads"] and all(is_indexer(k) for k in two["grads"])
    for prefix in ATTENTION_LAYERS:
        assert any(k.startswith(prefix) for k in two["grads"])
    for name, ref in one["grads"].items():
        assert ref.abs().max() > 0, name
        assert relative_error(two["grads"][name], ref) <= 1e-5, name


# ------------------------------------------------------------------------------------------------
# 3. load_pretrained_weights: what may be missing, and what may not
# ------------------------------------------------------------------------------------------------


def test_missing_tensors_other_than_the_indexer_are_errors(stdlib_data, dense_ckpt, hf_dir, tmp_path):
    from pretrain.config import load_config
    from pretrain.training.pretrained import load_pretrained_weights

    # positive control: a DSA model from the dense checkpoint; only the indexer is missing, and it
    # keeps its initialization while everything else takes the checkpoint's values
    model = single_rank_model(load_config(str(TINY), data_overrides(stdlib_data)))
    init = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    fresh = load_pretrained_weights(str(dense_ckpt), [model])
    assert sorted(fresh) == sorted(k for k in init if is_indexer(k)) and fresh
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], init[k]) for k in fresh)
    assert not torch.equal(loaded["embedding.word_embeddings.weight"], init["embedding.word_embeddings.weight"])

    # a deeper target: its third layer is nowhere in the 2-layer checkpoint
    deeper = load_config(str(TINY), [*data_overrides(stdlib_data), "model.num_layers=3",
                                     "model.moe_layer_freq=[0,1,1]"])
    with pytest.raises(RuntimeError, match=r"decoder\.layers\.2\."):
        load_pretrained_weights(str(dense_ckpt), [single_rank_model(deeper)])

    # an HF model converted without its MTP layer, into a target with MTP
    path, _ = hf_dir
    no_mtp = convert(path, tmp_path / "no_mtp", mtp_num_layers=None)
    plain_cfg = load_config(str(no_mtp / "config.yaml"))
    assert not plain_cfg.model.mtp_num_layers
    assert load_pretrained_weights(str(no_mtp), [single_rank_model(plain_cfg)]) == []  # positive control
    with_mtp = load_config(str(no_mtp / "config.yaml"), ["model.mtp_num_layers=3"])
    with pytest.raises(RuntimeError, match=r"mtp\.layers\.0\."):
        load_pretrained_weights(str(no_mtp), [single_rank_model(with_mtp)])

    with pytest.raises(FileNotFoundError, match="checkpoint.pretrained"):
        load_pretrained_weights(str(tmp_path / "nowhere"), [model])


def test_nonexistent_pretrained_fails_before_any_process_group(stdlib_data, tmp_path):
    # `python -m pretrain.train` in a process forked like a rank (`run_command_line`: torch and megatron-core
    # already imported), which also says whether a process group existed afterwards
    missing = tmp_path / "no_such_checkpoint"
    argv = ["--config", str(WARMUP), *run_overrides(stdlib_data, tmp_path / "run", f"checkpoint.pretrained={missing}")]
    got = run_command_line("pretrain.train", argv, cwd=str(ROOT))
    assert got["code"] == 2, got["stderr"][-2000:]
    assert "checkpoint.pretrained" in got["stderr"] and str(missing) in got["stderr"]
    assert "Traceback" not in got["stderr"] and not got["process_group"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# 4. the launch script
# ------------------------------------------------------------------------------------------------


def _launch(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "NPROC_PER_NODE": "1",
           "MASTER_PORT": str(free_port())}
    return subprocess.run(["bash", "launch/dsa_continued_pretraining.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _report_rows(text: str) -> Dict[str, tuple]:
    rows = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\| (.+?) \| (-?[\d.]+|nan) \| (-?[\d.]+|nan) \|", line.strip())
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_launch_script_runs_the_recipe_and_reports(stdlib_data, dense_ckpt, tmp_path):
    run = tmp_path / "recipe"
    steps = 4
    proc = _launch("--model", "glm5-tiny", "--from", str(dense_ckpt), "--run-dir", str(run), "--baseline",
                   "--discard-final", *data_overrides(stdlib_data, seq=32), f"train.train_iters={steps}",
                   "logging.log_interval=1")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    # the warm-up started from --from, the compared stages from the warm-up's checkpoint
    start = rf"started from the weights of {re.escape(str(dense_ckpt))}; \d+ DSA indexer tensors initialized fresh"
    assert re.search(start, proc.stdout)
    assert proc.stdout.count(f"started from the weights of {run / 'warmup' / 'checkpoints'}\n") == 2
    metrics = {name: read_metrics(run / name) for name in ("warmup", "sparse", "dense")}
    assert all([r["step"] for r in rows] == list(range(1, steps + 1)) for rows in metrics.values())
    # --discard-final: the compared stages save nothing; the warm-up keeps its checkpoint
    assert step_dir(run / "warmup" / "checkpoints")
    for name in ("sparse", "dense"):
        assert not (run / name / "checkpoints").exists()
        assert not list((run / name).rglob("iter_*")) and not list((run / name).rglob("*.distcp"))

    report = (run / "dsa_report.md").read_text()
    rows = _report_rows(report)
    window = 5  # the report's default: means over the first and last 5 logged steps

    def means(records, key):
        values = [r[key] for r in records]
        first, last = values[:window], values[-window:]
        return f"{sum(first) / len(first):.4f}", f"{sum(last) / len(last):.4f}"

    assert rows["warm-up indexer KL"] == means(metrics["warmup"], "indexer_loss")
    assert rows["warm-up top-k recall"] == means(metrics["warmup"], "topk_recall")
    assert rows["sparse stage LM loss"] == means(metrics["sparse"], "loss")
    assert rows["dense continuation LM loss"] == means(metrics["dense"], "loss")
    diff = re.search(r"sparse minus dense: ([-+][\d.]+)", report)
    assert diff, report
    sparse_mean, dense_mean = (sum(r["loss"] for r in metrics[n]) / steps for n in ("sparse", "dense"))
    assert float(diff.group(1)) == pytest.approx(sparse_mean - dense_mean, abs=1e-4)  # printed to 4 decimals


def test_launch_script_refuses_bad_arguments(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    proc = _launch("--model", "glm5-nonexistent", "--from", str(source), "--run-dir", str(tmp_path / "a"))
    assert proc.returncode == 2
    assert "configs/dsa/glm5-nonexistent-dsa-warmup.yaml not found" in proc.stderr and "glm5-tiny" in proc.stderr
    proc = _launch("--model", "glm5-tiny", "--from", str(tmp_path / "nowhere"), "--run-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "--from" in proc.stderr
    proc = _launch("--model", "glm5-tiny")
    assert proc.returncode == 2 and "usage" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
