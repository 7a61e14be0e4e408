"""Sparse MLA attention kernels by heads per rank, and their tile configs, in one run on one GPU.

    python lab/dsa/dsa_heads_sweep.py --heads 8,16,32,64 --seqs 4096,16384,32768 --out heads.json

GLM-5 shapes except the head count: absorbed MLA keys of 576 = 512 latent + 64 rope dims, values
512, top-k 2048 from the Triton indexer on random inputs, batch 1, causal. Per (heads, S) and
tile config (the default `kernel_config`, then each of --configs): forward and backward ms,
TFLOP/s in `benchmarks/dsa_kernels.py`'s convention (all S * k slots; forward
2 * S * k * h * (576 + 512), backward 2.53x that), and the errors of output, dq and dkv against
the fp32 PyTorch reference on the same bf16 inputs (S = 4096, default config only). glm5-proxy
has 16 heads; GLM-5 has 64, i.e. 32 / 16 / 8 per rank at TP = 2 / 4 / 8. With --dkv-modes, the
backward again by key-gradient path (`dkv_rows`, `DSAKernelTuning.key_gradient`), e.g.
`--dkv-modes split,fused,none --dkv-configs 64x128x4x3,32x128x4x3`. With --key-partition-mib, the backward again
with its keys walked in L2-sized partitions (`DSAKernelTuning.key_partition_bytes`, one launch per partition; 0 = one
pass; the default rows take the plan's: 96 MiB below 32 heads), e.g.
`--key-partition-mib 0,48,96` (`partition_rows`). With --atomics, the backward again by how the key gradients
reach memory (`kernels.atomics`): `scalar` (Triton's `tl.atomic_add`, the default) and `vector` (16-byte
reductions, sm_90+), e.g. `--atomics vector,scalar` (`atomic_rows`). With --ws, forward and backward again with
the warp-specialized Gluon kernels (64 heads on Hopper) on and off, e.g. `--ws off,on` (`ws_rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_kernels import C, D, SCALE, TOPK, inputs, save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys  # noqa: E402
from pretrain.model.dsa.kernels import atomics  # noqa: E402
from pretrain.model.dsa.kernels import indexer_topk as ttopk  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_dkv as tsm_dkv  # noqa: E402
from pretrain.model.dsa.kernels.hopper.loader import inputs_fit  # noqa: E402
from pretrain.model.dsa.kernels.plan import TRITON, key_partitions  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, KeyGradient  # noqa: E402
from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_attn  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def backward_ms(q, kv, idx, g, reps, tuning):
    """ms of the attention's backward under `tuning` (its forward run once outside the timing)."""
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    o, _ = tsm.sparse_mla_attention(qg, kvg, idx, SCALE, C, False, tuning)
    return timed(lambda: torch.autograd.grad(o, (qg, kvg), g, retain_graph=True), reps)


def errors(q, kv, idx, g):
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out, _ = tsm.sparse_mla_attention(q, kv, idx, SCALE, C)
    dq, dkv = torch.autograd.grad(out, (q, kv), g)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    rout, _ = ref_attn(q32, kv32, idx.long(), SCALE, C, 64)
    rdq, rdkv = torch.autograd.grad(rout, (q32, kv32), g.float())
    return {"out_rel": rel(out, rout), "dq_rel": rel(dq, rdq), "dkv_rel": rel(dkv, rdkv)}


DKV_MODES = {"split": KeyGradient.SEPARATE, "fused": KeyGradient.FUSED, "none": KeyGradient.TIMING_NONE,
             "compute_only": KeyGradient.TIMING_UNWRITTEN}


