"""Re-measure the layout planner's calibration table on one GPU kind, in the format pretrain.layout.timing reads.

    python benchmarks/layout_calibration.py --out benchmarks/results/layout_calibration_h200.json
    torchrun --nproc-per-node 2 benchmarks/layout_calibration.py --collectives-only \
        --base benchmarks/results/layout_calibration_h200.json --out benchmarks/results/layout_calibration_h200.json
    python benchmarks/layout_calibration.py --device cpu --smoke --out /tmp/calib.json    # CPU rehearsal, tiny sizes

One process measures, forward + backward in bf16 with CUDA events (median of --reps after a warm-up):
  attention.dense         causal SDPA at MLA-256 head dims (q/k 256, v 256) for each --seqs x --heads
  kernel.rate.*           GEMMs alone: MLA's projections, a SwiGLU FFN, the grouped experts (torch._grouped_mm) at
                          --expert-rows rows per expert. Recorded beside the model's rate.* entries, which are
                          in-step rates (each class with its elementwise work) from a profiled training step
  output_loss             the unfused output layer + cross entropy at the proxy and GLM-5 heads
  muon.newton_schulz_*    pretrain.optim.muon.newton_schulz per matrix size (proxy experts, GLM-5 experts and
                          attention blocks); the proxy experts' rate is the entry the model reads
Under torchrun (world >= 2): all-gather, reduce-scatter, all-reduce and all-to-all of --comm-mib MiB per rank; the
bus bandwidth over Cluster's nominal NVLink 450 GB/s is collective.busbw_fraction_intra, the all-to-all's
bytes sent per GPU per second is a2a.intra_node_bytes_per_s.

Entries this script does not measure (the in-step rates, per-token overheads and host time from a profiled
training step, DSA kernels, CP and document attention ratios, the fitted ones) are kept from --base with their own
sources; refresh them from new result files with `benchmarks/layout_calibration_results.py` (the profile:
`python benchmarks/train_throughput.py --seqs 4096 --optimizers muon --micro-batch-sizes 4 --tokens-per-step 131072
--steps 6 --profile-step 4`). Every measured entry records this
command, the device and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NVLINK_NOMINAL = 450e9  # pretrain.layout.types presets: bytes/s per GPU per direction


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


def _fwd_bwd(make: Callable[[], List[torch.Tensor]], fwd: Callable[..., torch.Tensor]) -> Callable[[], None]:
    inputs = make()

    def step() -> None:
        out = fwd(*inputs)
        out.float().sum().backward()
        for t in inputs:
            t.grad = None
    return step


def measure_attention(dev, dt, timed, seqs, heads_list) -> List[Dict]:
    pts = []
    for s in seqs:
        for h in heads_list:
            mk = lambda: [torch.randn(1, h, s, 256, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
            sec = timed(_fwd_bwd(mk, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            pts.append({"seq": s, "heads": h, "flops_per_s": 3 * 2 * h * 512 * (s / 2) * s / sec})
    return pts


def _linear_chain(dev, dt, tokens: int, shapes: List[tuple]) -> tuple:
    """fwd+bwd of x through independent linears (in, out); returns (step fn, flops fwd+bwd)."""
    ws = [torch.randn(o, i, device=dev, dtype=dt, requires_grad=True) for i, o in shapes]
    xs = [torch.randn(tokens, i, device=dev, dtype=dt, requires_grad=True) for i, _ in shapes]

    def step() -> None:
        sum(F.linear(x, w).float().sum() for x, w in zip(xs, ws)).backward()
        for t in ws + xs:
            t.grad = None
    return step, sum(3 * 2 * tokens * i * o for i, o in shapes)


def measure_gemms(dev, dt, timed, tokens: int, h: int, ffn: int, e_ffn: int, experts: int, rows_list) -> Dict:
    out = {}
    q_lora, kv_lora, heads = max(768 * h // 2048, 1), 512, max(16 * h // 2048, 1)  # glm5-proxy at h = 2048
    step, fl = _linear_chain(dev, dt, tokens, [(h, q_lora), (q_lora, heads * 256), (h, kv_lora + 64),
                                               (kv_lora, heads * 448), (heads * 256, h)])
    out["rate.attention_proj"] = fl / timed(step)
    step, fl = _linear_chain(dev, dt, tokens, [(h, 2 * ffn), (ffn, h)])
    out["rate.dense_mlp"] = fl / timed(step)
    step, fl = _linear_chain(dev, dt, tokens, [(h, 2 * e_ffn), (e_ffn, h)])
    out["rate.shared_expert"] = fl / timed(step)
    pts = []
    grouped = getattr(torch, "_grouped_mm", None)
    for rows in rows_list:
        n = experts * rows
        x = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
        w1 = torch.randn(experts, h, 2 * e_ffn, device=dev, dtype=dt, requires_grad=True)
        w2 = torch.randn(experts, e_ffn, h, device=dev, dtype=dt, requires_grad=True)
        offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * rows

        def experts_fwd(x, w1, w2):
            if grouped is not None and dev == "cuda":
                a = grouped(x, w1, offs=offs)
                g, u = a.chunk(2, dim=-1)
                return grouped(F.silu(g) * u, w2, offs=offs)
            xs = x.view(experts, rows, h)
            a = torch.bmm(xs, w1)
            g, u = a.chunk(2, dim=-1)
            return torch.bmm(F.silu(g) * u, w2).reshape(n, h)
        sec = timed(_fwd_bwd(lambda: [x, w1, w2], experts_fwd))
        pts.append({"rows_per_expert": rows, "flops_per_s": 3 * 2 * n * 3 * h * e_ffn / sec})
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
        sec = timed(_fwd_bwd(lambda: [x, w], lambda x, w: F.cross_entropy(F.linear(x, w).float(), y)))
        pts.append({"backend": "unfused", "chunk": "unfused", "hidden": h, "vocab": v,
                    "flops_per_s": 6 * h * v * tokens / sec})
    return pts


def measure_newton_schulz(dev, dt, timed, blocks: int, m: int, n: int) -> float:
    from pretrain.optim.muon import newton_schulz

    g = torch.randn(blocks, m, n, device=dev, dtype=torch.float32)
    sec = timed(lambda: newton_schulz(g, steps=5, dtype=dt))
    a, b = min(m, n), max(m, n)
    return blocks * 5 * (4 * a * a * b + 2 * a ** 3) / sec


def measure_collectives(dev, timed, mib: int) -> Dict:
    import torch.distributed as dist

    n = dist.get_world_size()
    numel = mib * (1 << 20) // 2
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    big = torch.empty(numel * n, device=dev, dtype=torch.bfloat16)
    out = {}
    sec = timed(lambda: dist.all_gather_into_tensor(big, x))
    out["all_gather"] = numel * 2 * n * (n - 1) / n / sec
    sec = timed(lambda: dist.reduce_scatter_tensor(x, big))
    out["reduce_scatter"] = numel * 2 * n * (n - 1) / n / sec
    sec = timed(lambda: dist.all_reduce(x))
    out["all_reduce"] = 2 * numel * 2 * (n - 1) / n / sec
    y = torch.empty_like(x)
    sec = timed(lambda: dist.all_to_all_single(y, x))
    out["all_to_all_bytes_sent_per_s"] = numel * 2 * (n - 1) / n / sec
    out["group_size"] = n
    return out


def _entry(value, unit, source, derivation) -> Dict:
    return {"value": value, "unit": unit, "kind": "measured", "source": source, "derivation": derivation}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the calibration JSON to write")
    ap.add_argument("--base", default=None, help="table whose unmeasured entries are kept (default: the committed one)")
    ap.add_argument("--gpu-kind", default=None, help="h100 | h200 (default: from the device name)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (CPU rehearsal of the whole path)")
    ap.add_argument("--seqs", default="4096,16384,32768,131072")
    ap.add_argument("--heads", default="8,16,32,64")
    ap.add_argument("--expert-rows", default="256,1024,2731")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--comm-mib", type=int, default=256)
    ap.add_argument("--collectives-only", action="store_true", help="under torchrun: measure only the collectives")
    args = ap.parse_args(argv)

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --smoke for a rehearsal)")
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        import torch.distributed as dist

        if dev == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    kind = args.gpu_kind or ("h200" if "H200" in name else "h100" if "H100" in name else "cpu")
    reps = 1 if args.smoke else args.reps
    timed = _timer(dev, reps)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    source = {"file": args.out, "command": "python benchmarks/layout_calibration.py " + " ".join(argv or sys.argv[1:]),
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
                                      "causal SDPA fwd+bwd, q/k/v head dim 256, batch 1; 3 x 2 x heads x 512 x S/2 x S "
                                      "/ time (in-step points of the base table kept)")
        sizes = dict(tokens=256, h=64, ffn=128, e_ffn=32, experts=4, rows_list=[16, 64]) if args.smoke else dict(
            tokens=16384, h=2048, ffn=5632, e_ffn=512, experts=48,
            rows_list=[int(r) for r in args.expert_rows.split(",")])
        g = measure_gemms(dev, dt, timed, **sizes)
        # GEMM rates alone: recorded beside the in-step rates (rate.*, which include each class's elementwise work
        # and come from a profiled step), to show how far the step is from its kernels; the model reads rate.*
        for k in ("rate.attention_proj", "rate.dense_mlp", "rate.shared_expert", "rate.routed_experts"):
            e["kernel." + k] = _entry(g[k], "FLOP/s", source, f"fwd+bwd of the op's GEMMs alone at {sizes['tokens']} "
                                                               f"tokens, hidden {sizes['h']} (no elementwise work)")
        e["kernel.routed_experts.points"] = _entry(g["routed_experts.points"], "FLOP/s", source,
                                                   "grouped SwiGLU experts fwd+bwd at each rows per expert")
        heads_out = [(64, 256)] if args.smoke else [(2048, 32768), (6144, 154880)]
        out_pts = measure_output(dev, dt, timed, 256 if args.smoke else 16384, heads_out)
        kept = [p for p in e.get("output_loss", {"value": []})["value"] if p["backend"] != "unfused"]
        e["output_loss"] = _entry(kept + out_pts, "FLOP/s", source, "unfused output layer + fp32 cross entropy "
                                  "measured here; the Liger and chunked points kept from the base table")
        sizes = [(2, 16, 32)] if args.smoke else [(96, 512, 2048), (16, 2048, 6144), (8, 6144, 6144), (64, 256, 768)]
        ns_pts = [{"blocks": b, "m": m, "n": n, "flops_per_s": measure_newton_schulz(dev, dt, timed, b, m, n)}
                  for b, m, n in sizes]
        e["muon.newton_schulz_points"] = _entry(ns_pts, "FLOP/s", source,
                                                "newton_schulz (5 steps) on a batch of blocks of m x n, per matrix size "
                                                "(recorded; the model reads the aggregate rate below)")
        e["muon.newton_schulz_flops_per_s"] = _entry(ns_pts[0]["flops_per_s"], "FLOP/s", source,
                                                     "newton_schulz on 96 blocks of 512 x 2048 (glm5-proxy's experts)")
    if distributed:
        c = measure_collectives(dev, timed, 1 if args.smoke else args.comm_mib)
        bus = min(c["all_gather"], c["reduce_scatter"], c["all_reduce"])
        e["collective.busbw_fraction_intra"] = _entry(
            bus / NVLINK_NOMINAL, "fraction of Cluster.intra_node_bw", source,
            f"slowest of all-gather {c['all_gather'] / 1e9:.0f}, reduce-scatter {c['reduce_scatter'] / 1e9:.0f}, "
            f"all-reduce {c['all_reduce'] / 1e9:.0f} GB/s bus bandwidth at group size {c['group_size']} / 450 GB/s")
        e["a2a.intra_node_bytes_per_s"] = _entry(c["all_to_all_bytes_sent_per_s"], "B/s", source,
                                                 f"all_to_all_single, bytes each GPU sends to others per second, "
                                                 f"group size {c['group_size']}")
        if torch.distributed.get_rank() != 0:
            return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    fresh = ", ".join(k for k, v in e.items() if v.get("source") is source)
    print(f"wrote {args.out} ({kind}, {name}): measured {fresh}")


if __name__ == "__main__":
    main()
