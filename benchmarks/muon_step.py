"""Optimizer cost of Muon vs AdamW inside the training loop (bf16, glm5-proxy by default), on one GPU
or data-parallel over several (`--nproc N`: one torchrun launch per variant).

    python benchmarks/muon_step.py --config configs/models/glm5-proxy.yaml --out muon_step.json
    python benchmarks/muon_step.py --nproc 4 --variants adamw_distopt,muon_split,muon_zero2 \
        --out muon_step_dp4.json train.global_batch_size=128

For each optimizer variant a Trainer runs `--steps` training steps on mock tokens after `--warmup`
steps; reported per step (medians; with several ranks the slowest rank's time of each step): the
whole step, the optimizer's `step()` alone, and the optimizer's share of the step; peak memory and
the gradient storage a rank holds: the most bytes of distinct storages behind gradient tensors
(every parameter's `.main_grad` / `.grad`, megatron DDP's buffers, ZeRO-2's owned and in-flight
reduce buckets), measured after each parameter's gradient arrives and when the optimizer steps,
during the warm-up steps (which the timings exclude). Then Newton-Schulz alone on the model's Muon matrices as the
optimizer batches them (blocks of equal shape in one batched call), with its TFLOP/s: per iteration
on X [m, n] (m <= n) 4 m^2 n + 2 m^3 (single process only).

`--overlap-probe` (one CUDA GPU) asks whether Muon's Newton-Schulz could hide behind the next step's forward and
backward: one training step with the optimizer's step skipped, Newton-Schulz alone, and both at once (Newton-Schulz
on a side stream, launched just before the step), medians of `--steps` each; `hidden` is the share of Newton-Schulz
time that running them together saved.
Timings use wall clock around synchronized CUDA work (CPU runs, for a smoke test, also work).

ZeRO-2 at many micro-batches per step (`optimizer.zero2_grad_reduce`), 2 GPUs, 32 micro-batches per rank:

    python benchmarks/muon_step.py --nproc 2 --steps 4 --warmup 1 \
        --variants muon_split,muon_zero2,muon_zero2_step,muon_zero2_scatter,muon_zero2_scatter_bf16 \
        --out muon_step_dp2_zero2_mb32.json train.micro_batch_size=1 train.global_batch_size=64 data.seq_length=2048

adds per variant: `vs_ddp` (tokens/s over `muon_split`'s, DDP + Muon), the optimizer's allocated state
(momentum, moments, fp32 main weights: distinct storages) at the end, and for data-parallel runs
`grad_comm_ms`: one micro-batch's gradient traffic alone (ZeRO-2: every bucket's reduce or
reduce-scatter; DDP: the all-reduce of its buffers), to set against the step's time per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from pretrain.training.metrics import allocated_grad_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ZERO2 = ["optimizer.use_distributed_optimizer=true"]
VARIANTS = {
    "adamw": ["optimizer.optimizer=adam"],
    "adamw_distopt": ["optimizer.optimizer=adam", *ZERO2],  # megatron-core's distributed optimizer
    "muon_split": ["optimizer.optimizer=muon", "optimizer.muon_split=true"],
    "muon_whole": ["optimizer.optimizer=muon", "optimizer.muon_split=false"],
    "muon_glu_whole": ["optimizer.optimizer=muon", "optimizer.muon_split=true", "optimizer.muon_split_glu=false"],
    "muon_glu_split": ["optimizer.optimizer=muon", "optimizer.muon_split=true", "optimizer.muon_split_glu=true"],
    "muon_split_unfused": ["optimizer.optimizer=muon", "optimizer.muon_split=true"],  # torch elementwise ops
    "muon_zero2": ["optimizer.optimizer=muon", "optimizer.muon_split=true", *ZERO2],
    "muon_zero2_bf16": ["optimizer.optimizer=muon", "optimizer.muon_split=true", *ZERO2,
                        "parallel.grad_reduce_in_fp32=false"],
    "muon_zero2_step": ["optimizer.optimizer=muon", "optimizer.muon_split=true", *ZERO2,
                        "optimizer.zero2_grad_reduce=step"],
    "muon_zero2_scatter": ["optimizer.optimizer=muon", "optimizer.muon_split=true", *ZERO2,
                           "optimizer.zero2_grad_reduce=microbatch_scatter"],
    "muon_zero2_scatter_bf16": ["optimizer.optimizer=muon", "optimizer.muon_split=true", *ZERO2,
                                "optimizer.zero2_grad_reduce=microbatch_scatter", "parallel.grad_reduce_in_fp32=false"],
}
BASELINE = "muon_split"  # DDP + Muon: the reference of `vs_ddp` when it is among the variants


UNFUSED = {"muon_split_unfused"}  # Muon's momentum/staging and decay/update as torch ops, not the fused kernels


def muon_optimizers(opt) -> list:
    """The `pretrain.optim.muon.Muon` instances inside the trainer's (chained, wrapped) optimizer."""
    from pretrain.optim.muon import Muon
    from pretrain.optim.roles import sub_optimizers

    return [sub.optimizer for sub in sub_optimizers(opt) if isinstance(getattr(sub, "optimizer", None), Muon)]


