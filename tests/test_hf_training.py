"""Training loops people use, on ORTWrap(model), against the same loop on the bare model:
transformers' Trainer with default arguments (its column filtering, label names and
``num_items_in_batch`` loss scaling all read off the model), gradient accumulation, checkpoints
and resuming, evaluation; and an accelerate ``prepare()`` loop. On the engine the venv resolves
(``ON_ENGINE``: ``engine="onnxruntime"`` where no training build is installed) with the same numbers;
only the build's artifacts are read per engine (``built_once``, ``built_graph``)."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from parity import assert_close

from ortwrap import ORTWrap
from ortwrap.engines import is_training_available

transformers = pytest.importorskip("transformers")

VOCAB = 50
ON_ENGINE = not is_training_available()
#: On the onnxruntime engine, the tests beyond one Trainer run (accumulation: its num_items_in_batch
#: scaling) and one accelerate loop are slow (`ORT_EXTRA=ort make test` runs those two):
#: `.venv-ort/bin/python -m pytest -m slow tests/test_hf_training.py`.
ENGINE_SLOW = pytest.mark.slow if ON_ENGINE else (lambda f: f)
ENGINE_SLOW_PARAM = [pytest.mark.slow] if ON_ENGINE else []


def built_once(wrapped) -> bool:
    """Training built one program (on the engine: one build, its forward and backward sessions)."""
    if ON_ENGINE:  # (programs() lists the training engine's ORT programs)
        return wrapped._engine.build_count == 1
    return len(wrapped.programs()) == 1


def built_graph(wrapped) -> onnx.GraphProto:
    """The ONNX graph training ran (on the engine: AOTAutograd's forward graph as translated)."""
    if ON_ENGINE:  # (the engine keeps no ``programs()``: its forward session's model)
        return onnx.load_from_string(wrapped._engine.last.runners["forward"].graph.model).graph
    return onnx.load_from_string(wrapped.programs()[0].graph.model_bytes).graph


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)  # tied input/output embeddings


def rows(n: int = 24, seed: int = 1) -> list[dict]:
    """Token rows with padding (masked, labels -100) and an extra column the model does not take."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (12,), generator=g)
        mask = torch.ones(12, dtype=torch.long)
        if i % 3 == 0:
            mask[-4:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "row_id": i})
    return out


class RecordingTrainer(transformers.Trainer):
    """Trainer that keeps each step's exact loss (the logged ones are rounded)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(float(loss))
        return loss


