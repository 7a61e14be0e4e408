"""Which layers each pipeline stage holds, from the config alone (no process group, no megatron import).

A stage's content is a list of entries, megatron-core's `pipeline_model_parallel_layout` letters:
"E" the embedding, "t" one decoder layer, "m" one MTP depth, "L" the output layer and loss.
Virtual stage i = vpp_rank x PP + pp_rank (megatron's order: the data visits pp ranks 0..PP-1 in
virtual chunk 0, then again in chunk 1, ...). `stage_entries` resolves every way the config can place
layers, following megatron-core 0.16.1's rules (TransformerConfig.__post_init__,
`get_num_layers_to_build`, `get_transformer_layer_offset`, `PipelineParallelLayerLayout`):

* `parallel.pipeline_model_parallel_layout`: the string, e.g. "Et*3|(tt|)*2,tmmm|L";
* `parallel.num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`: those ranks'
  layers, the rest even over the middle ranks; each rank's layers even over its virtual chunks;
* `parallel.account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`: the
  embedding / loss count as one layer of the even split;
* none: num_layers / (PP x VPP) per virtual stage.

MTP ("m" x mtp_num_layers) sits on the last stage unless the layout places it; a layout may put it
on the stage before the last (GLM-5's placement: MTP's embedding and layer on the second-to-last
stage, its output layer with the main head on the last), and the last stage then holds only "L".
Every inconsistency raises `ConfigError` with one line naming the keys.
"""

from __future__ import annotations

import re
from typing import List

from pretrain.config.errors import require
from pretrain.config.schema import ModelConfig, ParallelConfig

LAYOUT_KEY = "parallel.pipeline_model_parallel_layout"
_SPLIT_KEYS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def parse_layout(text: str) -> List[List[str]]:
    """megatron's layout grammar: stages split by "|", "(...)*n" and "x*n" repeat, commas are cosmetic."""
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        flat = re.sub(pattern, lambda g: g.group(1) * int(g.group(2)), flat)
    stages = [list(stage) for stage in flat.split("|")]
    bad = sorted({c for stage in stages for c in stage} - set("ELtm"))
    require(not bad, f"{LAYOUT_KEY} ({text!r}) has unknown letters {bad}; use E (embedding), t (decoder layer), "
                     "m (MTP depth), L (loss), | between stages, (..)*n and x*n to repeat")
    return stages


def format_layout(stages: List[List[str]]) -> str:
    """The layout string of `stages`, runs of one letter written x*n."""
    def stage(entries: List[str]) -> str:
        out = []
        for letter in "EtmL":
            n = entries.count(letter)
            out.append("" if n == 0 else letter if n == 1 else f"{letter}*{n}")
        return "".join(out)

    return "|".join(stage(s) for s in stages)


def microbatch_group_ok(pp: int, group: int, microbatches: int) -> bool:
    """megatron-core's rule for `microbatch_group_size_per_vp_stage` (its interleaved schedule raises otherwise):
    PP <= group <= micro-batches, and the last group empty or at least PP."""
    return pp <= group <= microbatches and not 0 < microbatches % group < pp


