"""Re-measure the layout planner's calibration table on one GPU kind, in the format pretrain.layout.timing reads.

    python benchmarks/layout_calibration.py \
        --out benchmarks/results/layout_calibration_h200/layout_calibration_h200.json
    torchrun --nproc-per-node 4 benchmarks/layout_calibration.py --collectives-only \
        --base benchmarks/results/layout_calibration_h200/layout_calibration_h200.json \
        --out benchmarks/results/layout_calibration_h200/layout_calibration_h200.json
    python benchmarks/layout_calibration.py --device cpu --smoke --out /tmp/calib.json    # CPU rehearsal, tiny sizes

One process (plain `python`) measures, in bf16 with CUDA events (median of --reps after a warm-up); every
forward + backward runs its backward from a fixed grad_output, so no loss reduction or cast is timed:
  attention.dense         causal SDPA at MLA-256 head dims (q/k 256, v 256) for each --seqs x --heads
  kernel.rate.*           GEMMs alone, forward + backward: MLA's projections, a SwiGLU FFN's fc1 and fc2, the grouped
                          experts' fc1 and fc2 (torch._grouped_mm) at --expert-rows rows per expert, each linear on
                          its own input (no activation function, no elementwise work). Recorded beside the model's
                          rate.* entries, which are in-step rates (each class with its elementwise work) from a
                          profiled training step
  output_loss             the unfused output layer + fp32 cross entropy at the proxy and GLM-5 heads
  muon.newton_schulz_*    Newton-Schulz on --config's own Muon matrices (default glm5-proxy; glm5-tiny with --smoke)
                          as one Muon step batches them: each matrix's Muon Split blocks (pretrain.optim.roles, with
                          the config's optimizer.muon_split / muon_split_glu / muon_router / muon_indexer) in their
                          wide orientation, blocks of one shape from all matrices in batched calls under Muon's
                          element cap (pretrain.optim.muon_staging.stage_batches), in optimizer.muon_ns_dtype
                          (CPU: fp32). The whole model on one rank (no TP / EP cut). muon.newton_schulz_points: per
                          block shape, its blocks, FLOPs and time; muon.newton_schulz_flops_per_s (the entry the
                          model reads): all FLOPs / all time; muon.newton_schulz_flops_per_step: all FLOPs
Under torchrun (--collectives-only, world W >= 2): all-gather, reduce-scatter, all-reduce and all-to-all of
--comm-mib MiB per rank, in groups of ranks 0..g-1 for g = 2, 4, ... up to W (and W): every group size's four rates
in collective.busbw_points. The scalars the model reads come from the largest group (W: run it with as many GPUs
as the node has): collective.busbw_fraction_intra is the slowest bus bandwidth of the three over
Cluster's nominal NVLink 450 GB/s, a2a.intra_node_bytes_per_s the all-to-all's bytes sent per GPU per second.

Entries this script does not measure (the in-step rates, per-token overheads and host time from a profiled
training step, DSA kernels, CP and document attention ratios, the fitted ones) are kept from --base with their own
sources; refresh them from new result files with `benchmarks/layout_calibration_results.py` (the profile:
`python benchmarks/train_throughput.py --seqs 4096 --optimizers muon --micro-batch-sizes 4 --tokens-per-step 131072
--steps 6 --profile-step 4`). Every measured entry records this
command, the device and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NVLINK_NOMINAL = 450e9  # pretrain.layout.types presets: bytes/s per GPU per direction
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = "configs/models/glm5-proxy.yaml"
SMOKE_CONFIG = "configs/models/glm5-tiny.yaml"


def _timer(device: str, reps: int) -> Callable[[Callable[[], None]], float]:
    def run(fn: Callable[[], None]) -> float:
        fn()  # warm-up (kernel selection, allocator)
        times = []
        for _ in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def _fwd_bwd(inputs: List[torch.Tensor], fwd: Callable[..., object]) -> Callable[[], None]:
    """One forward + backward of `fwd(*inputs)` (a tensor or a tuple of them), the backward from a grad_output
    made once here (a scalar loss: 1), so the timed region holds the op's own work only (no cast, no sum)."""
    as_tuple = lambda o: tuple(o) if isinstance(o, (tuple, list)) else (o,)
    with torch.no_grad():
        grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in as_tuple(fwd(*inputs))]

    def step() -> None:
        torch.autograd.backward(as_tuple(fwd(*inputs)), grads)
        for t in inputs:
            t.grad = None
    return step


