"""What staging a synchronous checkpoint save to host memory costs, in seconds and in host memory kept after it.

    python benchmarks/host_staging.py --gib 21.6 --repeats 3 --out host_staging.json [--ways pinned_kept,pageable]

megatron-core 0.16.1 stages a save's GPU tensors with `FileSystemWriterAsync.preload_tensors(buckets,
non_blocking=True)`: `tensor.to("cpu", non_blocking=True)`, whose destination PyTorch takes from its caching
host allocator (pinned memory, sizes rounded up to a power of two, freed blocks kept for reuse). In a
synchronous save that runs in the trainer, so the trainer keeps the pinned blocks after the save. This script
stages the same set of GPU tensors `--repeats` times in each of three ways, each way in a fresh process:

* `pinned_kept`: megatron's staging as it is (a synchronous save's default, `checkpoint.pinned_staging=true`);
* `pinned_released`: the same, then the allocator's cached pinned blocks are returned to the system
  (`torch.accelerator.empty_host_cache`): the pinning is paid again at every save;
* `pageable`: `non_blocking=False` (ordinary host memory, returned to the system when freed), what
  `checkpoint.pinned_staging=false` does (`pretrain.compat.pageable_staging`).

For each staging: seconds (staging and, where it applies, the release), and the process's resident memory once
the staged copies are dropped. The tensors: `--gib` in all, sizes log-uniform between 1 and 400 MiB (a fixed seed),
bf16 and fp32 as a model's weights and optimizer state are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.soak import proc_status  # noqa: E402

WAYS = ("pinned_kept", "pinned_released", "pageable")


def tensor_sizes(total_bytes: int, seed: int = 0):
    """(bytes, dtype name) pairs, log-uniform in size between 1 and 400 MiB, summing to about `total_bytes`."""
    import random

    rng, sizes, left = random.Random(seed), [], total_bytes
    while left > 2**20:
        size = min(left, int(2 ** rng.uniform(20, 20 + 8.64)))  # 1 MiB .. 400 MiB
        sizes.append((size - size % 4, "bfloat16" if len(sizes) % 3 == 0 else "float32"))
        left -= size
    return sizes


def rss_gib() -> float:
    return proc_status("VmRSS") / 2**20


def empty_host_cache() -> bool:
    import torch

    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if release is None:
        return False
    release()
    return True


def one_way(way: str, gib: float, repeats: int) -> dict:
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    sizes = tensor_sizes(int(gib * 2**30))
    tensors = [torch.empty(n // getattr(torch, d).itemsize, dtype=getattr(torch, d), device="cuda").fill_(1)
               for n, d in sizes]
    buckets = [("file_0", "key_0", ([], [(i, t) for i, t in enumerate(tensors)]))]
    torch.cuda.synchronize()
    rows = [{"repeat": 0, "rss_gib": rss_gib()}]
    for r in range(1, repeats + 1):
        start = time.perf_counter()
        staged = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=way != "pageable")
        staged_s = time.perf_counter() - start
        rss_staged = rss_gib()
        del staged
        released = way == "pinned_released" and empty_host_cache()
        rows.append({"repeat": r, "seconds": round(time.perf_counter() - start, 3), "staged_s": round(staged_s, 3),
                     "rss_staged_gib": round(rss_staged, 2), "rss_gib": round(rss_gib(), 2), "released": released})
    return {"way": way, "tensors": len(sizes), "bytes": sum(n for n, _ in sizes), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=21.6, help="GiB of GPU tensors staged (glm5-proxy's state: 21.6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--out", default="host_staging.json")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args(argv)
    if args.way:
        print(json.dumps(one_way(args.way, args.gib, args.repeats)))
        return 0
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)} (choose from {', '.join(WAYS)})")
    import torch

    results = {"gib": args.gib, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ways": []}
    for way in ways:
        proc = subprocess.run([sys.executable, __file__, "--way", way, "--gib", str(args.gib),
                               "--repeats", str(args.repeats)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"host_staging: {way} failed: {proc.stderr.strip().splitlines()[-1:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results["ways"].append(result)
        for row in result["rows"][1:]:
            print(f"{way:16s} repeat {row['repeat']}: {row['seconds']:6.2f} s (staging {row['staged_s']:.2f}), "
                  f"RSS {row['rss_staged_gib']:.1f} GiB staged, {row['rss_gib']:.1f} GiB after "
                  f"(before: {result['rows'][0]['rss_gib']:.1f})", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
