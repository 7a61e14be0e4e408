"""The layout planner's time model against every committed measured layout: writes
benchmarks/results/layout_predictions.{json,md} (prediction, measurement, error, bound), which
tests/test_layout_timing.py holds the model to.

    python benchmarks/layout_predictions.py --out benchmarks/results/layout_predictions

The cases (layout, workload, measurement, source) are pretrain/layout/calibration/checks.json. A case within the
+-15% tokens/s (+-10% peak memory) target gets that bound; one that misses it after honest work gets its measured
error rounded up to the next percent, and pretrain.layout.calibration.checks.MISSES says why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from the repository root

TARGET_TPS, TARGET_MEM = 0.15, 0.10
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# tests/test_checkpoint_async.py::test_sync_save_keeps_pinned_staging_unless_told_not_to: its model, its GPU log
STAGING_TEST_MODEL = ["model.bf16=true", "model.params_dtype=bfloat16", "optimizer.optimizer=muon", "data.mock=true",
                      "model.vocab_size=1024", "data.seq_length=64", "train.micro_batch_size=2",
                      "train.global_batch_size=2", "model.hidden_size=512", "model.moe_ffn_hidden_size=1024",
                      "model.num_moe_experts=48"]
STAGING_TEST_LOG = "soak_h200/sync_staging/gpu_test.log"
# Host memory a synchronous save keeps (pretrain/layout/host_memory.py): (case, config, overrides, GPUs, source)
HOST_CASES = [
    ("h200 glm5-proxy 1gpu, sync saves (11-28)", "configs/models/glm5-proxy.yaml",
     ["train.global_batch_size=4", "train.micro_batch_size=4"], 1, "soak_h200/save_proxy_b/soak_false.json"),
    ("h200 glm5-proxy dp2, sync saves, rank 0 (11-29)", "configs/models/glm5-proxy.yaml",
     ["train.global_batch_size=8", "train.micro_batch_size=4"], 2, "soak_2xh200/save2_async_false.json"),
    ("h200 glm5-tiny 48 experts, two sync saves (11-29)", "configs/models/glm5-tiny.yaml", STAGING_TEST_MODEL, 1,
     STAGING_TEST_LOG),
]



def staging_test_result() -> dict:
    """What `tests/test_checkpoint_async.py::test_sync_save_keeps_pinned_staging_unless_told_not_to` printed on the GPU:
    {"pinned" | "pageable": {"before", "after" (host RSS, bytes), "written" (two saves' .distcp bytes)}}."""
    import ast

    with open(os.path.join(RESULTS, STAGING_TEST_LOG)) as f:
        return ast.literal_eval(next(line for line in f if line.startswith("{'pinned'")))


def measured_host_kept(source: str) -> float:
    """Bytes of host RSS the first synchronous save left (a soak's rank 0), or the GPU test's pinned side."""
    if source == STAGING_TEST_LOG:
        got = staging_test_result()["pinned"]
        return float(got["after"] - got["before"])
    with open(os.path.join(RESULTS, source)) as f:
        run = json.load(f)
    first = run["saves"][0]["step"]
    rss = {s["step"]: s["host_rss_gib"] for s in run["samples"]}
    return (rss[first + 1] - rss[first - 1]) * 2**30


def host_rows() -> List[dict]:
    """Every HOST_CASES entry: the planner's kept checkpoint staging against the measured host RSS."""
    from pretrain.config import load_config
    from pretrain.layout.from_config import layout_of
    from pretrain.layout.host_memory import host_estimate
    from pretrain.layout.types import ModelDims

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    rows = []
    for case, config, overrides, gpus, source in HOST_CASES:
        cfg = load_config(os.path.join(root, config), overrides)
        layout, work = layout_of(cfg, gpus)
        predicted = host_estimate(ModelDims.from_config(cfg), layout, work, 8, saves=True).terms["checkpoint_staging"]
        measured = measured_host_kept(source)
        rows.append({"id": case, "measured_gib": measured / 2**30, "predicted_gib": predicted / 2**30,
                     "error": predicted / measured - 1, "source": source})
    return rows


def write_predictions(prefix: str) -> None:
    """benchmarks/results/layout_predictions.{json,md}: every case of checks.json, predicted against measured."""
    from pretrain.layout.calibration.checks import MISSES, load_checks, predict_all

    rows = predict_all()
    cases = {c["id"]: c for c in load_checks()}
    for r in rows:
        e = abs(r["error"])
        r["bound"] = TARGET_TPS if e <= TARGET_TPS else math.ceil(e * 100 + 0.5) / 100
        r["within_target"] = e <= TARGET_TPS
        if r.get("memory_error") is not None:
            m = abs(r["memory_error"])
            r["memory_bound"] = TARGET_MEM if m <= TARGET_MEM else math.ceil(m * 100 + 0.5) / 100
    host = host_rows()
    with open(prefix + ".json", "w") as f:
        json.dump({"about": "python benchmarks/layout_predictions.py --out " + prefix, "rows": rows,
                   "host_rows": host}, f, indent=1)
        f.write("\n")
    checks = [r for r in rows if r["role"] == "check"]
    ok = sum(r["within_target"] for r in checks)
    lines = [
        "# Layout planner: predicted against measured (tokens/s per GPU, peak memory, host memory)",
        "",
        "Every committed measurement of a training layout (glm5-proxy; 1, 2 and 4 GPUs; H200 and H100) against",
        "the time model of `pretrain/layout/timing.py` with the calibration tables",
        "`pretrain/layout/calibration/{h100,h200}.json`. The cases, with their sources, are",
        "`pretrain/layout/calibration/checks.json`; `tests/test_layout_timing.py` recomputes every prediction on CPU",
        "and holds it to this table (bound: the +-15% target, or the honestly measured error where a case misses it).",
        "Regenerate: `python benchmarks/layout_predictions.py --out benchmarks/results/layout_predictions` (after",
        "`python benchmarks/layout_calibration_results.py --gpu h200 --out pretrain/layout/calibration/h200.json`,",
        "and h100, if the calibration changed; after any meant change of `pretrain/layout/timing.py`, `memory.py` or",
        "`host_memory.py`).",
        "",
        f"**{ok} of {len(checks)} checks within +-15% tokens/s**; {len(rows) - len(checks)} runs are calibration "
        "points (a calibration entry was fitted to them: their error is not a check).",
        "",
        "| case | GPU | layout | seq x batch | measured tok/s/GPU | predicted | error | bound | role | source (date) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    from pretrain.layout.types import Layout
    for r in rows:
        c = cases[r["id"]]
        lay = dict(c["layout"])
        lay.setdefault("dp", 1)
        short = Layout(**lay).short()
        src = c["source"]["file"].split(" (")[0].replace("benchmarks/results/", "")
        mark = "" if r["within_target"] else " **miss**"
        lines.append(f"| {r['id']} | {c['source']['gpu']} | `{short}` | {c['workload']['seq_length']} x "
                     f"{c['workload']['global_batch_size']} | {r['measured_tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['error'] * 100:+.1f}%{mark} | "
                     f"{r['bound'] * 100:.0f}% | {r['role']} | {src} ({c['source']['date']}) |")
    mem = [r for r in rows if r.get("memory_error") is not None]
    if mem:
        lines += ["", "## Peak memory (where the run recorded it; `pretrain/layout/memory.py`)", "",
                  "| case | measured GiB | predicted GiB | error | bound |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in mem:
            miss = "" if abs(r["memory_error"]) <= TARGET_MEM else " **miss**"
            lines.append(f"| {r['id']} | {r['measured_peak_gib']:.1f} | {r['predicted_peak_gib']:.1f} | "
                         f"{r['memory_error'] * 100:+.1f}%{miss} | "
                         f"{r['memory_bound'] * 100:.0f}% |")
    lines += ["", "## Host memory a synchronous save keeps (`pretrain/layout/host_memory.py`, its checkpoint staging)",
              "", "| case | measured GiB | predicted GiB | error | bound | source |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in host:
        lines.append(f"| {r['id']} | {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} | {r['error'] * 100:+.1f}% | "
                     f"{TARGET_MEM * 100:.0f}% | {r['source']} |")
    lines += ["", "## Why the misses miss", ""]
    for key, text in MISSES.items():
        lines.append(f"- **{key}**: {text}")
    lines += ["", "## What the calibration measured and what it assumes", ""]
    for gpu in ("h200", "h100"):
        from pretrain.layout.calibration import load_calibration
        cal = load_calibration(gpu)
        by_kind: Dict[str, List[str]] = {}
        for k, v in cal.entries.items():
            by_kind.setdefault(v["kind"], []).append(k)
        lines.append(f"- {gpu.upper()}: " + "; ".join(f"{kind} ({len(v)}): {', '.join(sorted(v))}"
                                                       for kind, v in sorted(by_kind.items())))
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {prefix}.json/.md: {ok} of {len(checks)} checks within 15%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.json and PREFIX.md")
    write_predictions(ap.parse_args(argv).out)


if __name__ == "__main__":
    main()
