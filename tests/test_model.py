"""The multi-exit model: its layer-by-layer forward equals the encoder's own, and it exposes the exits."""
from __future__ import annotations

import torch

from acl_lab.model import build_model, describe


def _batch(tokenizer):
    return tokenizer(["a fine movie", "the worst plot ever written by anyone"], padding=True, return_tensors="pt")


def test_multi_exit_forward_matches_hf_hidden_states():
    model, tok = build_model("tiny", num_labels=3, multi_exit=True)
    model.eval()
    b = _batch(tok)
    with torch.no_grad():
        out = model(**b)
        ref = model.encoder(**b, output_hidden_states=True).hidden_states
    assert out.layers == [1, 2, 3, 4]
    for layer, rep, logits in zip(out.layers, out.reps, out.logits):
        torch.testing.assert_close(rep, ref[layer][:, 0])
        assert logits.shape == (2, 3)


def test_single_exit_reads_last_layer_and_label_embeddings_are_head_rows():
    model, tok = build_model("tiny", num_labels=2, multi_exit=False)
    assert model.exit_layers == [4] and len(model.heads) == 1
    emb = model.label_embeddings(-1)
    assert emb.shape == (2, 32) and emb.data_ptr() == model.heads[0].weight.data_ptr()
    model.eval()
    with torch.no_grad():
        out = model(**_batch(tok))
    torch.testing.assert_close(out.logits[-1], out.reps[-1] @ emb.T + model.heads[0].bias)


def test_same_seed_same_initialisation():
    a, _ = build_model("tiny", 2, seed=3)
    b, _ = build_model("tiny", 2, seed=3)
    c, _ = build_model("tiny", 2, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.heads[0].weight, c.heads[0].weight)
    assert describe(a)["num_layers"] == 4


def test_real_minilm_forward_on_rt_polarity_batch():
    """One real MiniLM-L6 forward pass on rt-polarity text (the offline default model and data)."""
    from acl_lab.data import load_task, make_loader, tokenize

    model, tok = build_model("minilm-l6", num_labels=2, multi_exit=True)
    assert model.num_layers == 6 and model.hidden_size == 384
    data = load_task("rt-polarity", max_train_samples=8)
    batch = next(iter(make_loader(tokenize(data, tok, 64)["train"], tok, batch_size=8, shuffle=False)))
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert len(out.reps) == 6 and out.reps[-1].shape == (8, 384)
    assert all(torch.isfinite(r).all() for r in out.reps)
    # pretrained, not random: two different reviews have clearly different, non-degenerate representations
    assert out.reps[-1].std(0).mean() > 0.05


def test_mean_pooling_averages_real_tokens_only():
    model, tok = build_model("tiny", num_labels=2, multi_exit=True, pooling="mean")
    model.eval()
    b = _batch(tok)
    with torch.no_grad():
        out = model(**b)
        ref = model.encoder(**b, output_hidden_states=True).hidden_states
    m = b["attention_mask"].float()
    for layer, rep in zip(out.layers, out.reps):
        want = (ref[layer] * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        torch.testing.assert_close(rep, want)
    # padding does not change a sample's representation
    with torch.no_grad():
        alone = model(**tok(["a fine movie"], return_tensors="pt"))
    torch.testing.assert_close(alone.reps[-1][0], out.reps[-1][0], atol=1e-5, rtol=1e-4)


def test_mean_pooled_early_exit_batched_equals_one_at_a_time():
    from acl_lab.early_exit import early_exit_predict

    model, tok = build_model("tiny", num_labels=3, multi_exit=True, pooling="mean", seed=2)
    with torch.no_grad():
        for i, h in enumerate(model.heads):
            h.weight.mul_(60.0 * (i + 1))
    texts = ["a fine movie", "the worst plot ever written", "meh", "superb acting, dull script", "I laughed"]
    batched = early_exit_predict(model, **tok(texts, padding=True, return_tensors="pt"), threshold=0.5)
    single = [early_exit_predict(model, **tok([t], return_tensors="pt"), threshold=0.5) for t in texts]
    assert batched.exit_layers.tolist() == [s.exit_layers.item() for s in single]
    assert batched.predictions.tolist() == [s.predictions.item() for s in single]