class GradMemoryProbe:
    """The most gradient storage seen after any parameter's gradient arrived (hooks run after the
    wrappers' own, which reduce or free it) and at the optimizer step."""

    def __init__(self, trainer):
        self.chunks, self.peak = trainer.model, 0
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _: self.sample())
                      for chunk in self.chunks for p in chunk.module.parameters() if p.requires_grad]

    def sample(self) -> None:
        self.peak = max(self.peak, allocated_grad_bytes(self.chunks))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def run(config: str, name: str, extra, steps: int, warmup: int, overlap_probe: bool = False) -> dict:
    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    compat.install()
    over = ["data.mock=true", f"train.train_iters={steps + warmup}", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
            "logging.log_interval=1000", f"logging.run_dir=/tmp/muon_step_{name}", "checkpoint.save=null",
            *VARIANTS[name], *extra]
    trainer = Trainer(load_config(config, over))
    if name in UNFUSED:
        found = muon_optimizers(trainer.optimizer)
        assert found, "no Muon optimizer found to run unfused"
        for muon in found:
            muon.fused_elementwise = False
    opt_ms, step_ms = [], []
    original = trainer.optimizer_step  # clip by the loop's gradient norm, then update
    probe = GradMemoryProbe(trainer)  # walks storages: only while warming up (untimed)

    def timed_step(grad_norm):
        if probe.hooks:
            probe.sample()
        _sync()
        t0 = time.perf_counter()
        out = original(grad_norm)
        _sync()
        opt_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    trainer.optimizer_step = timed_step
    for i in range(steps + warmup):
        if i == max(warmup, 1):
            probe.remove()
        _sync()
        t0 = time.perf_counter()
        trainer.train_step()
        _sync()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        trainer.iteration += 1
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    probe.remove()
    grads = probe.peak / 2**30
    grads_now = allocated_grad_bytes(trainer.model) / 2**30
    opt_state = optimizer_state_bytes(trainer.optimizer) / 2**30
    world, comm_ms = 1, 0.0
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        world = torch.distributed.get_world_size()
        comm_ms = grad_comm_ms(trainer)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.tensor([*opt_ms, *step_ms, peak, grads, grads_now, opt_state, comm_ms], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the slowest (fullest) rank
        t = t.tolist()
        opt_ms, step_ms = t[:len(opt_ms)], t[len(opt_ms):-5]
        peak, grads, grads_now, opt_state, comm_ms = t[-5:]
    opt, step = statistics.median(opt_ms[warmup:]), statistics.median(step_ms[warmup:])
    result = {"variant": name, "world_size": world, "step_ms": step, "optimizer_step_ms": opt,
              "optimizer_share": opt / step, "peak_mem_gib": peak, "grad_storage_gib": grads,
              "grad_allocated_gib": grads_now, "optimizer_state_gib": opt_state,
              "micro_batches": trainer.cfg.train.global_batch_size // (trainer.cfg.train.micro_batch_size * world),
              "grad_comm_ms": comm_ms, "tokens_per_s": trainer.timer.tokens_per_step / step * 1e3}
    if name.startswith("muon") and world == 1:
        result["newton_schulz"] = newton_schulz_bench(trainer)
        if overlap_probe:
            result["overlap"] = overlap_bench(trainer, original, steps)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def optimizer_state_bytes(opt) -> int:
    """Bytes of distinct storages behind the optimizer's state tensors and fp32 main weights (those of
    parameters another ZeRO-2 rank owns are freed to empty storage)."""
    from pretrain.optim.roles import sub_optimizers

    storages = {}
    for sub in sub_optimizers(opt):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        tensors = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        for group in getattr(sub, "fp32_from_float16_groups", []):
            tensors += list(group)
        for t in tensors:
            if t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def grad_comm_ms(trainer, reps: int = 3) -> float:
    """One micro-batch's gradient traffic alone, median of `reps`: every ZeRO-2 bucket's reduce (or
    reduce-scatter) of zeros in its reduce dtype, or DDP's all-reduce of each gradient buffer. The
    gradients themselves are untouched."""
    samples = []
    for _ in range(reps + 1):
        _sync()
        t0 = time.perf_counter()
        for chunk in trainer.model:
            if hasattr(chunk, "param_owner"):  # ZeRO-2
                buckets = [b for b in chunk.buckets if b.group.size() > 1]
                for b in buckets:
                    b.comm = torch.zeros(b.numel, dtype=b.reduce_dtype, device=b.param_data.device)
                    b.start_reduce()
                for b in buckets:
                    b.work.wait()
                    b.work, b.comm = None, None
            else:  # megatron DDP
                for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]:
                    scratch = torch.zeros_like(buf.grad_data)
                    torch.distributed.all_reduce(scratch, group=buf.data_parallel_group)
        _sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples[1:])


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ns_batches(trainer) -> list:
    """Random bf16 stand-ins for this rank's Muon matrices, batched as the optimizer batches them: blocks of one
    shape from every matrix in one call, up to `NS_BATCH_ELEMENTS` each (TP-gathered matrices aside)."""
    from pretrain.optim import muon_roles
    from pretrain.optim.muon import NS_BATCH_ELEMENTS, stage_batches

    blocks = []
    for p, role, split in muon_roles(trainer.optimizer):
        if role == "muon":
            blocks.extend(split.blocks(p.detach()) if split is not None else [p.detach()[None]])
    shapes = [(b.shape[0], *sorted(b.shape[-2:])) for b in blocks]
    return [torch.randn(sum(shapes[i][0] for i in batch), *shapes[batch[0]][1:], device=blocks[0].device,
                        dtype=torch.bfloat16) for batch in stage_batches(shapes, NS_BATCH_ELEMENTS)]