def stage_entries(m: ModelConfig, p: ParallelConfig) -> List[List[str]]:
    """The entries of every virtual stage (PP x VPP lists, megatron's order); raises ConfigError."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    depths = m.mtp_num_layers or 0
    if p.pipeline_model_parallel_layout is not None:
        return _from_layout(p.pipeline_model_parallel_layout, m.num_layers, depths, pp, vpp, p)
    counts = _decoder_counts(m.num_layers, pp, vpp, p)
    stages = [["t"] * n for n in counts]
    stages[0].insert(0, "E")
    stages[-1] += ["m"] * depths + ["L"]
    return stages


def mtp_pipeline_ranks(stages: List[List[str]], pp: int) -> List[int]:
    """The pipeline ranks holding MTP depths."""
    return sorted({i % pp for i, stage in enumerate(stages) if "m" in stage})


def _from_layout(text: str, num_layers: int, depths: int, pp: int, vpp: int, p: ParallelConfig) -> List[List[str]]:
    conflicting = [k for k in _SPLIT_KEYS if getattr(p, k)]
    require(not conflicting, f"{LAYOUT_KEY} cannot be combined with parallel.{conflicting[0] if conflicting else ''}; "
                             "set one of them")
    stages = parse_layout(text)
    require(len(stages) == pp * vpp,
            f"{LAYOUT_KEY} has {len(stages)} stages but parallel.pipeline_model_parallel_size x "
            f"virtual_pipeline_model_parallel_size is {pp} x {vpp} = {pp * vpp}; write one stage per (virtual) stage")
    flat = [e for s in stages for e in s]
    require(flat[:1] == ["E"] and flat.count("E") == 1,
            f"{LAYOUT_KEY} must start with the embedding E, once ({text!r})")
    require(flat[-1:] == ["L"] and flat.count("L") == 1, f"{LAYOUT_KEY} must end with the loss L, once ({text!r})")
    require(flat.count("t") == num_layers,
            f"{LAYOUT_KEY} places {flat.count('t')} decoder layers t but model.num_layers is {num_layers}")
    require(flat.count("m") == depths,
            f"{LAYOUT_KEY} places {flat.count('m')} MTP depths m but model.mtp_num_layers is {depths or 'null'}; "
            "write m once per depth (shared-layer MTP too)")
    if depths:
        at = [i for i, s in enumerate(stages) if "m" in s]
        first_m = flat.index("m")
        require(len(at) == 1 and "t" not in flat[first_m:] and at[0] >= len(stages) - 2
                and (at[0] == len(stages) - 1 or stages[-1] == ["L"]),
                f"{LAYOUT_KEY}: all MTP depths m must sit after the last decoder layer, in the last stage or in the "
                f"stage before it with the last stage holding only L ({text!r})")
    return stages


def _decoder_counts(num_layers: int, pp: int, vpp: int, p: ParallelConfig) -> List[int]:
    """Decoder layers per virtual stage without a layout (megatron-core 0.16.1's split rules)."""
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    emb, loss = p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split
    vpp_key = " x parallel.virtual_pipeline_model_parallel_size" if vpp > 1 else ""
    require(not ((first is not None or last is not None) and (emb or loss)),
            "parallel.num_layers_in_first/last_pipeline_stage cannot be combined with "
            "parallel.account_for_embedding/loss_in_pipeline_split; set one kind")
    per_rank = [0] * pp
    if first is not None or last is not None:
        require(pp > 1, "parallel.num_layers_in_first/last_pipeline_stage need parallel.pipeline_model_parallel_size > 1")
        for key, value in (("first", first), ("last", last)):
            require(value is None or value > 0, f"parallel.num_layers_in_{key}_pipeline_stage must be > 0 (got {value})")
        middle = num_layers - (first or 0) - (last or 0)
        middle_ranks = pp - (first is not None) - (last is not None)
        require(middle >= 0 and (middle == 0) == (middle_ranks == 0) and (middle_ranks == 0 or middle % middle_ranks == 0),
                f"model.num_layers ({num_layers}) minus parallel.num_layers_in_first/last_pipeline_stage "
                f"({first}, {last}) = {middle} must split evenly over the {middle_ranks} middle pipeline ranks")
        per_rank = [middle // middle_ranks if middle_ranks else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        for rank, n in enumerate(per_rank):
            require(n % vpp == 0, f"pipeline rank {rank} holds {n} layers, not divisible by "
                                  f"parallel.virtual_pipeline_model_parallel_size ({vpp}); change "
                                  "parallel.num_layers_in_first/last_pipeline_stage")
    else:
        total = num_layers + emb + loss
        counted = (" (+1 for account_for_embedding_in_pipeline_split)" if emb else "") + (
            " (+1 for account_for_loss_in_pipeline_split)" if loss else "")
        require(total % (pp * vpp) == 0,
                f"model.num_layers ({num_layers}){counted} must be divisible by parallel.pipeline_model_parallel_size "
                f"({pp}){vpp_key} ({vpp}); change the sizes, or place layers with {LAYOUT_KEY} "
                "(python -m pretrain.tools.pipeline_split prints a balanced one)")
        per_rank = [total // pp] * pp
    counts = [per_rank[i % pp] // vpp for i in range(pp * vpp)]
    if not (first is not None or last is not None):
        counts[0] -= emb
        counts[-1] -= loss
    return counts
