"""Parameter counts of a config's model, built on the meta device (no memory is allocated).

    python -m pretrain.model.summary --config configs/models/glm5-744b.yaml [overrides...]

Counts cover every checkpoint tensor (parameters plus the MoE routers' correction biases).
"Active per token" counts each routed expert weight at topk / num_experts of its size (the
share of experts a token visits) and everything else in full; MTP is reported separately.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

_CATEGORIES: List[Tuple[str, str]] = [
    ("dsa_indexer", r"core_attention\.indexer\."),
    ("attention", r"self_attention\."),
    ("router", r"mlp\.router\."),
    ("routed_experts", r"mlp\.experts\."),
    ("shared_experts", r"mlp\.shared_experts\."),
    ("dense_mlp", r"mlp\.linear_fc"),
    ("embedding", r"^embedding\."),
    ("output_layer", r"^output_layer\."),
    ("mtp_projection", r"eh_proj\."),
    ("norms", r"(layernorm|norm)\.weight$"),
]


def category(name: str) -> str:
    for label, pattern in _CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def count_parameters(cfg) -> Dict[str, Dict[str, int]]:
    """{"main"|"mtp": {category: count}} for the whole model (no parallelism) of `cfg`."""
    import dataclasses

    from parallel.initialize import ensure_single_rank
    from pretrain.config.schema import ParallelConfig
    from pretrain.model.builder import build_model

    ensure_single_rank()
    whole = dataclasses.replace(cfg, parallel=ParallelConfig())
    with torch.device("meta"):
        model = build_model(whole)
    counts: Dict[str, Dict[str, int]] = {"main": defaultdict(int), "mtp": defaultdict(int)}
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")]
    for name, tensor in tensors:
        part = "mtp" if name.startswith("mtp.") else "main"
        counts[part][category(name)] += tensor.numel()
    return {k: dict(v) for k, v in counts.items()}


def active_parameters(cfg, counts: Dict[str, Dict[str, int]], part: str = "main") -> int:
    m = cfg.model
    routed = counts[part].get("routed_experts", 0)
    share = (m.moe_router_topk / m.num_moe_experts) if m.num_moe_experts else 0.0
    return sum(counts[part].values()) - routed + int(round(routed * share))


def format_summary(cfg, counts: Dict[str, Dict[str, int]]) -> str:
    cats = sorted({c for part in counts.values() for c in part}, key=lambda c: -counts["main"].get(c, 0))
    lines = [f"{'module type':<16}{'main':>20}{'mtp':>20}"]
    for c in cats:
        lines.append(f"{c:<16}{counts['main'].get(c, 0):>20,}{counts['mtp'].get(c, 0):>20,}")
    main, mtp = sum(counts["main"].values()), sum(counts["mtp"].values())
    lines += [
        "-" * 56,
        f"{'total':<16}{main:>20,}{mtp:>20,}",
        f"total with MTP:            {main + mtp:>20,}  ({(main + mtp) / 1e9:.2f}B)",
        f"total without MTP:         {main:>20,}  ({main / 1e9:.2f}B)",
        f"active per token (no MTP): {active_parameters(cfg, counts):>20,}  ({active_parameters(cfg, counts) / 1e9:.2f}B)",
    ]
    vocab = counts["main"].get("embedding", 0) + counts["main"].get("output_layer", 0)
    lines.append(f"  excluding embedding/head: {active_parameters(cfg, counts) - vocab:>20,}  ({(active_parameters(cfg, counts) - vocab) / 1e9:.2f}B)")
    if mtp:
        lines.append(f"MTP active per depth:      {active_parameters(cfg, counts, 'mtp'):>20,}")
    return "\n".join(lines)


def main(argv=None) -> None:
    from pretrain.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=4")
    args = parser.parse_args(argv)
    from pretrain.notices import configure_logging

    configure_logging()
    cfg = load_config(args.config, args.overrides)
    from pretrain import compat

    compat.install()
    print(format_summary(cfg, count_parameters(cfg)))


if __name__ == "__main__":
    main()
