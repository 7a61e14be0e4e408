"""Forward+backward step of a GLM-5-shaped model on one GPU, bf16, side by side:

* grouped: our specs (SDPA/cuDNN core attention, `torch._grouped_mm` experts)
* local:   the same model with megatron-core's local MoE path (SequentialMLP, a loop of experts)
* dense / dsa-triton / dsa-reference (`--variants dense,dsa-triton,dsa-reference`): dense MLA
  attention, or DSA sparse attention with the sparse indexer loss (coefficient 1e-3) on the Triton
  kernels or on the PyTorch reference path (grouped experts in all three)
* torchtitan / torchtitan-sdpa: the peer, torchtitan's DeepSeek-V3 model built at the same dims
  (benchmarks/peer_torchtitan.py says what matches and what cannot), with its flex attention or
  its SDPA module; needs `pip install --no-deps` of peer_torchtitan.REQUIREMENTS

    python benchmarks/model_step.py --config configs/models/glm5-proxy.yaml --out results.json

Reports tokens/s, training FLOPs per token (matrix work, forward + backward, by
`pretrain.training.flops`; the peer also by torchtitan's own `get_nparams_and_flops`), TFLOP/s and
peak memory per variant, and the speed of the first variant over each other one. Timings are the
median of CUDA-event-timed steps after warm-up; inputs are fresh random tokens (never zeros).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch


DSA = dict(dsa_sparse_attention=True, dsa_indexer_loss_coeff=1e-3, dsa_indexer_use_sparse_loss=True)
VARIANTS = {
    "grouped": dict(moe_grouped_gemm=True),
    "local": dict(moe_grouped_gemm=False),
    "dense": dict(moe_grouped_gemm=True, dsa_sparse_attention=False, dsa_indexer_loss_coeff=0.0,
                  dsa_indexer_use_sparse_loss=False),
    "dsa-triton": dict(moe_grouped_gemm=True, dsa_kernel_backend="triton", **DSA),
    "dsa-reference": dict(moe_grouped_gemm=True, dsa_kernel_backend="reference", **DSA),
}
PEERS = {"torchtitan": "flex", "torchtitan-sdpa": "sdpa"}  # variant -> torchtitan attention backend


def time_steps(step, params, vocab: int, micro_batch: int, seq: int, steps: int, warmup: int):
    """Per-step seconds of `step(ids, labels).backward()` after `warmup` steps, and the last loss."""
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, vocab, (micro_batch, seq), device="cuda")
        labels = torch.randint(0, vocab, (micro_batch, seq), device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(ids, labels)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
        for p in params():
            p.grad = None
    return times, loss


def summarize(name: str, times, loss, micro_batch: int, seq: int, flops_per_token: float) -> dict:
    median = statistics.median(times)
    tokens_per_s = micro_batch * seq / median
    return {
        "variant": name,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "tflops_per_s": tokens_per_s * flops_per_token / 1e12,
        "step_s_median": median,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": loss.item(),
    }


def run_peer(cfg, name: str, micro_batch: int, steps: int, warmup: int) -> dict:
    from benchmarks import peer_torchtitan as peer

    m, seq = cfg.model, cfg.data.seq_length
    depths = m.mtp_num_layers or 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    step = peer.PeerStep(m, seq, PEERS[name], depths, "cuda", torch.bfloat16)
    times, loss = time_steps(step, step.parameters, m.vocab_size, micro_batch, seq, steps, warmup)
    result = summarize(name, times, loss, micro_batch, seq, peer.flops_per_token(m, seq, depths)["total"])
    result.update(
        torchtitan_own_flops_per_token=step.own_flops_per_token(seq),
        parameters=sum(p.numel() for p in step.parameters()),
        attention=PEERS[name],
        mtp_depths=depths,
        differences=peer.differences(),
    )
    del step
    return result


def run_variant(cfg, name: str, micro_batch: int, steps: int, warmup: int) -> dict:
    from pretrain.model.builder import build_model
    from pretrain.training.flops import configured_flops_per_step

    if name in PEERS:
        return run_peer(cfg, name, micro_batch, steps, warmup)
    model_cfg = dataclasses.replace(cfg.model, bf16=True, params_dtype="bfloat16", **VARIANTS[name])
    variant = dataclasses.replace(cfg, model=model_cfg)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_model(variant).train()
    seq = cfg.data.seq_length
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(micro_batch, -1)

    def step(ids, labels):
        return model(ids, pos, None, labels=labels).float().mean()

    times, loss = time_steps(step, model.parameters, model_cfg.vocab_size, micro_batch, seq, steps, warmup)
    flops = configured_flops_per_step(model_cfg, seq, 1)  # one token
    result = summarize(name, times, loss, micro_batch, seq, flops)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    del model
    return result


def main() -> None:
    from parallel.initialize import initialize_parallel
    from pretrain.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/glm5-proxy.yaml")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="grouped,local",
                        help=f"comma list of {', '.join(list(VARIANTS) + list(PEERS))}")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    from pretrain import compat

    compat.install()
    initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS and n not in PEERS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS) + list(PEERS)}")
    if any(n in PEERS for n in names):
        from benchmarks import peer_torchtitan

        peer_torchtitan.import_torchtitan()  # a missing install fails here, before any GPU work
        peer_torchtitan.check_mappable(cfg.model)
        for n in names:
            if n in PEERS:
                peer_torchtitan.check_attention_backend(PEERS[n])
    results = [run_variant(cfg, n, args.micro_batch, args.steps, args.warmup) for n in names]
    record = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "config": args.config,
        "overrides": args.overrides,
        "seq_length": cfg.data.seq_length,
        "micro_batch": args.micro_batch,
        "results": results,
        f"{names[0]}_over_{names[-1]}_speed": results[0]["tokens_per_s"] / results[-1]["tokens_per_s"],
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    print(f"{record['gpu']}  seq {cfg.data.seq_length} x mbs {args.micro_batch}  ({args.config})")
    print(f"{'variant':<16}{'tokens/s':>12}{'GFLOP/tok':>11}{'TFLOP/s':>9}{'step ms':>10}{'peak GiB':>10}{'loss':>8}")
    for r in results:
        print(f"{r['variant']:<16}{r['tokens_per_s']:>12,.0f}{r['flops_per_token'] / 1e9:>11.2f}{r['tflops_per_s']:>9.1f}"
              f"{r['step_s_median'] * 1e3:>10.1f}{r['peak_mem_gib']:>10.2f}{r['loss']:>8.3f}")
    for r in results:
        if "torchtitan_own_flops_per_token" in r:
            print(f"{r['variant']}: torchtitan's own count {r['torchtitan_own_flops_per_token'] / 1e9:.2f} GFLOP/token "
                  f"(6 x active params + non-causal attention); differs: {'; '.join(r['differences'])}")
    for r in results[1:]:
        print(f"{names[0]} / {r['variant']} speed: {results[0]['tokens_per_s'] / r['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
