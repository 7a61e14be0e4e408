"""The pipeline bubble, measured against (p - 1) / (v m), and where the rest of the step goes.

One run = one layout through the trainer (mock data, the config's optimizer), on every rank:

    torchrun --nproc-per-node 2 benchmarks/pipeline_bubble.py --config configs/models/glm5-proxy.yaml \\
        --name pp2_vpp2 --out OUT_DIR -- parallel.pipeline_model_parallel_size=2 \\
        parallel.virtual_pipeline_model_parallel_size=2 train.global_batch_size=32
    python benchmarks/pipeline_bubble.py --summarize OUT_DIR     # the table, OUT_DIR/summary.md

`bash benchmarks/pipeline_bubble.sh OUT_DIR` runs one GPU and PP=2 with VPP 1 and 2, even and balanced
(`python -m pretrain.tools.pipeline_split`) layouts. Per step and rank, CUDA events around megatron's
`forward_step` / `backward_step` give the rank's busy time (per virtual chunk; a backward's chunk is the one whose
forward made the tensor it receives), the schedule's wall time
(the step minus the optimizer) holds it plus the rank's idle time, and `finalize_model_grads` is timed on
its own. Reported per run, medians over the steps after `--skip`:

    busy               forward + backward of all micro-batches and chunks, per pipeline rank
    even share         their mean: the schedule's length with the work spread evenly and no bubble
    imbalance          the busiest rank's busy time - the even share (what a balanced split gives back)
    predicted bubble   (p - 1) / (v m) x the busiest rank's busy time (equal stages, free transfers)
    simulated bubble   megatron's schedule run op by op with the measured per-chunk forward and backward times
                       (`pretrain.layout.pipeline_schedule`): the waits unequal stages cause, transfers free
    measured bubble    the schedule (step - optimizer - finalize) - the busiest rank's busy time
    rest               measured - simulated bubble: transfers, host stalls, what the schedule alone does not explain
    finalize           `finalize_model_grads` (data-parallel and embedding gradient reductions)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere


class StageTimes:
    """CUDA events around megatron's forward_step / backward_step (wrapped in this process only)."""

    def __init__(self):
        import torch
        from megatron.core.pipeline_parallel import schedules

        self.events = []  # (kind, chunk, start, end)
        self.cuda = torch.cuda.is_available()
        forward, backward = schedules.forward_step, schedules.backward_step

        owner = {}  # id(a forward's output tensor) -> its chunk: backward_step receives that tensor, not the chunk

        def timed(kind, fn):
            def run(*args, **kwargs):
                start, end = self._event(), None
                out = fn(*args, **kwargs)
                end = self._event()
                if kind == "forward":
                    chunk = kwargs.get("vp_stage") or 0
                    owner[id(out[0])] = chunk
                else:
                    chunk = owner.pop(id(args[1] if len(args) > 1 else kwargs.get("output_tensor")), 0)
                self.events.append((kind, chunk, start, end))
                return out
            return run

        schedules.forward_step = timed("forward", forward)
        schedules.backward_step = timed("backward", backward)

    def _event(self):
        import torch

        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def collect(self) -> dict:
        """Seconds per (kind, chunk) since the last call (after a synchronize)."""
        out = {}
        for kind, chunk, start, end in self.events:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            key = f"{kind}_chunk{chunk if chunk is not None else 0}"
            out[key] = out.get(key, 0.0) + seconds
        self.events = []
        return out


