"""One MoE layer of glm5-proxy, forward + backward, under expert parallelism: megatron's alltoall dispatcher against
the per-rank one (`alltoall_dedup`, pretrain/model/ep_dispatch.py), with the router's own routing and with forced
balance. The layer alone isolates the dispatch from the rest of the step that the scaling run
(`python benchmarks/scaling.py --out OUT_DIR --only ep,balance`) measures.

    torchrun --nproc-per-node 2 benchmarks/ep_dispatch_layer.py --out ep_dispatch_layer.json

Each rank holds `--tokens` tokens (micro-batch x sequence, 4 x 4096 by default: glm5-proxy's micro-batch) in bf16;
the layer's weights are the same for every dispatcher (one build, the dispatcher's class swapped). Times are CUDA-event
medians over `--iters` calls after `--warmup`, per rank, and the table shows the slowest rank's (the all-to-all waits
for it). `rows` is what each rank hands to the dispatch all-to-all per layer call (the combine returns as many; megatron
sends tokens x top-k). `--overlaps` also times `alltoall_dedup` with the all-to-all overlaps of
pretrain/model/moe_overlap.py (shared: the shared expert under the dispatch; chunks: two chunks after routing; both):
    torchrun --nproc-per-node 2 benchmarks/ep_dispatch_layer.py --dispatchers alltoall_dedup \
        --overlaps none,shared,chunks,both --out ep_overlap_layer.json
CPU rehearsal (gloo; megatron's alltoall dispatcher needs CUDA, so dedup only):
    torchrun --nproc-per-node 2 benchmarks/ep_dispatch_layer.py --config configs/models/glm5-tiny.yaml --tokens 64 \
        --iters 2 --warmup 1 --dispatchers alltoall_dedup --overlaps none,both
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


OVERLAPS = {"none": (False, 1), "shared": (True, 1), "chunks": (False, 2), "both": (True, 2)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/models/glm5-proxy.yaml")
    parser.add_argument("--tokens", type=int, default=4 * 4096, help="tokens per rank per layer call")
    parser.add_argument("--dispatchers", default="alltoall,alltoall_dedup")
    parser.add_argument("--overlaps", default="none",
                        help="alltoall_dedup with: none, shared, chunks, both (comma-separated; moe_overlap.py)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", help="results JSON (rank 0 writes it)")
    args = parser.parse_args(argv)
    unknown = set(args.overlaps.split(",")) - set(OVERLAPS)
    if unknown:
        parser.error(f"--overlaps: unknown {sorted(unknown)}; choose from {', '.join(OVERLAPS)}")
    return args


def build_layer(config: str, ep: int):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from parallel.initialize import initialize_parallel
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    # the first MoE layer of a 2-layer cut (dense, MoE), no MTP: the layer's shapes are the config's
    cfg = load_config(config, ["model.num_layers=2", "model.moe_layer_freq=[0,1]", "model.mtp_num_layers=0",
                               "model.moe_token_dispatcher_type=alltoall_dedup",
                               f"parallel.expert_model_parallel_size={ep}"])
    initialize_parallel(cfg.parallel, seed=1)
    layer = build_model(cfg).decoder.layers[1].mlp
    if torch.cuda.is_available():
        layer = layer.cuda().bfloat16()
    classes = {"alltoall": MoEAlltoAllTokenDispatcher, "alltoall_dedup": type(layer.token_dispatcher)}
    return cfg, layer, classes


def time_layer(layer, x, grad, iters: int, warmup: int):
    cuda = x.is_cuda
    times = []
    for i in range(warmup + iters):
        xi = x.detach().requires_grad_(True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        out, _ = layer(xi)
        out.backward(grad)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = 1e3 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    from pretrain import compat

    compat.install()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, layer, classes = build_layer(args.config, world)
    rank = dist.get_rank()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(10 + rank)
    x = torch.randn(args.tokens, 1, cfg.model.hidden_size, device=device, dtype=dtype, generator=g)
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=g)
    topk, experts = cfg.model.moe_router_topk, cfg.model.num_moe_experts
    rows = {}
    original_routing = layer.router.routing

    def counting_routing(logits, *a, **k):  # the dispatch rows, from the routing map of each call
        probs, routing_map = original_routing(logits, *a, **k)
        per_rank = routing_map.view(routing_map.shape[0], world, experts // world)
        rows["alltoall"] = routing_map.shape[0] * topk
        rows["alltoall_dedup"] = int(per_rank.any(-1).sum())
        return probs, routing_map

    layer.router.routing = counting_routing
    results = []
    for balanced in (False, True):
        layer.config.moe_router_force_load_balancing = balanced  # the router reads it per call
        for name in args.dispatchers.split(","):
            layer.token_dispatcher.__class__ = classes[name]
            for overlap in args.overlaps.split(",") if name == "alltoall_dedup" else ["none"]:
                # the layer's own switches, as model.moe_shared_expert_overlap / model.moe_overlap_chunks set them
                layer.shared_under_dispatch, layer.overlap_chunks = OVERLAPS[overlap]
                ms = time_layer(layer, x, grad, args.iters, args.warmup)
                slowest = [None] * world
                dist.all_gather_object(slowest, ms)
                results.append({"dispatcher": name, "overlap": overlap, "forced_balance": balanced,
                                "ms_fwd_bwd_slowest_rank": max(slowest), "ms_fwd_bwd_per_rank": slowest,
                                "rows_dispatched_rank0": rows[name]})
            layer.shared_under_dispatch, layer.overlap_chunks = OVERLAPS["none"]
    if rank == 0:
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"{args.config}: one MoE layer fwd+bwd, EP={world}, {args.tokens} tokens per rank, {device_name}")
        print(f"{'dispatcher':<16}{'overlap':>8}{'balance':>9}{'ms (slowest rank)':>19}{'rows rank 0':>13}")
        for r in results:
            print(f"{r['dispatcher']:<16}{r['overlap']:>8}{'forced' if r['forced_balance'] else 'router':>9}"
                  f"{r['ms_fwd_bwd_slowest_rank']:>19.2f}{r['rows_dispatched_rank0']:>13,}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"config": args.config, "ep": world, "tokens_per_rank": args.tokens, "device": device_name,
                           "results": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