def dkv_rows(h, s, q, kv, idx, g, reps, modes, dkv_configs):
    """Backward ms by key-gradient mode (`_bwd_kernel`'s DKV): the separate pass over stored dS and P (at
    each of `dkv_configs` too), the fused kernel's atomics, the key gradient computed in the fused kernel
    but not written, none at all (what the rest of the backward costs)."""
    rows = []
    fl = 2 * s * TOPK * h * (C + D) * 2.53
    for name in modes:
        for cfg in [None] + (dkv_configs if name == "split" else []):
            tuning = DSAKernelTuning(key_gradient=DKV_MODES[name], dkv_tiles=None if cfg is None else tuple(cfg))
            ms = backward_ms(q, kv, idx, g, reps, tuning)
            rows.append({"heads": h, "S": s, "dkv_mode": name, "dkv_config": list(tsm_dkv.dkv_config(h, C, cfg)),
                         "bwd_ms": ms, "bwd_tflops": fl / ms / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def partition_rows(h, s, q, kv, idx, g, reps, mibs):
    """Backward ms with the keys walked in partitions of at most `mib` MiB of kv + fp32 dkv rows (0: one launch
    over all keys; the "default" rows take the plan's), the default key-gradient mode of `h` heads."""
    rows = []
    fl = 2 * s * TOPK * h * (C + D) * 2.53
    for mib in mibs:
        tuning = DSAKernelTuning(key_partition_bytes=int(mib * 2**20))  # 0: one pass
        ms = backward_ms(q, kv, idx, g, reps, tuning)
        n = len(key_partitions(kv.shape[1], kv.shape[-1], tsm.attention_plan(q, kv, C, tuning).partition_bytes))
        rows.append({"heads": h, "S": s, "key_partition_mib": mib, "partitions": n, "bwd_ms": ms,
                     "bwd_tflops": fl / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


ATOMICS = {"vector": True, "scalar": False}  # name: DSAKernelTuning.vector_atomics


def atomic_rows(h, s, q, kv, idx, g, reps, names):
    """Backward ms with the key gradients added by 16-byte vector reductions or by scalar atomics, the default
    key-gradient path and partitions of `h` heads."""
    rows = []
    fl = 2 * s * TOPK * h * (C + D) * 2.53
    for name in names:
        ms = backward_ms(q, kv, idx, g, reps, DSAKernelTuning(vector_atomics=ATOMICS[name]))
        # as the backward's dkv
        mode = atomics.reduction_mode(kv.new_empty(0, dtype=torch.float32), C, D - C, vector=ATOMICS[name])
        rows.append({"heads": h, "S": s, "atomics": name, "mode": mode, "bwd_ms": ms, "bwd_tflops": fl / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


WS = {"on": DEFAULT_TUNING,
      "off": DSAKernelTuning(gluon_forward=False, gluon_forward_keys_m=False, gluon_first_pass=False)}


def ws_rows(h, s, q, kv, idx, g, reps, names):
    """Forward and backward ms with the warp-specialized Gluon kernels (on Hopper: at 64 heads the forward and the
    backward's first pass, at 8-32 heads the forward with the keys as M) on or off; elsewhere the switch changes
    nothing (`on` rows say whether they ran)."""
    rows = []
    fl = 2 * s * TOPK * h * (C + D)
    for name in names:
        tuning = WS[name]
        fwd = timed(lambda: tsm.sparse_mla_attention(q, kv, idx, SCALE, C, False, tuning), reps)
        bwd = backward_ms(q, kv, idx, g, reps, tuning)
        ran = inputs_fit(q, kv) and tsm.attention_plan(q, kv, C, tuning).forward != TRITON
        rows.append({"heads": h, "S": s, "ws": name, "ran": ran,
                     "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": fl / fwd / 1e9,
                     "bwd_tflops": fl * 2.53 / bwd / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def point(h, s, gen, reps, configs, modes=(), dkv_configs=(), mibs=(), atomic_names=(), ws_names=()):
    q, kv, qi, ki, w = inputs(s, gen)
    q = q[:, :, :h].contiguous()
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    g = torch.randn(1, s, h, C, device="cuda", dtype=torch.bfloat16)
    fl = 2 * s * TOPK * h * (C + D)
    rows = []
    for cfg in [None] + configs:
        # one tuple for both passes: the forward reads its first three entries
        tiles = None if cfg is None else tuple(cfg)
        tuning = DSAKernelTuning(triton_tiles=tiles)
        row = {"heads": h, "S": s, "config": "default" if cfg is None else list(cfg),
               "fwd_config": list(tsm.kernel_config(h, C, tiles=tiles)),
               "bwd_config": list(tsm.kernel_config(h, C, True, tiles))}
        try:
            row["fwd_ms"] = timed(lambda: tsm.sparse_mla_attention(q, kv, idx, SCALE, C, False, tuning), reps)
            row["bwd_ms"] = backward_ms(q, kv, idx, g, reps, tuning)
            row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = fl * 2.53 / row["bwd_ms"] / 1e9
            if s == 4096 and cfg is None:
                row.update(errors(q, kv, idx, g))
        except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
            row["error"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows += dkv_rows(h, s, q, kv, idx, g, reps, modes, list(dkv_configs)) if modes else []
    rows += atomic_rows(h, s, q, kv, idx, g, reps, atomic_names) if atomic_names else []
    rows += ws_rows(h, s, q, kv, idx, g, reps, ws_names) if ws_names else []
    return rows + (partition_rows(h, s, q, kv, idx, g, reps, mibs) if mibs else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="8,16,32,64")
    ap.add_argument("--seqs", default="4096,16384,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", default="64x8x2x64,64x8x1x64",
                    help="tile configs BN x warps x stages x CC also timed at --config-heads (the defaults: the "
                         "earlier 64-head forward and backward configs, for before / after)")
    ap.add_argument("--config-heads", default="8,16,32")
    ap.add_argument("--dkv-modes", default="", help="also time the backward by key-gradient mode: comma list of "
                    + ", ".join(DKV_MODES))
    ap.add_argument("--dkv-configs", default="", help="configs BN x DS x warps x stages of the key-gradient pass "
                    "also timed with --dkv-modes split")
    ap.add_argument("--key-partition-mib", default="", help="also time the backward with its keys in partitions of "
                    "at most this many MiB of kv + fp32 dkv rows: comma list, 0 = one launch over all keys")
    ap.add_argument("--atomics", default="", help="also time the backward by how key gradients are added: comma "
                    "list of " + ", ".join(ATOMICS))
    ap.add_argument("--ws", default="", help="also time forward and backward with the warp-specialized kernels "
                    "(64 heads, Hopper) on or off: comma list of on, off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = tile_configs(args.configs)
    dkv_configs = tile_configs(args.dkv_configs)
    modes = [m for m in args.dkv_modes.split(",") if m]
    try:
        mibs = [float(x) for x in args.key_partition_mib.split(",") if x]
    except ValueError:
        ap.error(f"--key-partition-mib takes numbers (MiB), got {args.key_partition_mib!r}")
    if any(m < 0 for m in mibs):
        ap.error("--key-partition-mib values must be >= 0")
    atomic_names = [a for a in args.atomics.split(",") if a]
    if set(atomic_names) - set(ATOMICS):
        ap.error(f"unknown --atomics {sorted(set(atomic_names) - set(ATOMICS))}; choose from {list(ATOMICS)}")
    ws_names = [a for a in args.ws.split(",") if a]
    if set(ws_names) - set(WS):
        ap.error(f"unknown --ws {sorted(set(ws_names) - set(WS))}; choose from {list(WS)}")
    if set(modes) - set(DKV_MODES):
        ap.error(f"unknown --dkv-modes {sorted(set(modes) - set(DKV_MODES))}; choose from {list(DKV_MODES)}")
    if any(len(c) != 4 for c in dkv_configs):
        ap.error("--dkv-configs entries are BN x DS x warps x stages, e.g. 32x128x4x3")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for s in (int(x) for x in args.seqs.split(",")):
        for h in (int(x) for x in args.heads.split(",")):
            res["rows"] += point(h, s, gen, args.reps, configs if str(h) in args.config_heads.split(",") else [], modes,
                                 dkv_configs, mibs, atomic_names, ws_names)
            torch.cuda.empty_cache()
    save_json(res, args.out)


if __name__ == "__main__":
    main()
