"""The auxiliary losses the trainer logs (`pretrain.model.aux_losses`), against a naive recomputation.

One training step of the tiny GLM-5 (dense first layer, an MoE layer, 3 MTP depths sharing one MoE
layer, DSA with a trained indexer) runs through `Trainer.train_step` while hooks record what the
model computed on each micro-batch: the batch, the logits of each MTP depth and of the main head
(the output layer's outputs), each router's input and weight, and each DSA layer's indexer loss.
From these the test recomputes in float64, without the trackers, the auto-scalers or `AuxLoss`:

* `mtp_loss_<d>`: per micro-batch, CE(logits of depth d at position i, labels[i + d]) averaged
  over the loss-masked targets that exist (i + d < s); then the mean over micro-batches and ranks;
* `aux_loss`: the sequence-level load-balancing loss (DeepSeek-V3 eq. 17-20; megatron's
  `seq_aux_loss`) before its coefficient, from sigmoid scores normalized per token and each
  token's top-k experts: per sequence sum_e (E / (K S)) count_e * mean_t score_e, averaged over the
  sequences; summed per layer over micro-batches (and over the depths of the shared MTP layer), then
  averaged over MoE layers, micro-batches and ranks;
* `indexer_loss`: per layer the mean of its losses over micro-batches (and MTP depths), then the
  mean over layers, averaged over ranks; also the per-layer keys. (The KL itself is checked against
  a naive reference in tests/test_dsa_model_indexer_loss.py; here the reductions are.)

The LM loss is recomputed from the main head's logits too, which also pins which output-layer call
is which. With 2 ranks (data parallel) each rank sees other micro-batches: the reference averages
the ranks' recomputations.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks_eager as run_ranks  # the naive recomputation runs here, on what the ranks captured

ROOT = Path(__file__).resolve().parents[1]


def overrides(data: Path, run_dir: Path, world_size: int):
    return [
        "model.vocab_size=1024", "data.seq_length=64", "data.mock=false", f"data.data_path=[{data / 'json'}]",
        f"data.tokenizer={data / 'tokenizer.json'}", "data.split=90,10,0", "train.micro_batch_size=4",
        f"train.global_batch_size={8 * world_size}", "train.train_iters=2", "train.eval_interval=null",
        "optimizer.lr_warmup_iters=0", "model.dsa_indexer_loss_coeff=0.5", f"logging.run_dir={run_dir}",
    ]


class Recording:
    """An iterator that keeps what it yields."""

    def __init__(self, inner):
        self.inner, self.items = inner, []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.inner)
        self.items.append({k: v.clone() if torch.is_tensor(v) else v for k, v in item.items()})
        return item


def _step_with_capture(rank, world_size, args):
    from megatron.core.transformer.moe.router import TopKRouter

    from pretrain.config import load_config
    from pretrain.model.dsa import DSACoreAttention
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), args))
    model = trainer.model[0]
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    logits, routers, indexer = [], [], []
    model.output_layer.register_forward_hook(lambda m, i, out: logits.append(out[0].detach().double()))
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_pre_hook(lambda m, i: routers.append(
                (m.layer_number, i[0].detach().clone(), m.weight.detach().clone())))
    original = DSACoreAttention._attach

    def attach(self, out, loss, coeff):
        indexer.append((self.layer_number, float(loss)))
        return original(self, out, loss, coeff)

    DSACoreAttention._attach = attach
    trainer.train_iter = Recording(trainer.train_iter)
    values = trainer.train_step()
    m = trainer.cfg.model
    return {"values": values, "batches": trainer.train_iter.items, "logits": logits, "routers": routers,
            "indexer": indexer, "num_microbatches": trainer.num_microbatches, "depths": m.mtp_num_layers,
            "num_layers": m.num_layers, "topk": m.moe_router_topk, "experts": m.num_moe_experts}


def masked_ce(logits_bsv: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    ce = F.cross_entropy(logits_bsv.reshape(-1, logits_bsv.shape[-1]), labels.reshape(-1), reduction="none")
    mask = mask.reshape(-1).double()
    return float((ce * mask).sum() / mask.sum())


def naive_seq_aux_loss(x: torch.Tensor, weight: torch.Tensor, topk: int) -> float:
    """x [s, b, h] router input, weight [E, h]."""
    s, b, _ = x.shape
    experts = weight.shape[0]
    # the selection in the router's own precision (fp32 logits), the loss in float64
    chosen = torch.sigmoid(F.linear(x.float(), weight.float())).topk(topk, dim=-1).indices  # [s, b, K]
    scores = torch.sigmoid(x.double() @ weight.double().T)
    scores = scores / scores.sum(-1, keepdim=True)
    total = 0.0
    for seq in range(b):
        counts = torch.zeros(experts, dtype=torch.float64)
        for t in range(s):
            for e in chosen[t, seq].tolist():
                counts[e] += 1
        total += float((experts / (topk * s) * counts * scores[:, seq].mean(0)).sum())
    return total / b


def reference(result: dict) -> dict:
    """The logged numbers of one rank, recomputed from what its model computed."""
    depths, n_mb = result["depths"], result["num_microbatches"]
    calls = depths + 1  # output-layer calls per micro-batch: the depths', then the main head's
    assert len(result["logits"]) == calls * n_mb and len(result["batches"]) == n_mb
    out = defaultdict(float)
    for mb, batch in enumerate(result["batches"]):
        labels, mask = batch["labels"], batch["loss_mask"]
        s = labels.shape[1]
        per_call = [lg.transpose(0, 1) for lg in result["logits"][calls * mb: calls * (mb + 1)]]
        out["loss"] += masked_ce(per_call[-1], labels, mask) / n_mb
        for d in range(1, depths + 1):
            out[f"mtp_loss_{d}"] += masked_ce(per_call[d - 1][:, : s - d], labels[:, d:], mask[:, d:]) / n_mb
    per_slot = defaultdict(float)
    for layer, x, weight in result["routers"]:
        per_slot[layer] += naive_seq_aux_loss(x, weight, result["topk"])
    out["aux_loss"] = sum(per_slot.values()) / len(per_slot) / n_mb
    mtp_slot = result["num_layers"] + 1
    by_layer = defaultdict(list)
    for layer, loss in result["indexer"]:
        by_layer[min(layer, mtp_slot)].append(loss)
    means = {layer: sum(v) / len(v) for layer, v in by_layer.items()}
    out["indexer_loss"] = sum(means.values()) / len(means)
    for layer, value in means.items():
        out["indexer_loss/" + ("mtp" if layer == mtp_slot else f"layer_{layer:02d}")] = value
    return dict(out)


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "dp2"])
def test_logged_aux_losses_match_naive_recomputation(stdlib_data, tmp_path, world_size):
    results = run_ranks(_step_with_capture, world_size, overrides(stdlib_data, tmp_path, world_size))
    first = results[0]
    assert first["num_microbatches"] == 2 and first["depths"] == 3
    # the shared MTP layer is an MoE layer and has an indexer: both appear once per depth
    assert len({layer for layer, _, _ in first["routers"]}) == 2
    assert len(first["routers"]) == 2 * (1 + first["depths"])
    refs = [reference(r) for r in results]
    expected = {key: sum(r[key] for r in refs) / world_size for key in refs[0]}
    assert {"mtp_loss_1", "mtp_loss_3", "aux_loss", "indexer_loss", "indexer_loss/layer_01",
            "indexer_loss/layer_02", "indexer_loss/mtp"} <= set(expected)
    for rank, result in enumerate(results):  # every rank logs the same numbers
        logged = result["values"]
        wrong = {key: (logged.get(key), value) for key, value in expected.items()
                 if logged.get(key) != pytest.approx(value, rel=1e-5, abs=1e-9)}
        assert not wrong, f"rank {rank}, logged vs recomputed: {wrong}"