def train(model, tmp_path, name: str, resume: str | None = None, **arguments) -> RecordingTrainer:
    defaults = dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=4, report_to=[], use_cpu=True,
        learning_rate=1e-2, save_strategy="no", torch_compile=False, seed=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**defaults, **arguments})
    trainer = RecordingTrainer(model=model, args=args, train_dataset=rows(), eval_dataset=rows(8, seed=2))
    trainer.step_losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_same_parameters(ours, eager, atol: float = 1e-4) -> None:
    names = [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    for (n, p), q in zip(eager.named_parameters(), ours.parameters()):
        assert_close(q.detach(), p.detach(), f"parameter {n}", atol=atol, rtol=1e-3)


@pytest.mark.parametrize(
    "accumulation",
    [pytest.param(1, id="no-accumulation", marks=ENGINE_SLOW_PARAM), pytest.param(2, id="accumulation-2")],
)
def test_trainer_with_default_arguments_matches_the_bare_model(tmp_path, accumulation):
    bare = gpt2()
    wrapped = ORTWrap(copy.deepcopy(bare), fallback=False)
    eager = train(bare, tmp_path, "bare", gradient_accumulation_steps=accumulation)
    ours = train(wrapped, tmp_path, "ort", gradient_accumulation_steps=accumulation)
    # What Trainer infers about the model is the same: kept columns, label names, loss kwargs.
    assert ours._signature_columns == eager._signature_columns
    assert ours.label_names == eager.label_names == ["labels"]
    assert ours.model_accepts_loss_kwargs and eager.model_accepts_loss_kwargs  # num_items_in_batch passed
    assert ours.can_return_loss == eager.can_return_loss
    assert len(eager.step_losses) == 4 * accumulation
    torch.testing.assert_close(ours.step_losses, eager.step_losses, rtol=1e-5, atol=1e-5)
    assert_same_parameters(wrapped, bare)
    assert wrapped.fallback_reason is None and built_once(wrapped)
    # evaluate(): Trainer finds the labels (read off the model's class) and gets the loss.
    torch.testing.assert_close(ours.evaluate()["eval_loss"], eager.evaluate()["eval_loss"], rtol=1e-5, atol=1e-5)


@ENGINE_SLOW
def test_trainer_save_steps_and_resume_from_checkpoint(tmp_path):
    bare = gpt2()
    wrapped = ORTWrap(copy.deepcopy(bare), fallback=False)
    constant = {"lr_scheduler_type": "constant"}  # the same learning rates in a 2-step and a 4-step run
    eager = train(bare, tmp_path, "bare", **constant)
    interrupted = train(wrapped, tmp_path, "ort", max_steps=2, save_strategy="steps", save_steps=2, **constant)
    checkpoint = tmp_path / "ort" / "checkpoint-2"
    # Saved the model's own way (save_pretrained: tied weights kept tied), loadable by the bare class.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(checkpoint))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    resumed_model = ORTWrap(gpt2(), fallback=False)
    resumed = train(resumed_model, tmp_path, "ort", resume=str(checkpoint), **constant)
    losses = interrupted.step_losses + resumed.step_losses
    torch.testing.assert_close(losses, eager.step_losses, rtol=1e-5, atol=1e-5)
    assert_same_parameters(resumed_model, bare)


def _trained_under_autocast(wrapped, bare) -> None:
    # The one program training built is an autocast one (bf16 values in its graph), and a training
    # forward under bf16 autocast gives eager autocast's dtypes and values.
    assert wrapped.fallback_reason is None and built_once(wrapped)
    graph = built_graph(wrapped)
    casts = [a.i for n in graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert onnx.TensorProto.BFLOAT16 in casts, "training ran a graph without bf16: autocast was not applied"
    batch = {k: torch.stack([r[k] for r in rows(4)]) for k in ("input_ids", "attention_mask", "labels")}
    wrapped.train()
    bare.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, eager = wrapped(**batch), bare(**batch)
    for name in ("loss", "logits"):
        assert getattr(ours, name).dtype == getattr(eager, name).dtype, name
        assert_close(getattr(ours, name).detach().float(), getattr(eager, name).detach().float(), name, atol=2e-2)


@ENGINE_SLOW
def test_trainer_bf16_matches_the_bare_model(tmp_path):
    # TrainingArguments(bf16=True) on CPU: Trainer runs the forward under torch.autocast(cpu, bf16).
    bare = gpt2()
    wrapped = ORTWrap(copy.deepcopy(bare), fallback=False)
    # SGD: AdamW's normalised steps turn bf16 rounding noise of near-zero gradient entries into whole
    # learning-rate steps, in eager autocast against eager float32 as much as here.
    sgd = dict(optim="sgd", learning_rate=0.5)
    eager = train(bare, tmp_path, "bare", bf16=True, **sgd)
    ours = train(wrapped, tmp_path, "ort", bf16=True, **sgd)
    assert len(eager.step_losses) == 4
    torch.testing.assert_close(ours.step_losses, eager.step_losses, rtol=2e-3, atol=2e-3)  # bf16
    assert_same_parameters(wrapped, bare, atol=1e-3)
    _trained_under_autocast(wrapped, bare)


@pytest.mark.parametrize("mixed_precision", ["no", pytest.param("bf16", marks=ENGINE_SLOW_PARAM)])
def test_accelerate_prepare_loop_matches_the_bare_model(mixed_precision):
    accelerate = pytest.importorskip("accelerate")
    bf16 = mixed_precision == "bf16"

    def loop(model):
        # (accelerate keeps one process-wide state, which Trainer also sets: start from a fresh one)
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
        # (bf16: SGD, for the reason test_trainer_bf16_matches_the_bare_model gives)
        opt = torch.optim.SGD(model.parameters(), lr=0.5) if bf16 else torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(rows(16), batch_size=4, collate_fn=collate)
        model, opt, data = accelerator.prepare(model, opt, data)
        losses = []
        for batch in data:
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def collate(batch):
        return {k: torch.stack([r[k] for r in batch]) for k in ("input_ids", "attention_mask", "labels")}

    bare = gpt2()
    wrapped = ORTWrap(copy.deepcopy(bare), fallback=False)
    eager_losses = loop(bare)
    ours = loop(wrapped)
    tol = 2e-3 if bf16 else 1e-5
    torch.testing.assert_close(ours, eager_losses, rtol=tol, atol=tol)
    assert_same_parameters(wrapped, bare, atol=1e-3 if bf16 else 1e-4)
    assert wrapped.fallback_reason is None
    if bf16:
        _trained_under_autocast(wrapped, bare)


@ENGINE_SLOW
def test_peft_lora_model_trains_like_the_bare_one():
    # ORTWrap(get_peft_model(model)): only the adapters train (frozen base weights are graph
    # inputs without gradients); losses and adapter weights match the bare PeftModel's, and the
    # wrapper is still a PeftModel that saves its adapter.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True
    )
    bare = peft.get_peft_model(gpt2(), config)
    ours = peft.get_peft_model(gpt2(), config)
    ours.load_state_dict(bare.state_dict())
    wrapped = ORTWrap(ours, fallback=False)
    assert isinstance(wrapped, peft.PeftModel)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (bare, wrapped)]
    for step, batch in enumerate(rows(12)[::3]):
        ids = batch["input_ids"][None].repeat(2, 1)
        losses = []
        for model, opt in zip((bare, wrapped), opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            for (name, p), q in zip(bare.named_parameters(), model.parameters()):
                assert (q.grad is None) == (not p.requires_grad), f"step {step}: {name}"
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    assert_same_parameters(wrapped, bare)
    assert wrapped.fallback_reason is None and built_once(wrapped)