def run(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer
    from pretrain.training.metrics import synchronize

    compat.install()
    overrides = ["data.mock=true", "train.eval_interval=null", "logging.log_interval=1", "optimizer.lr_warmup_iters=1",
                 "optimizer.lr_decay_iters=null", "checkpoint.save=null",
                 f"logging.run_dir={args.out}/{args.name}", f"train.train_iters={args.steps}"] + args.overrides
    cfg = load_config(args.config, overrides)
    times = StageTimes()
    trainer = Trainer(cfg)
    config = unwrap_model(trainer.model[0]).config
    finalize_seconds = []
    finalize = config.finalize_model_grads_func

    def timed_finalize(*a, **k):
        synchronize()
        began = time.perf_counter()
        out = finalize(*a, **k)
        synchronize()
        finalize_seconds.append(time.perf_counter() - began)
        return out

    config.finalize_model_grads_func = timed_finalize
    rows = []
    for step in range(args.steps):
        synchronize()
        began = time.perf_counter()
        values = trainer.train_step()
        synchronize()
        wall = time.perf_counter() - began
        stages = times.collect()
        busy = sum(stages.values())
        fin = finalize_seconds.pop() if finalize_seconds else 0.0
        schedule = wall - values["optimizer_time_s"]
        rows.append({"step": step + 1, "wall_s": wall, "optimizer_s": values["optimizer_time_s"], "schedule_s": schedule,
                     "finalize_s": fin, "busy_s": busy, "idle_s": schedule - busy - fin, "loss": values["loss"],
                     **{f"{k}_s": v for k, v in stages.items()}})
    steady = rows[args.skip:]
    med = {k: statistics.median(r[k] for r in steady) for k in steady[0] if k != "step"}
    pp = ps.get_pipeline_model_parallel_world_size()
    result = {"name": args.name, "rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp": pp,
              "vpp": cfg.parallel.virtual_pipeline_model_parallel_size or 1, "microbatches": trainer.num_microbatches,
              "layout": cfg.parallel.pipeline_model_parallel_layout, "world_size": dist.get_world_size(),
              "microbatch_group": cfg.parallel.microbatch_group_size_per_vp_stage,
              "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_length,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "overrides": args.overrides, "median": med, "steps": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / f"{args.name}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f, indent=1)


def simulated_bubble(ranks: List[dict]) -> float:
    """The busiest rank's idle time in megatron's schedule run with the measured per-chunk times
    (`pretrain.layout.pipeline_schedule`): what unequal stages alone cost, transfers and host stalls left out."""
    from pretrain.layout.pipeline_schedule import simulate

    first = ranks[0]
    p, v, m = first["pp"], first["vpp"], first["microbatches"]
    if p == 1:
        return 0.0
    forward, backward = [0.0] * (p * v), [0.0] * (p * v)
    for r in ranks:
        for chunk in range(v):
            stage = chunk * p + r["pp_rank"]
            forward[stage] = r["median"].get(f"forward_chunk{chunk}_s", 0.0) / m
            backward[stage] = r["median"].get(f"backward_chunk{chunk}_s", 0.0) / m
    group = (first.get("microbatch_group") or p) if v > 1 else None
    sim = simulate(forward, backward, p, m, group=group)
    return sim.step - max(sim.busy)


def summarize(out: str) -> str:
    """One row per run: the schedule's time split into the work (spread evenly), the imbalance, the predicted
    bubble and the rest."""
    runs = {}
    for path in sorted(Path(out).glob("*.rank*.json")):
        r = json.loads(path.read_text())
        runs.setdefault(r["name"], []).append(r)
    one = next((rs for rs in runs.values() if rs[0]["world_size"] == 1), None)
    base = one[0]["tokens_per_step"] / one[0]["median"]["wall_s"] if one else None
    lines = ["| run | layout | m | busy s per rank | even share s | imbalance s | predicted bubble s | simulated bubble s "
             "| measured bubble s | rest s | finalize s | optimizer s | step s | tokens/s per GPU | vs 1 GPU |",
             "|" + " --- |" * 15]
    for name, ranks in runs.items():
        ranks = sorted(ranks, key=lambda r: r["pp_rank"])
        first, med = ranks[0], [r["median"] for r in ranks]
        p, v, m = first["pp"], first["vpp"], first["microbatches"]
        busy = [x["busy_s"] for x in med]
        share, busiest = sum(busy) / len(busy), max(busy)
        predicted = (p - 1) / (v * m) * busiest if p > 1 else 0.0
        simulated = simulated_bubble(ranks)
        schedule = max(x["schedule_s"] - x["finalize_s"] for x in med)
        bubble = schedule - busiest  # the busiest rank's idle time: fill, drain and transfers it waits for
        step = max(x["wall_s"] for x in med)
        per_gpu = first["tokens_per_step"] / step / first["world_size"]
        ratio = f"{per_gpu / base:.2f}" if base else "-"
        lines.append(f"| {name} | {first['layout'] or 'even'} | {m} | {' / '.join(f'{b:.3f}' for b in busy)} | "
                     f"{share:.3f} | {busiest - share:.3f} | {predicted:.3f} | {simulated:.3f} | {bubble:.3f} | "
                     f"{bubble - simulated:.3f} | "
                     f"{max(x['finalize_s'] for x in med):.3f} | {max(x['optimizer_s'] for x in med):.3f} | {step:.3f} | "
                     f"{per_gpu:,.0f} | {ratio} |")
    table = "\n".join(lines)
    (Path(out) / "summary.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--name")
    parser.add_argument("--out", required=False)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    parser.add_argument("--summarize", metavar="OUT_DIR")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    run(args)


if __name__ == "__main__":
    main()
