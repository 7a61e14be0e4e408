"""DSA's sparse path keeps less for backward than dense attention, and computes the same thing.

* `SparseMLACore` (pretrain/model/dsa/sparse_core.py: absorb + sparse attention + expand in one
  autograd function, keeping its latent output or recomputing it) against a float64 composition of
  plain autograd operations written here (absorbed query, softmax over each token's gathered keys,
  up-projected values): output, log-sum-exp and every input's gradient, on the reference backend and
  on the Triton kernels (interpreted on CPU), with empty (-1) slots as documents leave them.
* The whole model, sparse attention + sparse indexer loss with a shared indexer layer and packed
  documents: megatron's selective recompute of the core attention (`recompute_modules: [core_attn]`,
  which recomputes only the sparse attention, not the top-k) gives the plain run's loss, per-layer
  indexer loss and every gradient.
* What autograd keeps per token for one attention layer, counted with saved-tensor hooks
  (`pretrain.training.saved_activations`) at the proxy model's head counts and dims, bf16: the sparse
  path (with its indexer loss) keeps fewer bytes per token than dense attention, whose SDPA runs
  its flash kernel (which keeps q, k, v, the output and the log-sum-exp, as the GPU kernels do;
  CPU's default math kernel would keep the [S, S] probabilities); the bytes grow linearly with the
  sequence length and no kept tensor is [S, S].
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from pretrain.model.dsa.backend import ReferenceBackend, TritonBackend
from pretrain.model.dsa.sparse_core import sparse_mla_core
from tests.distributed import EAGER_ENV, run_ranks

TOL = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a.double() - b.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def core_case(seed: int, s=11, b=2, h=3, dn=5, dr=4, c=16, dv=7, k=5):
    """Inputs of the sparse core (fp32) and top-k indices with -1 slots (documents restart at s // 2)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, h, dn + dr, generator=gen)
    q_nope, q_pe = q[..., :dn], torch.randn(s, b, h, dr, generator=gen)  # q_nope a view, as in the layer
    latent, k_pe = torch.randn(s, b, c, generator=gen), torch.randn(s, b, 1, dr, generator=gen)
    weight = torch.randn(h * (dn + dv), c, generator=gen) * c**-0.5
    idx = torch.full((b, s, k), -1, dtype=torch.int32)
    for bi in range(b):
        for t in range(s):
            start = 0 if (bi == 0 or t < s // 2) else s // 2  # row 1 holds two documents
            visible = torch.arange(start, t + 1)
            chosen = visible[torch.randperm(visible.numel(), generator=gen)[:k]].sort().values
            idx[bi, t, :chosen.numel()] = chosen.int()
    return (q_nope, q_pe, latent, k_pe, weight), idx


def composed_float64(q_nope, q_pe, latent, k_pe, weight, idx, scale):
    """out [s, b, h * dv] and lse [b, s, h] from plain float64 autograd operations, one token at a time."""
    s, b, h, dn = q_nope.shape
    c = latent.shape[-1]
    w = weight.view(h, -1, c)
    rows_out, rows_lse = [], []
    for bi in range(b):
        row_out, row_lse = [], []
        for t in range(s):
            sel = idx[bi, t][idx[bi, t] >= 0].long()
            keys = torch.cat([latent[sel, bi], k_pe[sel, bi, 0]], dim=-1)  # [n, c + dr]
            q_abs = torch.cat([torch.einsum("hd,hdc->hc", q_nope[t, bi], w[:, :dn]), q_pe[t, bi]], dim=-1)
            scores = q_abs @ keys.T * scale  # [h, n]
            p = scores.softmax(-1)
            row_out.append(torch.einsum("hn,nc,hvc->hv", p, latent[sel, bi], w[:, dn:]))
            row_lse.append(scores.logsumexp(-1))
        rows_out.append(torch.stack(row_out))
        rows_lse.append(torch.stack(row_lse))
    out = torch.stack(rows_out)  # [b, s, h, dv]
    return out.transpose(0, 1).reshape(s, b, -1), torch.stack(rows_lse)


BACKENDS = {"reference": lambda: ReferenceBackend(), "triton": lambda: TritonBackend(),
            "triton_deterministic": lambda: TritonBackend(deterministic=True)}


@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_output", "recompute"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sparse_core_matches_float64_composition(backend, recompute, batch):
    inputs, idx = core_case(3, b=batch)
    scale = 0.37
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = sparse_mla_core(*leaves, idx, BACKENDS[backend](), scale, chunk=4, recompute=recompute)
    ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_lse = composed_float64(*ref_leaves, idx, scale)
    assert rel(out, ref) < TOL and rel(lse, ref_lse) < TOL
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out, leaves, g)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    for name, got, want in zip(["q_nope", "q_pe", "latent", "k_pe", "weight"], grads, ref_grads):
        assert got.shape == want.shape and rel(got, want) < TOL, (name, rel(got, want))
    assert grads[0].is_contiguous()  # q_nope's gradient in [s, b, h, dn] rows: the q split's backward cats it as is


# ------------------------------------------------------------------------------------------------
# the whole model: selective recompute of the sparse core attention
# ------------------------------------------------------------------------------------------------


def test_core_attn_recompute_of_sparse_layers_matches_the_plain_run(tmp_path):
    from pretrain.convert import load_hf_model
    from pretrain.model.dsa import DSACoreAttention
    from tests.dsa_helpers import NO_TIE_INDEX_HEADS, document_mask, hf_checkpoint, tokens

    hf_checkpoint(tmp_path, 81, layers=3, dense=1, index_topk=5, indexer_types=["full", "shared", "full"],
                  index_n_heads=NO_TIE_INDEX_HEADS)
    lengths = [[9, 7, 8], [6, 10, 8]]
    ids_all = tokens(81, 2, 25)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    mask = document_mask(lengths)
    common = dict(mtp_num_layers=None, dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=True,
                  dsa_kernel_backend="reference")
    runs, calls = {}, []
    original = ReferenceBackend.attention_forward

    def counting(self, *args, **kwargs):
        calls[-1] += 1
        return original(self, *args, **kwargs)

    ReferenceBackend.attention_forward = counting
    try:
        for name, extra in [("plain", {}), ("core_attn", dict(recompute_granularity="selective",
                                                               recompute_modules=["core_attn"])),
                             ("flag", dict(dsa_sparse_recompute_attention=True))]:
            _, model = load_hf_model(str(tmp_path), **common, **extra)
            model.train()
            cores = [m for m in model.modules() if isinstance(m, DSACoreAttention)]
            assert len(cores) == 3 and cores[1].indexer is None
            calls.append(0)
            model.zero_grad(set_to_none=True)
            from pretrain.model.dsa import DSAMetrics, IndexerLossAutoScaler
            IndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            DSAMetrics.clear()
            loss = model(ids, torch.arange(24).expand(2, -1), mask, labels=labels)
            loss.mean().backward()
            kl = {layer: total / count for layer, (total, count) in DSAMetrics.values["indexer_loss"].items()}
            DSAMetrics.clear()
            runs[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kl)
    finally:
        ReferenceBackend.attention_forward = original
        from pretrain.model.dsa import IndexerLossAutoScaler
        IndexerLossAutoScaler.main_loss_backward_scale = None
    assert calls == [3, 6, 6]  # recompute: one more sparse forward per layer in backward, no other repeat
    for variant in ("core_attn", "flag"):
        check_same_run(runs["plain"], runs[variant])


def check_same_run(plain, other):
    (loss0, grads0, kl0), (loss1, grads1, kl1) = plain, other
    assert rel(loss1, loss0) <= TOL
    assert set(kl0) == set(kl1) == {1, 3}
    assert all(abs(float(kl1[k]) - float(kl0[k])) <= TOL * abs(float(kl0[k])) for k in kl0)
    indexer = 0
    for n, g in grads0.items():
        assert (g is None) == (grads1[n] is None), n
        if g is not None:
            assert rel(grads1[n], g) <= TOL, (n, rel(grads1[n], g))
            indexer += ".indexer." in n and g.abs().sum().item() > 0
    assert indexer >= 8  # both indexers trained


# ------------------------------------------------------------------------------------------------
# bytes kept for backward, per token, one attention layer at the proxy model's head counts
# ------------------------------------------------------------------------------------------------

PROXY_ATTENTION = [  # configs/models/glm5-proxy.yaml's attention (the hidden size does not enter it)
    "model.num_layers=1", "model.moe_layer_freq=[0]", "model.mtp_num_layers=0", "model.hidden_size=256",
    "model.num_attention_heads=16", "model.q_lora_rank=256", "model.kv_lora_rank=512", "model.qk_head_dim=192",
    "model.qk_pos_emb_head_dim=64", "model.v_head_dim=256", "model.dsa_indexer_n_heads=16",
    "model.dsa_indexer_head_dim=128", "model.vocab_size=256", "model.params_dtype=bfloat16", "model.bf16=true",
]
SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.01", "model.dsa_indexer_use_sparse_loss=true"]
CORE_ATTN = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"]
VARIANTS = {"dense": [], "sparse": SPARSE, "sparse core_attn": SPARSE + CORE_ATTN,
            "sparse recompute": SPARSE + ["model.dsa_sparse_recompute_attention=true"]}
LENGTHS, TOPK = (96, 160, 224), 32  # no model dim equals a length: [S, S] is recognizable


def rank_saved_bytes(rank: int, world_size: int) -> Dict[str, List[dict]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import pretrain.model.core_attention as core_attention
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.config import load_config
    from pretrain.model.builder import build_model
    from pretrain.training.saved_activations import SavedTensors
    from tests.parallel_helpers import TINY

    # the flash kernel, as on GPU (see the module docstring)
    core_attention.sdpa_kernel = lambda backends, set_priority=False: sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    results: Dict[str, List[dict]] = {}
    for name, extra in VARIANTS.items():
        results[name] = []
        for s in LENGTHS:
            cfg = load_config(TINY, PROXY_ATTENTION + [f"data.seq_length={s}", f"model.dsa_indexer_topk={TOPK}"] + extra)
            initialize_parallel(cfg.parallel, seed=7)
            try:
                model = build_model(cfg)
                attention = model.decoder.layers[0].self_attention
                saved = SavedTensors(exclude=list(model.parameters()))
                attention.register_forward_pre_hook(lambda *_: saved.__enter__() and None)
                attention.register_forward_hook(lambda *_: saved.__exit__(None, None, None))
                ids = torch.randint(0, 256, (1, s + 1), generator=torch.Generator().manual_seed(s))
                loss = model(ids[:, :-1], torch.arange(s)[None], None, labels=ids[:, 1:])
                kept = saved.live()  # between forward and backward (no backward needed: the graph is dropped here)
                results[name].append({"bytes": sum(r.nbytes for r in kept), "report": saved.report(tokens=s),
                                      "shapes": [r.shape for r in kept]})
                del loss, kept
            finally:
                destroy_parallel()
    return results


@pytest.fixture(scope="module")
def saved_bytes():
    (results,) = run_ranks(rank_saved_bytes, 1, env=EAGER_ENV, timeout=600)
    return results


def test_sparse_attention_keeps_less_than_dense_per_token(saved_bytes):
    per_token = {}
    for name, runs in saved_bytes.items():
        b = [r["bytes"] for r in runs]
        # linear in S: equal increments for equal steps of the sequence length
        assert b[2] - b[1] == b[1] - b[0], (name, b)
        per_token[name] = (b[1] - b[0]) / (LENGTHS[1] - LENGTHS[0])
        for r, s in zip(runs, LENGTHS):  # nothing [S, S]
            assert not any(list(shape).count(s) >= 2 for shape in r["shapes"]), (name, r["report"])
    # dense attention keeps q, k, v storages, the output and the log-sum-exp (~47.7 KB per token here)
    assert per_token["sparse"] < per_token["dense"], (per_token, saved_bytes["sparse"][1]["report"])
    assert per_token["sparse core_attn"] < per_token["sparse"] - 16 * 512 * 2 + 1, per_token  # no h x 512 output
    # model.dsa_sparse_recompute_attention keeps what core_attn recompute keeps, and less than dense
    assert per_token["sparse recompute"] == per_token["sparse core_attn"] < per_token["dense"], per_token


def test_saved_tensor_counter_counts_live_storages_once():
    """The counter behind the numbers above, on operations whose saved tensors are known: a * b keeps
    both factors, exp keeps its output, a view of a kept tensor costs nothing more, a parameter is
    excluded, and a graph differentiated and dropped inside the forward keeps nothing."""
    from pretrain.training.saved_activations import SavedTensors

    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(exclude=[weight]) as saved:
        y = x * 2.0  # a scalar factor keeps nothing
        z = y * y.exp()  # keeps y and exp(y): 2 x 4 x 8 floats
        u = z.t().t() * z  # keeps z twice (a view shares its storage): 4 x 8 floats
        out = u @ weight  # keeps u (and the excluded weight): 4 x 8 floats
        inner = torch.randn(1000, requires_grad=True)
        (g,) = torch.autograd.grad((inner * inner).sum(), inner)  # its graph dies here
    assert saved.total_bytes == 4 * (2 + 1 + 1) * 4 * 8
    assert {r.shape for r in saved.live()} == {(4, 8)}
    out.sum().backward()
    assert x.grad is not None and g.shape == (1000,)