def measure_attention(dev, dt, timed, seqs, heads_list) -> List[Dict]:
    pts = []
    for s in seqs:
        for h in heads_list:
            qkv = [torch.randn(1, h, s, 256, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
            sec = timed(_fwd_bwd(qkv, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            pts.append({"seq": s, "heads": h, "flops_per_s": 3 * 2 * h * 512 * (s / 2) * s / sec})
    return pts


def _linears(dev, dt, tokens: int, shapes: List[tuple]) -> tuple:
    """fwd+bwd of independent linears (in, out), each on its own input; returns (step fn, flops fwd+bwd)."""
    ws = [torch.randn(o, i, device=dev, dtype=dt, requires_grad=True) for i, o in shapes]
    xs = [torch.randn(tokens, i, device=dev, dtype=dt, requires_grad=True) for i, _ in shapes]
    step = _fwd_bwd(xs + ws, lambda *t: tuple(F.linear(x, w) for x, w in zip(t[:len(xs)], t[len(xs):])))
    return step, sum(3 * 2 * tokens * i * o for i, o in shapes)


def _experts(dev, dt, experts: int, rows: int, h: int, e_ffn: int) -> Callable[[], None]:
    """fwd+bwd of the grouped experts' fc1 [h -> 2F] and fc2 [F -> h] GEMMs, each on its own input."""
    n = experts * rows
    t = [torch.randn(*s, device=dev, dtype=dt, requires_grad=True)
         for s in ((n, h), (experts, h, 2 * e_ffn), (n, e_ffn), (experts, e_ffn, h))]
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and dev == "cuda":
        offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * rows
        return _fwd_bwd(t, lambda x1, w1, x2, w2: (grouped(x1, w1, offs=offs), grouped(x2, w2, offs=offs)))
    return _fwd_bwd(t, lambda x1, w1, x2, w2: (torch.bmm(x1.view(experts, rows, h), w1),
                                               torch.bmm(x2.view(experts, rows, e_ffn), w2)))


def measure_gemms(dev, dt, timed, tokens: int, h: int, ffn: int, e_ffn: int, experts: int, rows_list) -> Dict:
    out = {}
    q_lora, kv_lora, heads = max(768 * h // 2048, 1), 512, max(16 * h // 2048, 1)  # glm5-proxy at h = 2048
    step, fl = _linears(dev, dt, tokens, [(h, q_lora), (q_lora, heads * 256), (h, kv_lora + 64),
                                          (kv_lora, heads * 448), (heads * 256, h)])
    out["rate.attention_proj"] = fl / timed(step)
    step, fl = _linears(dev, dt, tokens, [(h, 2 * ffn), (ffn, h)])
    out["rate.dense_mlp"] = fl / timed(step)
    step, fl = _linears(dev, dt, tokens, [(h, 2 * e_ffn), (e_ffn, h)])
    out["rate.shared_expert"] = fl / timed(step)
    pts = []
    for rows in rows_list:
        sec = timed(_experts(dev, dt, experts, rows, h, e_ffn))
        pts.append({"rows_per_expert": rows, "flops_per_s": 3 * 2 * experts * rows * 3 * h * e_ffn / sec})
    out["routed_experts.points"] = pts
    out["rate.routed_experts"] = pts[-1]["flops_per_s"]
    out["routed_experts.rows_per_expert"] = rows_list[-1]
    return out


def measure_output(dev, dt, timed, tokens: int, heads) -> List[Dict]:
    pts = []
    for h, v in heads:
        x = torch.randn(tokens, h, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(v, h, device=dev, dtype=dt, requires_grad=True)
        y = torch.randint(0, v, (tokens,), device=dev)
        sec = timed(_fwd_bwd([x, w], lambda x, w: F.cross_entropy(F.linear(x, w).float(), y)))
        pts.append({"backend": "unfused", "chunk": "unfused", "hidden": h, "vocab": v,
                    "flops_per_s": 6 * h * v * tokens / sec})
    return pts


# ------------------------------------------------------------------------------------------------ Muon
def muon_batches(cfg) -> List[Tuple[int, int, int]]:
    """(blocks, m, n) of every batched Newton-Schulz call one Muon step makes for `cfg`'s whole model on one rank:
    each Muon matrix (pretrain.optim.roles.param_role) cut into its Muon Split blocks (param_split, with the config's
    muon_split / muon_split_glu), in the wide orientation (m <= n), in the model's parameter order, batched as
    Muon._muon_updates batches them (muon_staging.stage_batches under NS_BATCH_ELEMENTS). The model is built on the
    meta device (no memory)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.initialize import ensure_single_rank
    from pretrain import compat
    from pretrain.config.schema import ParallelConfig
    from pretrain.model.builder import build_model
    from pretrain.optim.muon import NS_BATCH_ELEMENTS
    from pretrain.optim.muon_staging import stage_batches
    from pretrain.optim.roles import param_role, param_split

    compat.install()
    own_dist, own_ps = not dist.is_initialized(), not ps.model_parallel_is_initialized()
    ensure_single_rank()
    try:
        with torch.device("meta"):
            model = build_model(dataclasses.replace(cfg, parallel=ParallelConfig()))
    finally:  # leave the process as it was (the caller may be a test, or start its own process group next)
        if own_ps:
            ps.destroy_model_parallel()
        if own_dist:
            dist.destroy_process_group()
    o, shapes = cfg.optimizer, []
    for name, p in model.named_parameters():
        if param_role(name, p, o) != "muon":
            continue
        split = param_split(name, p, cfg.model, split_attention=o.muon_split, split_glu=o.muon_split_glu)
        for b in (split.blocks(p.detach()) if split is not None else [p.detach()[None]]):
            shapes.append((b.shape[0], *sorted(b.shape[-2:])))
    return [(sum(shapes[i][0] for i in batch), *shapes[batch[0]][1:]) for batch in stage_batches(shapes,
                                                                                                NS_BATCH_ELEMENTS)]


def measure_muon(dev, timed, batches: Sequence[Tuple[int, int, int]], steps: int, dtype: torch.dtype) -> List[Dict]:
    """Newton-Schulz (pretrain.optim.muon.newton_schulz_lowp, as Muon calls it on its stage) on each batch; one point
    per block shape (m, n): its blocks, its batches, their FLOPs (steps x (4 m^2 n + 2 m^3) per block) and time (each
    distinct batch timed once, counted as often as it occurs)."""
    from pretrain.optim.muon import newton_schulz_lowp
    from pretrain.optim.muon_staging import newton_schulz_flops

    seconds: Dict[Tuple[int, int, int], float] = {}
    for b in sorted(set(batches)):
        x = torch.randn(*b, device=dev, dtype=dtype)
        seconds[b] = timed(lambda: newton_schulz_lowp(x, steps, dtype))  # noqa: B023 (called right here)
    pts: Dict[Tuple[int, int], Dict] = {}
    for blocks, m, n in batches:
        p = pts.setdefault((m, n), {"m": m, "n": n, "blocks": 0, "batches": [], "flops": 0.0, "seconds": 0.0})
        p["blocks"] += blocks
        p["batches"].append(blocks)
        p["flops"] += blocks * newton_schulz_flops(m, n, steps)
        p["seconds"] += seconds[(blocks, m, n)]
    for p in pts.values():
        p["flops_per_s"] = p["flops"] / p["seconds"]
    return sorted(pts.values(), key=lambda p: -p["flops"])


# ------------------------------------------------------------------------------------------------ collectives
def group_sizes(world: int) -> List[int]:
    """2, 4, 8, ... up to `world`, and `world` itself."""
    sizes = [2 ** k for k in range(1, world.bit_length()) if 2 ** k <= world]
    return sizes + ([world] if world not in sizes else [])


def measure_collectives(dev, timed, mib: int, group=None) -> Dict:
    """Bus bandwidth (B/s) of all-gather, reduce-scatter and all-reduce, and the all-to-all's bytes each rank sends
    to the others per second, over `group` (None: the world); NCCL's bus-bandwidth conventions."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    numel = mib * (1 << 20) // 2
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    big = torch.empty(numel * n, device=dev, dtype=torch.bfloat16)
    # the *_single names are torch >= 2.12's; older ones have only the *_tensor names (deprecated since)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = {"group_size": n}
    out["all_gather"] = numel * 2 * (n - 1) / timed(lambda: gather(big, x, group=group))
    out["reduce_scatter"] = numel * 2 * (n - 1) / timed(lambda: scatter(x, big, group=group))
    out["all_reduce"] = 2 * numel * 2 * (n - 1) / n / timed(lambda: dist.all_reduce(x, group=group))
    y = torch.empty_like(x)
    out["all_to_all_bytes_sent_per_s"] = numel * 2 * (n - 1) / n / timed(
        lambda: dist.all_to_all_single(y, x, group=group))
    return out


def measure_collective_groups(dev, timed, mib: int) -> List[Dict]:
    """measure_collectives over ranks 0..g-1 for every g of group_sizes(world); rank 0's results (it is in every
    group; the other ranks return [])."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    res = []
    for g in group_sizes(world):
        group = None if g == world else dist.new_group(list(range(g)))  # every rank takes part in new_group
        if rank < g:
            c = measure_collectives(dev, timed, mib, group)
            res.append(c)
        dist.barrier()
    return res if rank == 0 else []


def _entry(value, unit, source, derivation) -> Dict:
    return {"value": value, "unit": unit, "kind": "measured", "source": source, "derivation": derivation}


def _muon_entries(e: Dict, cfg, config: str, dev: str, timed, source: Dict) -> None:
    from pretrain.layout.timing import newton_schulz_flops
    from pretrain.layout.types import ModelDims

    o = cfg.optimizer
    dtype = getattr(torch, o.muon_ns_dtype) if dev == "cuda" else torch.float32  # CPU bf16 GEMMs: slow emulation
    pts = measure_muon(dev, timed, muon_batches(cfg), o.muon_num_ns_steps, dtype)
    flops, sec = sum(p["flops"] for p in pts), sum(p["seconds"] for p in pts)
    counted = newton_schulz_flops(ModelDims.from_config(cfg), o.muon_num_ns_steps)
    what = (f"{config}'s Muon matrices, one step on one rank as Muon batches them (muon_split "
            f"{o.muon_split}, muon_split_glu {o.muon_split_glu}; {o.muon_num_ns_steps} steps in {str(dtype)[6:]})")
    e["muon.newton_schulz_points"] = _entry(pts, "FLOP/s", source, f"{what}: per block shape (m <= n) its blocks, "
                                            "batch sizes, FLOPs, seconds (each distinct batch timed alone)")
    e["muon.newton_schulz_flops_per_s"] = _entry(
        flops / sec, "FLOP/s", source, f"{what}: {flops / 1e12:.4g} TFLOP in {sec * 1e3:.4g} ms (all FLOPs / all time "
        f"of muon.newton_schulz_points); pretrain.layout.timing.newton_schulz_flops counts {counted / 1e12:.4g} TFLOP")
    e["muon.newton_schulz_flops_per_step"] = _entry(flops, "FLOP", source, f"{what}: Newton-Schulz FLOPs of one step")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the calibration JSON to write")
    ap.add_argument("--base", default=None, help="table whose unmeasured entries are kept (default: the committed one)")
    ap.add_argument("--gpu-kind", default=None, help="h100 | h200 (default: from the device name)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (CPU rehearsal of the whole path)")
    ap.add_argument("--config", default=None, help=f"model config whose Muon matrices are timed (default "
                                                   f"{DEFAULT_CONFIG}; {SMOKE_CONFIG} with --smoke)")
    ap.add_argument("--seqs", default="4096,16384,32768,131072")
    ap.add_argument("--heads", default="8,16,32,64")
    ap.add_argument("--expert-rows", default="256,1024,2731")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--comm-mib", type=int, default=256)
    ap.add_argument("--collectives-only", action="store_true",
                    help="under torchrun (2 or more ranks): measure only the collectives, at every group size")
    args = ap.parse_args(argv)

    dev = args.device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not args.collectives_only:
        raise SystemExit(f"WORLD_SIZE={world}: under torchrun pass --collectives-only (the other measurements run in "
                         "one process: python benchmarks/layout_calibration.py --out ...)")
    if args.collectives_only and world < 2:
        raise SystemExit("--collectives-only: run under torchrun with 2 or more ranks "
                         "(torchrun --nproc-per-node 4 benchmarks/layout_calibration.py --collectives-only ...)")
    if args.collectives_only and args.config:
        raise SystemExit("--config: read by the Muon measurement only, which --collectives-only skips")
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --smoke for a rehearsal)")
    config = args.config or (SMOKE_CONFIG if args.smoke else DEFAULT_CONFIG)
    cfg = None
    if not args.collectives_only:
        from pretrain.config import load_config

        cfg = load_config(config if os.path.exists(config) else os.path.join(ROOT, config), [])
    if world > 1:
        import torch.distributed as dist

        if dev == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    kind = args.gpu_kind or ("h200" if "H200" in name else "h100" if "H100" in name else "cpu")
    reps = 1 if args.smoke else args.reps
    timed = _timer(dev, reps)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    launch = f"torchrun --nproc-per-node {world} " if world > 1 else "python "
    command = launch + "benchmarks/layout_calibration.py " + " ".join(argv or sys.argv[1:])
    source = {"file": args.out, "command": command,
              "date": datetime.date.today().isoformat(), "gpu": name}

    from pretrain.layout.calibration import calibration_path

    base_path = args.base or calibration_path(kind if kind in ("h100", "h200") else "h200")
    with open(base_path) as f:
        table = json.load(f)
    table["gpu_kind"], table["device_name"] = kind, name
    from pretrain.training.flops import peak_flops

    table["peak_bf16_flops"] = peak_flops(name) or table["peak_bf16_flops"]
    e = table["entries"]
    seqs = [256, 512] if args.smoke else [int(s) for s in args.seqs.split(",")]
    heads = [2] if args.smoke else [int(h) for h in args.heads.split(",")]
    if not args.collectives_only:
        # a point measured inside a profiled step (with its concatenations) stays: the model wants in-step rates
        in_step = [p for p in e["attention.dense"]["value"] if "breakdown" in str(p.get("source", {}).get("file"))]
        fresh = [dict(p, source=source) for p in measure_attention(dev, dt, timed, seqs, heads)
                 if p["seq"] not in {q["seq"] for q in in_step}]
        e["attention.dense"] = _entry(in_step + fresh, "FLOP/s", source,
                                      "causal SDPA fwd+bwd (backward from a fixed grad_output), q/k/v head dim 256, "
                                      "batch 1; 3 x 2 x heads x 512 x S/2 x S / time (in-step points of the base "
                                      "table kept)")
        sizes = dict(tokens=256, h=64, ffn=128, e_ffn=32, experts=4, rows_list=[16, 64]) if args.smoke else dict(
            tokens=16384, h=2048, ffn=5632, e_ffn=512, experts=48,
            rows_list=[int(r) for r in args.expert_rows.split(",")])
        g = measure_gemms(dev, dt, timed, **sizes)
        # GEMM rates alone: recorded beside the in-step rates (rate.*, which include each class's elementwise work
        # and come from a profiled step), to show how far the step is from its kernels; the model reads rate.*
        for k in ("rate.attention_proj", "rate.dense_mlp", "rate.shared_expert", "rate.routed_experts"):
            e["kernel." + k] = _entry(g[k], "FLOP/s", source,
                                      f"fwd+bwd of the op's GEMMs alone at {sizes['tokens']} tokens, hidden "
                                      f"{sizes['h']}: each linear on its own input, backward from a fixed "
                                      "grad_output (no activation function, no elementwise work, no loss)")
        e["kernel.routed_experts.points"] = _entry(g["routed_experts.points"], "FLOP/s", source,
                                                   "grouped experts' fc1 and fc2 GEMMs fwd+bwd at each rows per "
                                                   "expert (each on its own input, fixed grad_output)")
        heads_out = [(64, 256)] if args.smoke else [(2048, 32768), (6144, 154880)]
        out_pts = measure_output(dev, dt, timed, 256 if args.smoke else 16384, heads_out)
        kept = [p for p in e.get("output_loss", {"value": []})["value"] if p["backend"] != "unfused"]
        e["output_loss"] = _entry(kept + out_pts, "FLOP/s", source, "unfused output layer + fp32 cross entropy "
                                  "(mean loss, backward from 1) measured here; the Liger and chunked points kept "
                                  "from the base table")
        _muon_entries(e, cfg, config, dev, timed, source)
    if world > 1:
        res = measure_collective_groups(dev, timed, 1 if args.smoke else args.comm_mib)
        rank = torch.distributed.get_rank()
        torch.distributed.destroy_process_group()
        if rank != 0:
            return
        bus = lambda c: min(c["all_gather"], c["reduce_scatter"], c["all_reduce"])
        e["collective.busbw_points"] = _entry(
            [dict(c, busbw_fraction_intra=bus(c) / NVLINK_NOMINAL) for c in res], "B/s",
            source, "bus bandwidth of all-gather, reduce-scatter, all-reduce and the all-to-all's bytes sent per GPU "
            f"per second, {args.comm_mib if not args.smoke else 1} MiB per rank, over ranks 0..g-1 at each group size")
        c = res[-1]  # the largest group: the torchrun world
        e["collective.busbw_fraction_intra"] = _entry(
            bus(c) / NVLINK_NOMINAL, "fraction of Cluster.intra_node_bw", source,
            f"slowest of all-gather {c['all_gather'] / 1e9:.0f}, reduce-scatter {c['reduce_scatter'] / 1e9:.0f}, "
            f"all-reduce {c['all_reduce'] / 1e9:.0f} GB/s bus bandwidth at group size {c['group_size']} (the largest "
            "measured; every size in collective.busbw_points) / 450 GB/s")
        e["a2a.intra_node_bytes_per_s"] = _entry(
            c["all_to_all_bytes_sent_per_s"], "B/s", source,
            f"all_to_all_single, even splits, bytes each GPU sends to others per second at group size "
            f"{c['group_size']} (the largest measured; every size in collective.busbw_points)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    fresh = ", ".join(k for k, v in e.items() if v.get("source") is source)
    print(f"wrote {args.out} ({kind}, {name}): measured {fresh}")


if __name__ == "__main__":
    main()
