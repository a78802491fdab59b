"""Hugging Face transformers models, built from small configs with random weights, train through
ORTWrap like eager with both exporters: Llama (grouped-query SDPA attention, rotary embeddings
from a non-persistent buffer, RMSNorm, SwiGLU), GPT-2 (Conv1D projections, tanh GELU, tied LM
head) and BERT for classification (padding attention mask, pooler, cross-entropy on labels)."""

from __future__ import annotations

import pytest
import torch
from parity import check_parity

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("exporter")

VOCAB = 64


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def lm_inputs(b, g):
    t = {4: 10, 7: 13, 3: 9}[b]  # the sequence length changes with the batch size
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    return (), {"input_ids": ids, "labels": ids}


def classification_inputs(b, g):
    t = {4: 12, 7: 9, 3: 14}[b]  # the sequence length changes with the batch size
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1:, -3:] = 0  # padded rows
    return (), {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (b,), generator=g)}


@pytest.mark.parametrize(
    "make_model, make_inputs",
    [(llama, lm_inputs), (gpt2, lm_inputs), (bert, classification_inputs)],
    ids=["llama", "gpt2", "bert"],
)
def test_transformers_model_trains_like_eager(make_model, make_inputs):
    w = check_parity(make_model, make_inputs, loss_fn=lambda out: out.loss)
    # new batch sizes and sequence lengths reuse the graph (0 exports: the test session's build
    # cache already held it)
    assert w.export_count <= 1 and len(w.programs()) == 1
    assert w.fallback_reason is None


@pytest.mark.parametrize("make_model", [llama, gpt2], ids=["llama", "gpt2"])
def test_cache_returned_in_training_holds_each_calls_tensors(make_model):
    """``use_cache=True`` in train mode returns a ``DynamicCache``: each call's cache is a new object
    whose key/value tensors equal eager's for that call (never the export trace's), and the loss
    trains like eager."""
    import copy

    from parity import assert_close

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    eager = make_model().train()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=parity_exporter())
    g = torch.Generator().manual_seed(1)
    previous = None
    for b in (4, 7, 3):
        _, kwargs = lm_inputs(b, g)
        out, expected = w(**kwargs, use_cache=True), eager(**kwargs, use_cache=True)
        cache, cache_e = out.past_key_values, expected.past_key_values
        assert type(cache) is type(cache_e)
        assert cache.get_seq_length() == cache_e.get_seq_length() == kwargs["input_ids"].shape[1]
        assert len(cache.layers) == len(cache_e.layers)
        for i, (layer, layer_e) in enumerate(zip(cache.layers, cache_e.layers)):
            assert_close(layer.keys.detach(), layer_e.keys.detach(), f"batch {b} layer {i} keys")
            assert_close(layer.values.detach(), layer_e.values.detach(), f"batch {b} layer {i} values")
        assert_close(out.loss.detach(), expected.loss.detach(), f"batch {b} loss")
        out.loss.backward()
        if previous is not None:
            assert previous is not cache and previous.layers[0].keys is not cache.layers[0].keys
        previous = cache
    assert len(w.programs()) == 1


def parity_exporter() -> str:
    import parity

    return parity.EXPORTER
