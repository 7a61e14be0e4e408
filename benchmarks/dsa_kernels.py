"""DSA attention kernels vs dense cuDNN attention vs the PyTorch reference, at GLM-5 shapes.

    python benchmarks/dsa_kernels.py --seqs 4096,8192,16384,32768,65536,131072 --out results.json

Per sequence length S (batch 1, causal), GLM-5 attention shapes: 64 heads, absorbed MLA keys of
576 = 512 latent + 64 rope dims, values 512, top-k 2048, indexer 32 heads x 128.

(a) ours (Triton): indexer scores + exact top-k, sparse MLA attention, sparse indexer KL loss, run as
    the DSA layer runs them (`pretrain.model.dsa.backend.TritonBackend`): the KL in backward, its target
    the head sums of P that the attention backward forms;
(b) dense causal attention, SDPA with the cuDNN backend (flash if cuDNN refuses), the equivalent
    multi-head shapes (q/k 256, v 256, 64 heads);
(c) the reference path (`pretrain.model.dsa`: `indexer` / `sparse_mla` / `indexer_loss`, PyTorch).

With `--tp N`, run under `torchrun --nproc-per-node N`: the lightning indexer (projection of q_I, k_I, w with RoPE,
then top-k with the selection's log sum exp, as the DSA layer runs it) per rank at TP = 1 (every rank all rows) and
at TP = N (each rank its share of the rows, `pretrain.model.dsa.indexer_split`), with glm5-proxy's indexer dims
(16 x 128, hidden 2048, q LoRA 768) and GLM-5's (32 x 128, hidden 6144, q LoRA 2048); the slowest rank counts; the
all-gather of the selections is timed on its own:

    torchrun --nproc-per-node 2 benchmarks/dsa_kernels.py --tp 2 --seqs 32768,131072 --out indexer_tp2.json

Times are medians of CUDA-event-timed repeats after warm-up; fresh random inputs per length.
TFLOP/s of sparse attention use the convention 2 * S * k * heads * (576 + 512) forward and
2 * S * k * heads * (2 * 576 + 3 * 512 - 512 + 576) = 2.53x that backward (QK recompute, dP, dQ,
dK, dV), over all S * k slots; the "valid" columns count only slots on visible keys (the first
k rows of a causal sequence have fewer than k keys).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pretrain.model.dsa.backend import TritonBackend  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING  # noqa: E402

H, C, R, TOPK, HI, DI = 64, 512, 64, 2048, 32, 128
D = C + R
SCALE = 256**-0.5  # MLA: (qk_head_dim 192 + rope 64)^-1/2
BACKEND = TritonBackend()  # the kernels' defaults


def timed(fn, reps: int, warmup: int = 2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def tile_configs(text: str) -> list:
    """'64x8x2,32x4x3' -> [(64, 8, 2), (32, 4, 3)]: the sweeps' tile-config arguments."""
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",") if c]


