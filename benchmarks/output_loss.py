"""Output layer + cross-entropy, forward and backward, every backend side by side on one GPU (bf16).

    python benchmarks/output_loss.py --tokens 32768 --out output_loss.json

Shapes: glm5-proxy's head (hidden 2048, vocab 32,768) and GLM-5's (6,144 x 154,880). Backends:

* unfused: megatron-core's path, full logits `h @ W^T` then its vocab-parallel cross-entropy
  (`tensor_parallel.vocab_parallel_cross_entropy`, TP = 1 here);
* chunked-<n>: ours (`pretrain.model.output_loss.chunked_linear_cross_entropy`), n tokens per chunk,
  with TP = 1 arithmetic (the TP > 1 path adds one all-reduce of [n] max / sum / target per chunk);
* liger: Liger's fused linear cross-entropy (`liger-kernel`).

Each run: median of CUDA-event-timed forward + backward repeats after warm-up, peak memory above the
inputs (hidden, weight, their gradients). A backend that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {"proxy": (2048, 32768), "glm5": (6144, 154880)}


def _unfused(h, w, y):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (h @ w.t()).unsqueeze(1)  # [tokens, 1, vocab]: megatron's [s, b, v]
    return vocab_parallel_cross_entropy(logits, y.unsqueeze(1)).sum()


def _chunked(n):
    def run(h, w, y):
        from pretrain.model.output_loss import chunked_linear_cross_entropy

        return chunked_linear_cross_entropy(h, w, y, torch.ones_like(y, dtype=torch.float32), n)[0]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--shapes", default="proxy,glm5")
    parser.add_argument("--chunks", default="2048,4096,8192")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    from parallel.initialize import ensure_single_rank

    ensure_single_rank()  # megatron's vocab-parallel cross-entropy asks for its (one-rank) TP group
    backends = {"unfused": _unfused, "liger": _liger}
    backends.update({f"chunked-{n}": _chunked(int(n)) for n in args.chunks.split(",")})
    results = {"gpu": torch.cuda.get_device_name(), "tokens": args.tokens, "rows": []}
    for shape in args.shapes.split(","):
        hidden, vocab = SHAPES[shape]
        for name, fn in backends.items():
            row = {"shape": shape, "hidden": hidden, "vocab": vocab, "backend": name,
                   **measure(fn, hidden, vocab, args.tokens, args.reps)}
            torch.cuda.empty_cache()
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
