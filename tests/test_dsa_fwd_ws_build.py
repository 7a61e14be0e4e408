"""The warp-specialized sparse MLA kernels of `pretrain/model/dsa/kernels/hopper/`, the forwards (`forward_heads_m.py`,
and `forward_keys_m.py` for 8-32 heads) and the backward's first pass (`first_pass.py`, `query_gradient.py`), build
for sm_90 without a GPU into what their speed rests on
(`tests/dsa_fwd_ws_build.py`, in a process without the interpreter): warp-group MMAs, cp.async gathers that arrive
on mbarriers, a loader partition with its own register budget, barriers of the eight consumer warps only, and
shared memory within Hopper's 232,448 bytes per block. Their values are tested on the GPU
(tests/test_gpu_dsa_kernels.py); Gluon has no CPU interpreter. On CPU tensors the Triton kernels run."""

import json
import os
import subprocess
import sys

import torch


def test_warp_specialized_forward_builds_for_hopper():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "tests.dsa_fwd_ws_build"], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    builds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(builds) == {"forward 512x64", "forward 256x32", "scores 512x64", "dq 512x64",
                           "forward, keys as M, 16 heads 512x64", "forward, keys as M, 8 heads 256x32",
                           "forward, keys as M, 32 heads 512x64"}
    for shape, b in builds.items():
        assert b["wgmma"] >= 8 and b["cp_async"] > 0 and b["cp_async_arrive_noinc"] > 0, (shape, b)
        assert b["loader_regs"] in b["setmaxnreg"], (shape, b)
        # barriers within one partition: the eight consumer warps, or one (score or keys-as-M) warp group; never all
        one_group = shape.startswith("scores") or "keys as M" in shape
        assert b["barrier_threads"] == ([128] if one_group else [128, 256]), (shape, b)
        assert b["shared"] <= 232448, (shape, b)


def test_cpu_tensors_take_the_triton_kernels():
    from pretrain.model.dsa.kernels.hopper.loader import inputs_fit
    from pretrain.model.dsa.kernels.sparse_mla import attention_plan

    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    for h in (64, 16):
        plan = attention_plan(q[:, :, :h], q[:, :, 0], 512)
        assert (plan.forward, plan.first_pass) == ("triton", "triton") and plan.capability is None
    assert not inputs_fit(q, q[:, :, 0])