def save_json(res: dict, path) -> None:
    """A sweep's results to `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def inputs(s: int, gen: torch.Generator):
    dev = "cuda"
    q = (torch.randn(1, s, H, D, device=dev, generator=gen) * 0.5).bfloat16()
    kv = torch.randn(1, s, D, device=dev, generator=gen).bfloat16()
    qi = torch.randn(1, s, HI, DI, device=dev, generator=gen).bfloat16()
    ki = torch.randn(1, s, DI, device=dev, generator=gen).bfloat16()
    w = torch.randn(1, s, HI, device=dev, generator=gen) * HI**-0.5
    return q, kv, qi, ki, w


def sparse_kl_triton(qi, ki, w, idx, head_sums, sel_lse=None, backend=BACKEND):
    """The sparse indexer loss as the DSA layer runs it in backward (`indexer_loss.kl_from_attention_backward`):
    target = the attention backward's head sums, renormalized by the kernel; the KL over the selected keys with its
    gradients into (q_I, k_I, w), given the top-k's log sum exp of the selection (`sel_lse`; None: the kernel forms
    it). -> (loss, grads)."""
    plan = backend.sparse_kl_plan(idx, lambda r0, r1, _i: head_sums[:, r0:r1], 0, lse=sel_lse, normalize=True)
    loss, grads, _ = plan(qi, ki, w)
    return loss, grads


def ours(s, q, kv, qi, ki, w, reps, backend=BACKEND, kl_configs=()):
    """The DSA layer's kernels in the layer's order: top-k (with its selection's log sum exp, for the KL); sparse
    attention forward; its backward, which also sums P over heads (the KL's target); the indexer KL and its
    gradient from those sums. `backend`: a TritonBackend (its options and tuning); `kl_configs`: the KL kernel's
    (BN, warps, stages, slots as M) also timed on the same inputs."""
    keys = VisibleKeys(s, s, "cuda")
    g = torch.randn(1, s, H, C, device="cuda", dtype=torch.bfloat16)
    idx, sel_lse = backend.topk(qi, ki, w, TOPK, keys, 0, with_lse=True)
    res = {"topk_ms": timed(lambda: backend.topk(qi, ki, w, TOPK, keys, 0, with_lse=True), reps),
           "topk_no_lse_ms": timed(lambda: backend.topk(qi, ki, w, TOPK, keys, 0), reps)}
    res["attn_fwd_ms"] = timed(lambda: backend.attention_forward(q, kv, idx, SCALE, C, 0), reps)
    out, lse = backend.attention_forward(q, kv, idx, SCALE, C, 0)

    def attn_bwd(head_sums=None):
        return backend.attention_backward(q, kv, idx, lse, g, out, SCALE, C, 0, head_sums=head_sums)

    res["attn_bwd_ms"] = timed(lambda: attn_bwd(torch.zeros(idx.shape, dtype=torch.float32, device="cuda")), reps)
    res["attn_bwd_no_target_ms"] = timed(attn_bwd, reps)
    head_sums = torch.zeros(idx.shape, dtype=torch.float32, device="cuda")
    attn_bwd(head_sums)
    res["kl_ms"] = timed(lambda: sparse_kl_triton(qi, ki, w, idx, head_sums, sel_lse, backend), reps)
    res["kl_own_lse_ms"] = timed(lambda: sparse_kl_triton(qi, ki, w, idx, head_sums, None, backend), reps)
    for config in kl_configs:  # --kl-configs: the KL kernel's (BN, warps, stages, slots as M) on the same inputs
        other = TritonBackend(backend.deterministic, backend.key_partition_bytes, backend.indexer_fp8,
                              replace(backend.tuning, kl_tiles=tuple(config)))
        res.setdefault("kl_ms_by_config", {})["x".join(map(str, config))] = timed(
            lambda: sparse_kl_triton(qi, ki, w, idx, head_sums, sel_lse, other), reps)

    def whole(backward: bool):
        ix, sl = backend.topk(qi, ki, w, TOPK, keys, 0, with_lse=True)
        o, ls = backend.attention_forward(q, kv, ix, SCALE, C, 0)
        if backward:
            hs = torch.zeros(ix.shape, dtype=torch.float32, device="cuda")
            backend.attention_backward(q, kv, ix, ls, g, o, SCALE, C, 0, head_sums=hs)
            sparse_kl_triton(qi, ki, w, ix, hs, sl, backend)

    res["fwd_ms"] = timed(lambda: whole(False), reps)
    res["fwdbwd_ms"] = timed(lambda: whole(True), reps)
    res["bwd_ms"] = res["fwdbwd_ms"] - res["fwd_ms"]
    res["peak_gib"] = peak(lambda: whole(True))
    valid = float((idx >= 0).sum())
    flops_fwd = 2 * s * TOPK * H * (C + D)
    flops_bwd = 2 * s * TOPK * H * (2 * D + C + C + D)  # QK, dP, dV, dQ, dK
    res["attn_fwd_tflops"] = flops_fwd / res["attn_fwd_ms"] / 1e9
    res["attn_bwd_tflops"] = flops_bwd / res["attn_bwd_ms"] / 1e9
    frac = valid / (s * TOPK)
    res["attn_fwd_tflops_valid"] = res["attn_fwd_tflops"] * frac
    res["attn_bwd_tflops_valid"] = res["attn_bwd_tflops"] * frac
    return res


def dense(s, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    q = torch.randn(1, H, s, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, H, s, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, H, s, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, H, s, 256, device=dev, dtype=torch.bfloat16)
    backend = None
    for cand in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(cand):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
            backend = cand
            break
        except RuntimeError:
            continue

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fb():
        fwd().backward(g)

    res = {"backend": str(backend), "fwd_ms": timed(fwd, reps), "fwdbwd_ms": timed(fb, reps)}
    res["bwd_ms"] = res["fwdbwd_ms"] - res["fwd_ms"]
    res["peak_gib"] = peak(fb)
    flops = 2 * 2 * s * s / 2 * H * 256  # causal: half of QK^T and PV
    res["fwd_tflops"] = flops / res["fwd_ms"] / 1e9
    res["bwd_tflops"] = 2.5 * flops / res["bwd_ms"] / 1e9
    return res


def reference(s, q, kv, qi, ki, w, reps):
    from pretrain.model.dsa.indexer import indexer_loss as ref_loss
    from pretrain.model.dsa.indexer import default_chunk, indexer_topk
    from pretrain.model.dsa.sparse_mla import sparse_mla_attention

    keys = VisibleKeys(s, s, "cuda")
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    qi, ki, w = (t.detach().requires_grad_() for t in (qi, ki, w))
    g = torch.randn(1, s, H, C, device="cuda", dtype=torch.bfloat16)
    chunk = default_chunk(HI * s)
    sparse_chunk = default_chunk(TOPK * (D + H))

    def whole(backward: bool):
        ix = indexer_topk(qi.detach(), ki.detach(), w.detach(), TOPK, keys, chunk)
        o, _ = sparse_mla_attention(q, kv, ix, SCALE, C, sparse_chunk)
        target = ref_loss.sparse_target(q.detach(), kv.detach(), SCALE)
        loss, _ = ref_loss.indexer_kl_sparse(qi, ki, w, ix, target, sparse_chunk)
        if backward:
            torch.autograd.backward([o, loss], [g, torch.ones_like(loss)])

    res = {"fwd_ms": timed(lambda: whole(False), reps, warmup=1), "fwdbwd_ms": timed(lambda: whole(True), reps, warmup=1)}
    res["bwd_ms"] = res["fwdbwd_ms"] - res["fwd_ms"]
    res["peak_gib"] = peak(lambda: whole(True))
    return res


INDEXER_DIMS = {"glm5-proxy": (2048, 768, 16, 128), "glm5": (6144, 2048, 32, 128)}  # hidden, q LoRA, H_I, d_I


def indexer_tp(s: int, dims, reps: int) -> dict:
    """The indexer's projection + top-k per rank at TP = 1 and at TP = world size (rows split), in ms, and the
    selections' all-gather; the maximum over ranks of each."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from pretrain.model.dsa.indexer import LightningIndexer, pack_indices
    from pretrain.model.dsa.indexer_split import RowSplit
    from pretrain.model.rope import mla_rope

    hidden, q_lora, heads, head_dim = dims
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    cfg = SimpleNamespace(dsa_indexer_n_heads=heads, dsa_indexer_head_dim=head_dim, q_lora_rank=q_lora,
                          hidden_size=hidden, use_cpu_initialization=False, params_dtype=torch.bfloat16,
                          perform_initialization=True, init_method=init, qk_pos_emb_head_dim=R,
                          dsa_indexer_hadamard=False, dsa_indexer_loss_coeff=1.0)
    gen = torch.Generator(device="cuda").manual_seed(s)  # the same inputs and weights on every rank
    torch.manual_seed(s)
    indexer = LightningIndexer(cfg)
    x = torch.randn(s, 1, hidden, device="cuda", generator=gen).bfloat16()
    qr = torch.randn(s, 1, q_lora, device="cuda", generator=gen).bfloat16()
    inv = 1e6 ** -(torch.arange(0, R, 2, device="cuda").float() / R)  # megatron's rope freqs [s, 1, 1, R]
    angles = torch.arange(s, device="cuda").float()[:, None] * inv[None]
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    full_rope = mla_rope(freqs)

    def rope(t, rows=None):
        return full_rope(t) if rows is None else mla_rope(freqs.index_select(0, rows))(t)

    keys = VisibleKeys(s, s, "cuda")
    split = RowSplit.create(s, dist.group.WORLD, "cuda")
    mine = keys if split is None else keys.subset(split.rows)

    @torch.no_grad()
    def run(sp, visible):
        q, k, w = indexer.project(x, qr, rope, sp)
        return BACKEND.topk(q, k, w, TOPK, visible, 0, with_lse=True)

    res = {"tp1_ms": timed(lambda: run(None, keys), reps), "split_ms": timed(lambda: run(split, mine), reps)}
    if split is not None:
        kept = pack_indices(run(split, mine)[0], s)
        res["gather_ms"] = timed(lambda: split.gather(kept), reps)
    times = torch.tensor([res[k] for k in sorted(res)], device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank
    res = dict(zip(sorted(res), times.tolist()))
    res["split_over_tp1"] = res["split_ms"] / res["tp1_ms"]
    return res


def main_tp(args) -> None:
    """--tp: `indexer_tp` at every length and dims (see the module docstring)."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for s in (int(x) for x in args.seqs.split(",")):
        for name, dims in INDEXER_DIMS.items():
            entry = {"S": s, "dims": name, "tp": args.tp, **indexer_tp(s, dims, args.reps)}
            torch.cuda.empty_cache()
            rows.append(entry)
            if rank == 0:
                print(json.dumps(entry), flush=True)
    if rank == 0:
        save_json({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, args.out)
        print(f"| S | indexer dims | TP=1 ms | TP={args.tp} ms per rank | ratio | index all-gather ms |")
        print("|" + " --- |" * 6)
        for e in rows:
            print(f"| {e['S']} | {e['dims']} | {e['tp1_ms']:.2f} | {e['split_ms']:.2f} | {e['split_over_tp1']:.3f} | "
                  f"{e.get('gather_ms', float('nan')):.2f} |")
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--reference-max", type=int, default=16384, help="largest S for the (slow) reference path")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--key-partition-mib", type=float, default=None,
                    help="also run (a) with the attention backward's keys in partitions of at most this many MiB of "
                         "kv + fp32 dkv rows (model.dsa_key_partition_mib), in the same run: rows 'dsa_options'")
    ap.add_argument("--indexer-fp8", action="store_true",
                    help="also run (a) with the top-k from FP8 index scores (model.dsa_indexer_fp8), in the same run "
                         "(with --key-partition-mib too if given): rows 'dsa_options'")
    ap.add_argument("--vector-atomics", action="store_true",
                    help="also run (a) with the key gradients summed by 16-byte vector reductions instead of Triton's "
                         "scalar atomics (DSAKernelTuning.vector_atomics), in the same run (with the options "
                         "above too if given): rows 'dsa_options'")
    ap.add_argument("--kl-configs", default="",
                    help="also time the sparse indexer loss's kernel at these (BN x warps x stages x slots-as-M) configs, "
                         "e.g. 64x4x2x1,128x4x2x0 (DSAKernelTuning.kl_tiles), in the same run: 'kl_ms_by_config'")
    ap.add_argument("--tp", type=int, default=0,
                    help="under torchrun with this many ranks: only the indexer (projection + top-k) per rank at TP=1 "
                         "and with its rows split over the ranks (see the module docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tp:
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        if args.tp < 2 or ranks != args.tp:
            ap.error(f"--tp {args.tp} needs >= 2 ranks and torchrun --nproc-per-node {args.tp} (this run has {ranks})")
        return main_tp(args)
    kl_configs = tile_configs(args.kl_configs)
    if args.key_partition_mib is not None and args.key_partition_mib < 0:
        ap.error("--key-partition-mib must be >= 0")
    options = args.key_partition_mib is not None or args.indexer_fp8 or args.vector_atomics
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for s in (int(x) for x in args.seqs.split(",")):
        entry = {"S": s}
        t0 = time.time()
        q, kv, qi, ki, w = inputs(s, gen)
        try:
            entry["dsa"] = ours(s, q, kv, qi, ki, w, args.reps, BACKEND, kl_configs)
        except torch.OutOfMemoryError as e:
            entry["dsa"] = {"error": f"OOM: {e}"[:200]}
        torch.cuda.empty_cache()
        if options:
            mib = args.key_partition_mib  # None: the kernels' default, 0: one pass
            backend = TritonBackend(key_partition_bytes=None if mib is None else int(mib * 2**20),
                                    indexer_fp8=args.indexer_fp8,
                                    tuning=replace(DEFAULT_TUNING, vector_atomics=args.vector_atomics))
            try:
                entry["dsa_options"] = ours(s, q, kv, qi, ki, w, args.reps, backend)
                entry["dsa_options"].update(key_partition_mib=args.key_partition_mib, indexer_fp8=args.indexer_fp8,
                                            vector_atomics=args.vector_atomics)
            except torch.OutOfMemoryError as e:
                entry["dsa_options"] = {"error": f"OOM: {e}"[:200]}
            torch.cuda.empty_cache()
        try:
            entry["dense"] = dense(s, max(2, args.reps // 2) if s >= 65536 else args.reps)
        except torch.OutOfMemoryError as e:
            entry["dense"] = {"error": f"OOM: {e}"[:200]}
        torch.cuda.empty_cache()
        if s <= args.reference_max:
            entry["reference"] = reference(s, q, kv, qi, ki, w, 2)
            torch.cuda.empty_cache()
        del q, kv, qi, ki, w
        torch.cuda.empty_cache()
        rows.append(entry)
        print(json.dumps(entry), f"({time.time() - t0:.0f}s)", flush=True)
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    print(table(rows))
    if options:
        print(f"with key_partition_mib={args.key_partition_mib} indexer_fp8={args.indexer_fp8} "
              f"vector_atomics={args.vector_atomics}:")
        print(table([{**e, "dsa": e.get("dsa_options", {})} for e in rows]))


def table(rows) -> str:
    lines = ["| S | DSA fwd ms | DSA bwd ms | DSA fwd+bwd ms | dense fwd+bwd ms | dense / DSA | attn fwd TFLOP/s | "
             "attn bwd TFLOP/s | DSA peak GiB | dense peak GiB | reference fwd+bwd ms |", "|" + " --- |" * 11]
    for e in rows:
        a, d, r = e.get("dsa", {}), e.get("dense", {}), e.get("reference", {})

        def f(x, key, fmt="{:.1f}"):
            return fmt.format(x[key]) if key in x else "-"

        ratio = d["fwdbwd_ms"] / a["fwdbwd_ms"] if "fwdbwd_ms" in a and "fwdbwd_ms" in d else math.nan
        lines.append(f"| {e['S']} | {f(a, 'fwd_ms')} | {f(a, 'bwd_ms')} | {f(a, 'fwdbwd_ms')} | {f(d, 'fwdbwd_ms')} | "
                     f"{ratio:.2f} | {f(a, 'attn_fwd_tflops', '{:.0f}')} | {f(a, 'attn_bwd_tflops', '{:.0f}')} | "
                     f"{f(a, 'peak_gib', '{:.2f}')} | {f(d, 'peak_gib', '{:.2f}')} | {f(r, 'fwdbwd_ms')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
