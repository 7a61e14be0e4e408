"""Output layer + cross-entropy, forward and backward, every backend side by side on one GPU (bf16).

    python benchmarks/output_loss.py --tokens 32768 --out output_loss.json

Shapes: glm5-proxy's head (hidden 2048, vocab 32,768) and GLM-5's (6,144 x 154,880); `--shapes glm5-tp8`
adds one rank's slice of GLM-5's head under TP = 8 (19,360 rows, the chunked backend's use; the
all-reduces are not timed). Backends:

* unfused: megatron-core's path, full logits `h @ W^T` then its vocab-parallel cross-entropy
  (`tensor_parallel.vocab_parallel_cross_entropy`, TP = 1 here);
* chunked-<n>: ours (`pretrain.model.output_loss.chunked_linear_cross_entropy`), n tokens per chunk
  ("auto": `auto_chunk_size`, the logits chunk about --chunk-mib), with TP = 1 arithmetic (the TP > 1
  path adds two all-reduces of [n] and [2, n] per chunk). On CUDA it runs the Triton kernels
  (`pretrain.model.output_loss_kernels`) and sums dW in fp32; `-bf16acc` sums dW in bf16 as Liger does;
  `-torch` is the PyTorch path (fp32 copies of each chunk's logits), for comparison;
* liger: Liger's fused linear cross-entropy (`liger-kernel`).

Each run: median of CUDA-event-timed forward + backward repeats after warm-up, peak memory above the
inputs (hidden, weight, their gradients). A backend that runs out of memory is reported as such. The
last lines give each chunked row's time and memory over Liger's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {"proxy": (2048, 32768), "glm5": (6144, 154880), "glm5-tp8": (6144, 154880 // 8)}


def _unfused(h, w, y):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (h @ w.t()).unsqueeze(1)  # [tokens, 1, vocab]: megatron's [s, b, v]
    return vocab_parallel_cross_entropy(logits, y.unsqueeze(1)).sum()


def _chunked(chunk, chunk_bytes, impl="auto", fp32_grad_weight=True):
    def run(h, w, y):
        from pretrain.model.output_loss import auto_chunk_size, chunked_linear_cross_entropy

        n = auto_chunk_size(h.shape[0], w.shape[0], w.element_size(), chunk_bytes) if chunk == "auto" else int(chunk)
        return chunked_linear_cross_entropy(h, w, y, torch.ones_like(y, dtype=torch.float32), n, impl=impl,
                                            fp32_grad_weight=fp32_grad_weight)[0]
    return run


def _liger(h, w, y):
    from pretrain.model.output_loss import liger_linear_cross_entropy

    return liger_linear_cross_entropy(h, w, y, torch.ones_like(y, dtype=torch.float32))


def measure(fn, hidden: int, vocab: int, tokens: int, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    base = torch.cuda.memory_allocated() + 2 * (h.numel() + w.numel()) * 2  # inputs and their gradients
    times = []
    try:
        for i in range(reps + 2):
            h.grad = w.grad = None
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = fn(h, w, y)
            loss.backward()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    finally:
        del h, w, y
    ms = statistics.median(times)
    flops = 3 * 2 * tokens * hidden * vocab  # logits, dh, dW
    return {"ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1), "loss": float(loss),
            "peak_gib_above_inputs": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)}


def backends(chunks: str, chunk_bytes: int) -> dict:
    out = {"unfused": _unfused, "liger": _liger}
    sizes = chunks.split(",")
    for n in sizes:
        out[f"chunked-{n}"] = _chunked(n, chunk_bytes)
    out[f"chunked-{sizes[0]}-bf16acc"] = _chunked(sizes[0], chunk_bytes, fp32_grad_weight=False)
    out[f"chunked-{sizes[-1]}-torch"] = _chunked(sizes[-1], chunk_bytes, impl="torch")
    return out


def versus_liger(rows: list) -> list:
    """Each chunked row's time and peak memory over Liger's on the same shape."""
    liger = {r["shape"]: r for r in rows if r["backend"] == "liger" and "ms" in r}
    out = []
    for r in rows:
        ref = liger.get(r["shape"])
        if r["backend"].startswith("chunked") and "ms" in r and ref:
            mem = (r["peak_gib_above_inputs"] / ref["peak_gib_above_inputs"]
                   if ref["peak_gib_above_inputs"] > 0 else None)
            out.append({"shape": r["shape"], "backend": r["backend"], "time_vs_liger": round(r["ms"] / ref["ms"], 3),
                        "peak_vs_liger": None if mem is None else round(mem, 3),
                        "peak_gib_minus_liger": round(r["peak_gib_above_inputs"] - ref["peak_gib_above_inputs"], 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--shapes", default="proxy,glm5")
    parser.add_argument("--chunks", default="auto,4096,8192",
                        help="tokens per chunk of the chunked rows, comma-separated; 'auto' sizes by --chunk-mib")
    parser.add_argument("--chunk-mib", type=int, default=1024, help="logits bytes per chunk for --chunks auto")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    from parallel.initialize import ensure_single_rank
    from pretrain.model.output_loss import auto_chunk_size, grad_weight_accumulation, use_kernels

    ensure_single_rank()  # megatron's vocab-parallel cross-entropy asks for its (one-rank) TP group
    probe = torch.zeros(1, 1, device="cuda", dtype=torch.bfloat16)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
               "chunked_path": "triton" if use_kernels(probe, probe) else "torch", "rows": []}
    for shape in args.shapes.split(","):
        hidden, vocab = SHAPES[shape]
        for name, fn in backends(args.chunks, args.chunk_mib << 20).items():
            row = {"shape": shape, "hidden": hidden, "vocab": vocab, "backend": name}
            if "auto" in name:
                row["chunk_tokens"] = auto_chunk_size(args.tokens, vocab, 2, args.chunk_mib << 20)
            row.update(measure(fn, hidden, vocab, args.tokens, args.reps))
            if name.startswith("chunked") and not name.endswith("-torch"):
                row["grad_weight_sum"] = "bf16" if name.endswith("-bf16acc") else grad_weight_accumulation()
            torch.cuda.empty_cache()
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    results["versus_liger"] = versus_liger(results["rows"])
    print(f"chunked path on this GPU: {results['chunked_path']}")
    for r in results["versus_liger"]:
        print(f"{r['shape']:6s} {r['backend']:24s} time x{r['time_vs_liger']:.2f} of liger, "
              f"peak {r['peak_gib_minus_liger']:+.2f} GiB vs liger", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
