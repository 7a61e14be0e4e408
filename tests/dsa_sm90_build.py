"""Compile the DSA key-gradient kernels for sm_90 without a GPU (Triton's bundled ptxas) and print, per kernel,
how its fp32 rows reach memory: 16-byte vector reductions against scalar atomics, counted in the PTX.

    TRITON_INTERPRET=0 python -m tests.dsa_sm90_build     (tests/test_dsa_kernels.py runs it)
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pretrain.model.dsa.kernels import indexer_kl, sparse_mla, sparse_mla_dkv

F32 = {"lse_ptr", "delta_ptr", "dkv_ptr", "hs_ptr", "w_ptr", "p_ptr", "stats_ptr", "dq_ptr", "dw_ptr", "dk_ptr"}
I32 = {"idx_ptr", "nv_ptr"}
FLOATS = {"sm_scale", "qk_scale", "scale", "grad_scale"}


def signature(fn, constexprs: dict, overrides=()) -> dict:
    """Triton types of `fn`'s arguments: bf16 tensors, fp32 buffers and int32 indices by name, int32 scalars."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = dict(overrides).get(name, "*fp32" if name in F32 else "*i32" if name in I32 else "*bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def reductions(fn, constexprs: dict, warps: int, stages: int, overrides=()) -> dict:
    src = ASTSource(fn=fn, signature=signature(fn, constexprs, overrides), constexprs=constexprs)
    options = dict(num_warps=warps, num_stages=stages)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    return {"vector": len(re.findall(r"red\.global\.add\.v4\.f32", ptx)),
            "scalar": len(re.findall(r"(?:atom|red)\.global\.[a-z.]*add\.f32", ptx))}


def main():
    mla = dict(C=512, R=64, BC=512, BR=64, PREC="tf32")
    out = {}
    for red in (0, 2):
        out[f"sparse_mla._bwd_kernel RED={red}"] = reductions(
            sparse_mla._bwd_kernel, dict(mla, BH=16, BN=32, CC=64, DKV=0, HEAD_SUMS=True, PART=False, RED=red), 4, 2,
            [("part_ptr", "*fp32"), ("dq32_ptr", "*bf16")])
        out[f"sparse_mla_dkv._dkv_kernel RED={red}"] = reductions(
            sparse_mla_dkv._dkv_kernel, dict(C=512, R=64, BH=64, BN=32, DS=128, NSL=4, ROPE=False, PREC="tf32",
                                             PART=False, RED=red), 4, 3, [("dkv_ptr", "*fp32")])
        out[f"indexer_kl._sparse_kl_kernel RED={red}"] = reductions(
            indexer_kl._sparse_kl_kernel, dict(BH=32, BD=128, BN=64, PREC="tf32", KEYS_M=True, HAS_LSE=True,
                                               DETERMINISTIC=False, RED=red), 4,
            2, [("dq_ptr", "*bf16"), ("part_ptr", "*fp32")])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
