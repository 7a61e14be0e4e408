"""Record this CPU kind's golden loss sequences (`python -m tests.golden.record`); see tests/test_golden.py.

Each CPU kind (`cpu_fingerprint`) keeps its own recording in losses.json, so the test is bit for bit on
every kind recorded; recording here replaces this kind's entry and keeps the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("losses.json")
STEPS = 20

_COMMON = [f"train.train_iters={STEPS}", "data.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4",
           "train.eval_interval=null", "optimizer.lr_warmup_iters=5", "logging.log_interval=100"]
_MUON = ["optimizer.optimizer=muon", "optimizer.lr=2e-2", "optimizer.muon_ns_dtype=float32"]
_DSA_SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_topk=16", "model.dsa_indexer_loss_coeff=1e-2",
               "model.dsa_indexer_use_sparse_loss=true"]
VARIANTS = {
    "adamw_dense": [],
    "muon_dense": _MUON,
    "adamw_dsa_sparse": _DSA_SPARSE,
    "muon_dsa_sparse": _MUON + _DSA_SPARSE,
}


def cpu_fingerprint() -> str:
    """What decides the CPU kernels' floating-point summation order: torch's vector ISA level and the matrix /
    dot-product extensions oneDNN and MKL pick kernels by. Goldens match bit for bit only on the same one."""
    import torch

    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni"))
    return f"{torch.backends.cpu.get_cpu_capability()}:{','.join(wanted)}"


def variant_argv(name: str, run_dir: Path) -> list:
    """The arguments of `python -m pretrain.train` that train variant `name` for STEPS steps in `run_dir`."""
    return ["--config", str(ROOT / "configs/models/glm5-tiny.yaml"), *_COMMON, f"logging.run_dir={run_dir}",
            *VARIANTS[name]]


def read_run(run_dir: Path) -> dict:
    """The loss and grad norm per step of a finished variant's run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}


def run_variant(name: str, run_dir: Path) -> dict:
    """Train the tiny model for STEPS steps through `python -m pretrain.train`; the loss and grad norm per step."""
    args = [sys.executable, "-m", "pretrain.train", *variant_argv(name, run_dir)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return read_run(run_dir)


def load_goldens() -> dict:
    """{cpu fingerprint: {variant: {"loss": [...], "grad_norm": [...]}}}, one recording per CPU kind."""
    return json.loads(GOLDEN.read_text())["by_cpu"] if GOLDEN.exists() else {}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.golden.record", description=__doc__)
    parser.add_argument("--drop-other-cpus", action="store_true",
                        help="forget the other CPU kinds' recordings (after a change meant to alter numerics, for "
                             "those that cannot be re-recorded on their own CPU now)")
    args = parser.parse_args(argv)
    goldens = {} if args.drop_other_cpus else load_goldens()
    fingerprint = cpu_fingerprint()
    goldens[fingerprint] = {}
    for name in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            goldens[fingerprint][name] = run_variant(name, Path(tmp))
        print(name, goldens[fingerprint][name]["loss"][0], "->", goldens[fingerprint][name]["loss"][-1], flush=True)
    GOLDEN.write_text(json.dumps({"by_cpu": goldens}, indent=1) + "\n")
    print(f"recorded {fingerprint} in {GOLDEN} (recordings of {len(goldens)} CPU kinds)")


if __name__ == "__main__":
    main()
