"""MTP speculative decoding (pretrain.eval.mtp_accept) against an oracle and slow reference decoders."""

import pytest
import torch

from parallel.initialize import ensure_single_rank
from pretrain.config import load_config
from pretrain.eval.mtp_accept import accept_lengths, draft_overrides, model_predictor, speculative_decode
from pretrain.model.builder import build_model

V = 97


def _next(t):
    return (5 * t + 3) % V


def oracle(good_depths: int):
    """A language where token i+1 = 5 t_i + 3 mod 97: the main head is always right, MTP depths
    1..good_depths are right, deeper ones always propose a wrong token."""

    def predict(tokens):
        rows = []
        cur = tokens.clone()
        for depth in range(4):  # main + 3 depths
            cur = _next(cur)
            rows.append(cur if depth <= good_depths else (cur + 1) % V)
        return torch.stack(rows)

    return predict


@pytest.mark.parametrize("good", [0, 1, 2, 3])
def test_accept_length_of_an_oracle_is_known(good):
    prompt = torch.tensor([7, _next(7)])
    metrics = accept_lengths(oracle(good), [prompt], new_tokens=24, max_drafts=3)
    # Each step accepts min(N, good) drafts, so emits 1 + min(N, good) tokens (the last step is cut
    # to the budget but still counts what it accepted).
    assert metrics == {f"accept_len@{n}": 1 + min(n, good) for n in (1, 2, 3)}
    generated, _ = speculative_decode(oracle(good), prompt, 24, 3)
    expected, t = [], int(prompt[-1])
    for _ in range(24):
        t = _next(t)
        expected.append(t)
    assert generated.tolist() == expected


def _model(shared: bool):
    # A 12-token vocabulary so that a random model's drafts are accepted often enough to matter.
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.vocab_size=12", "model.moe_token_dispatcher_type=allgather",
                                                         f"model.mtp_use_repeated_layer={str(shared).lower()}"])
    ensure_single_rank()
    torch.manual_seed(3)
    return build_model(cfg).eval()


@torch.no_grad()
def _greedy_reference(model, prompt, count):
    """Plain greedy decoding, one token at a time, recomputing everything with the model's own forward."""
    tokens = prompt.tolist()
    for _ in range(count):
        ids = torch.tensor([tokens])
        logits = model(ids, torch.arange(len(tokens)).view(1, -1), None)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


@torch.no_grad()
def _naive_spec_reference(model, prompt, greedy, count, drafts):
    """Draft with the MTP heads one token at a time; a draft is accepted while it continues the greedy text."""
    tokens, steps, n0 = prompt.tolist(), [], len(prompt)
    while len(tokens) - n0 < count:
        t = greedy[len(tokens) - n0]  # the verified next token
        proposal = []
        for depth in range(1, drafts + 1):
            seq = tokens + [t] + proposal
            heads = model.mtp_logits(torch.tensor([seq]), torch.arange(len(seq)).view(1, -1))
            proposal.append(int(heads[depth][0, len(tokens) - 1].argmax()))
        accepted = 0
        for j, d in enumerate(proposal):
            at = len(tokens) - n0 + 1 + j
            if greedy[at] != d:
                break
            accepted += 1
        tokens += [t] + proposal[:accepted]
        steps.append(1 + accepted)
    return steps


@pytest.mark.parametrize("shared, prompts", [
    (True, [[1, 5, 2, 9, 3, 3, 7, 0], [2, 2, 8, 1, 0, 10, 4, 4], [11, 3, 5, 6, 1, 7, 2, 9]]),
    (False, [[4, 4, 11, 6, 2, 8], [7, 1, 0, 3, 3]]),
])
def test_model_decoding_matches_slow_references(shared, prompts):
    model = _model(shared)
    predict = model_predictor(model)
    prompts = [torch.tensor(p) for p in prompts]
    new = 6
    expected = {n: [] for n in (1, 2, 3)}
    for prompt in prompts:
        # The greedy text of new + 3 tokens, so a draft past the budget is judged like the decoder judges it.
        greedy = _greedy_reference(model, prompt, new + 3)
        for drafts in (1, 2, 3):
            reference = _naive_spec_reference(model, prompt, greedy, new, drafts)
            generated, steps = speculative_decode(predict, prompt, new, drafts)
            assert generated.tolist() == greedy[:new]  # speculative greedy decoding emits the greedy text
            assert steps == reference
            expected[drafts] += reference
    # The evaluator's path (batched greedy text, then one teacher-forced forward), two prompts per batch.
    metrics = accept_lengths(predict, prompts, new, 3, batch=2)
    assert metrics == pytest.approx({f"accept_len@{n}": sum(s) / len(s) for n, s in expected.items()})
    assert max(max(s) for s in expected.values()) > 1  # some drafts were accepted: the check has teeth


def test_drafting_past_the_trained_depths_reapplies_the_one_mtp_layer():
    """A model trained with one MTP depth drafts 3 tokens as DeepSeek-V3 does, its layer applied at every
    depth: the logits equal megatron's one-layer-per-depth MTP holding three copies of that layer."""
    overrides = ["model.vocab_size=12", "model.moe_token_dispatcher_type=allgather"]
    one = load_config("configs/models/glm5-tiny.yaml", overrides + ["model.mtp_num_layers=1"])
    ensure_single_rank()
    torch.manual_seed(4)
    trained = build_model(one).eval()
    extra = draft_overrides(one.model, 3)
    assert draft_overrides(one.model, 1) == []
    reused = build_model(load_config("configs/models/glm5-tiny.yaml", overrides + ["model.mtp_num_layers=1"] + extra))
    reused.load_state_dict(trained.state_dict())  # strict: the same parameters, no new ones
    copies = build_model(load_config("configs/models/glm5-tiny.yaml", overrides + [
        "model.mtp_num_layers=3", "model.mtp_use_repeated_layer=false"]))
    src = trained.state_dict()
    copies.load_state_dict({name: src[name if not name.startswith("mtp.layers.") else
                                     "mtp.layers.0." + name.split(".", 3)[3]] for name in copies.state_dict()})
    ids = torch.randint(0, 12, (2, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(2, -1)
    with torch.no_grad():
        got, expected = reused.eval().mtp_logits(ids, pos), copies.eval().mtp_logits(ids, pos)
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[2], got[3])  # the depths differ: the layer really is applied again


def test_per_depth_layers_cannot_draft_past_their_depths():
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.mtp_use_repeated_layer=false"])
    assert draft_overrides(cfg.model, 3) == []
    with pytest.raises(ValueError, match=r"must be in 1\.\.3 \(the model's 3 MTP depths have layers of their own"):
        draft_overrides(cfg.model, 4)
    with pytest.raises(ValueError, match="no MTP layers"):
        draft_overrides(load_config("configs/models/glm5-tiny.yaml", ["model.mtp_num_layers=0"]).model, 1)