def newton_schulz_bench(trainer) -> dict:
    """Newton-Schulz on this rank's Muon matrices as the optimizer batches them (`ns_batches`), with TFLOP/s."""
    from pretrain.optim import newton_schulz

    batches = ns_batches(trainer)
    steps = trainer.cfg.optimizer.muon_num_ns_steps
    flops = sum(x.shape[0] * steps * (4 * x.shape[1] ** 2 * x.shape[2] + 2 * x.shape[1] ** 3) for x in batches)
    for x in batches:  # warm-up
        newton_schulz(x, steps)
    _sync()
    t0 = time.perf_counter()
    for x in batches:
        newton_schulz(x, steps)
    _sync()
    ms = (time.perf_counter() - t0) * 1e3
    return {"calls": len(batches), "ms": ms, "tflops": flops / ms / 1e9, "tflop": flops / 1e12}


def overlap_bench(trainer, optimizer_step, reps: int) -> dict:
    """Medians over `reps` of: a training step whose optimizer step is skipped (forward + backward, gradient
    handling), Newton-Schulz on the model's Muon matrices alone, and both at once with Newton-Schulz on a side
    stream launched just before the step. hidden = (step + ns - both) / ns."""
    from pretrain.optim import newton_schulz

    batches, ns_steps = ns_batches(trainer), trainer.cfg.optimizer.muon_num_ns_steps
    side = torch.cuda.Stream()

    def ns():
        for x in batches:
            newton_schulz(x, ns_steps)

    def step():
        trainer.train_step()

    def concurrent():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ns()
        step()
        torch.cuda.current_stream().wait_stream(side)

    # forward + backward and gradient handling, no update: the weights stay as they are
    trainer.optimizer_step = lambda grad_norm: True
    try:
        times = {}
        for name, fn in (("step_ms", step), ("ns_ms", ns), ("both_ms", concurrent)):
            fn()  # warm-up
            samples = []
            for _ in range(reps):
                _sync()
                t0 = time.perf_counter()
                fn()
                _sync()
                samples.append((time.perf_counter() - t0) * 1e3)
            times[name] = statistics.median(samples)
    finally:
        trainer.optimizer_step = optimizer_step
    times["hidden"] = (times["step_ms"] + times["ns_ms"] - times["both_ms"]) / times["ns_ms"]
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/models/glm5-proxy.yaml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="adamw,muon_split,muon_whole")
    ap.add_argument("--out", default=None)
    ap.add_argument("--nproc", type=int, default=1, help="GPUs per variant (one torchrun launch each)")
    ap.add_argument("--overlap-probe", action="store_true",
                    help="Muon variants: can Newton-Schulz hide behind the next step's forward + backward "
                         "(one CUDA GPU)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if args.overlap_probe and (args.nproc != 1 or not torch.cuda.is_available()):
        ap.error("--overlap-probe needs one CUDA GPU (--nproc 1): it times CUDA streams")
    if len(variants) == 1 and args.nproc == 1:
        results = [run(args.config, variants[0], args.overrides, args.steps, args.warmup, args.overlap_probe)]
        if int(os.environ.get("RANK", "0")) != 0:
            return
    else:  # one process per variant: nothing of one run's model or optimizer survives into the next
        import subprocess
        import tempfile

        results = []
        for v in variants:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                launcher = [sys.executable] if args.nproc == 1 else [
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
                subprocess.run([*launcher, __file__, "--config", args.config, "--steps", str(args.steps),
                                "--warmup", str(args.warmup), "--variants", v, "--out", tmp.name,
                                *(["--overlap-probe"] if args.overlap_probe else []), *args.overrides],
                               check=True)
                with open(tmp.name) as f:
                    results.extend(json.load(f)["results"])
    record = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d"), "config": args.config,
              "overrides": args.overrides, "results": results}
    base = next((r["tokens_per_s"] for r in results if r["variant"] == BASELINE), math.nan)
    for r in results:
        r["vs_ddp"] = r["tokens_per_s"] / base
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{'variant':<24}{'GPUs':>5}{'mb':>4}{'step ms':>10}{'opt ms':>9}{'share':>7}{'tok/s':>10}{'vs DDP':>7}"
          f"{'comm/mb ms':>11}{'NS TFLOP/s':>11}{'peak GiB':>9}{'grad peak':>10}{'grad now':>9}{'opt state':>10}")
    for r in results:
        ns = r.get("newton_schulz", {}).get("tflops", math.nan)
        print(f"{r['variant']:<24}{r['world_size']:>5}{r['micro_batches']:>4}{r['step_ms']:>10.1f}"
              f"{r['optimizer_step_ms']:>9.1f}{r['optimizer_share']:>7.1%}{r['tokens_per_s']:>10.0f}{r['vs_ddp']:>7.3f}"
              f"{r['grad_comm_ms']:>11.1f}{ns:>11.1f}{r['peak_mem_gib']:>9.2f}{r['grad_storage_gib']:>10.2f}"
              f"{r['grad_allocated_gib']:>9.2f}{r['optimizer_state_gib']:>10.2f}")
    for r in results:
        if "overlap" in r:
            o = r["overlap"]
            print(f"{r['variant']}: step without optimizer {o['step_ms']:.1f} ms, Newton-Schulz {o['ns_ms']:.1f} ms, "
                  f"both at once {o['both_ms']:.1f} ms: {o['hidden']:.0%} of Newton-Schulz hidden")


if __name__ == "__main__":
    main()
