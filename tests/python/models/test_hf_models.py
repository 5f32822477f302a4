"""Hugging Face transformers models, unchanged, trained on tpu against the CPU.

Tiny random-init configs (nothing is downloaded): a causal LM with tied
embeddings (GPT-2), a Llama-style model, an encoder classifier (BERT), a
seq2seq model (T5) and a vision transformer (ViT). Each trains 5 AdamW steps on
the CPU and, from the same initial weights, on tpu in fused and strict mode:
losses and parameters must agree within float32 tolerance and no op may fall
back to the CPU. `transformers.Trainer` picks the tpu device by itself (accelerate
asks `torch.accelerator`) and must reproduce the CPU Trainer's losses.
"""
import copy

import pytest
import torch

import torch_pjrt

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

BATCH, SEQ, VOCAB = 2, 8, 64
STEPS = 5


def _ids(low=0):
    return torch.randint(low, VOCAB, (BATCH, SEQ))


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied embeddings
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=32, attention_dropout=0.0)
    model = transformers.LlamaForCausalLM(config)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


def bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                     num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0  # padding: the additive attention mask path
    return model, {"input_ids": _ids(), "attention_mask": mask, "labels": torch.tensor([0, 2])}


def t5():
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2,
                                   d_kv=16, vocab_size=VOCAB, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
    return model, {"input_ids": _ids(low=2), "labels": _ids(low=2)}


def vit():
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(config)
    return model, {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.tensor([1, 2])}


def wav2vec2():
    # Speech: a conv feature encoder, group norm, and a weight-normed positional
    # conv (_weight_norm_interface and its backward). No random time masking.
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                         num_conv_pos_embedding_groups=2, num_labels=3, mask_time_prob=0.0,
                                         hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                         feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0)
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    return model, {"input_values": torch.randn(BATCH, 400), "labels": torch.tensor([0, 2])}


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "vit": vit, "wav2vec2": wav2vec2}


def _fallback_counts():
    return dict(torch_pjrt.metrics()["cpu_fallbacks"])


def _new_fallbacks(before):
    after = _fallback_counts()
    return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


def _train(model, batch, device):
    model.to(device).train()
    # eps=1e-6 rather than 1e-8: a few gradient entries are pure cancellation
    # (~1e-8, all float32 rounding noise); Adam divides them by their own size,
    # so eps=1e-8 turns summation-order noise into lr-sized updates.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    batch = {k: v.to(device) for k, v in batch.items()}
    losses = []
    compiles = 0
    for step in range(STEPS):
        if step == 2:  # step 1 creates Adam's state, step 2 the steady-state program
            compiles = torch_pjrt.metrics()["compiles"]
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    compiles = torch_pjrt.metrics()["compiles"] - compiles
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return torch.stack(losses).cpu(), state, compiles


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_cpu(name, mode):
    torch.manual_seed(0)
    cpu_model, batch = MODELS[name]()
    tpu_model = copy.deepcopy(cpu_model)  # identical initial weights
    cpu_losses, cpu_state, _ = _train(cpu_model, batch, "cpu")
    before = _fallback_counts()
    with torch_pjrt.mode(mode):
        tpu_losses, tpu_state, late_compiles = _train(tpu_model, batch, "tpu")
    assert _new_fallbacks(before) == {}, str(torch_pjrt.explain())
    assert late_compiles == 0, str(torch_pjrt.explain())  # steps 3-5 reuse step 2's programs
    assert tpu_losses.isfinite().all()
    assert (cpu_losses[-1] < cpu_losses[0]).item()  # it trains at all
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    assert tpu_state.keys() == cpu_state.keys()
    for key in cpu_state:
        torch.testing.assert_close(tpu_state[key], cpu_state[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((6, 3, 5), 2), ((6, 3, 5), 0), ((7, 4), 1), ((5,), 0)])
def test_weight_norm_interface_backward_matches_cpu(shape, dim, dtype):
    v = torch.randn(shape, dtype=dtype)
    g = torch.rand([n if i == dim else 1 for i, n in enumerate(shape)], dtype=dtype) + 0.5
    grad_w = torch.randn(shape, dtype=dtype)
    _, norms = torch._weight_norm_interface(v, g, dim)
    before = _fallback_counts()
    expected = torch.ops.aten._weight_norm_interface_backward(grad_w, v, g, norms, dim)
    actual = torch.ops.aten._weight_norm_interface_backward(
        *(t.to("tpu") for t in (grad_w, v, g, norms)), dim)
    assert _new_fallbacks(before) == {}
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    for e, a in zip(expected, actual):
        assert a.device.type == "tpu"
        torch.testing.assert_close(a.cpu(), e, **tol)


def test_weight_norm_interface_backward_rejects_a_middle_dim():
    args = [torch.randn(3, 4, 5, device="tpu") for _ in range(4)]
    with pytest.raises(RuntimeError, match="first or last dim"):
        torch.ops.aten._weight_norm_interface_backward(*args, 1)


class _LMData(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_run(model, data, tmp_path, use_cpu):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=BATCH, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, use_cpu=use_cpu, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return args, losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_trainer_runs_on_tpu(tmp_path, mode):
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    cpu_model, _ = gpt2()
    tpu_model = copy.deepcopy(cpu_model)
    data = _LMData(torch.randint(0, VOCAB, (3 * BATCH, SEQ)))
    _, cpu_losses, cpu_state = _trainer_run(cpu_model, data, tmp_path / "cpu", use_cpu=True)
    before = _fallback_counts()
    # The user's code is what a CUDA user writes: no device argument at all.
    # TrainingArguments asks accelerate's PartialState, which asks
    # torch.accelerator.current_accelerator(): the registered tpu backend.
    with torch_pjrt.mode(mode):
        args, tpu_losses, tpu_state = _trainer_run(tpu_model, data, tmp_path / "tpu", use_cpu=False)
    assert args.device.type == "tpu"
    assert next(tpu_model.parameters()).device.type == "tpu"
    assert len(tpu_losses) == 3
    # Trainer's default optimizer is AdamW(fused=True): `_fused_adamw_` is lowered too.
    fallbacks = _new_fallbacks(before)
    assert fallbacks == {}, str(torch_pjrt.explain())
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-5)
    for key in cpu_state:
        torch.testing.assert_close(tpu_state[key], cpu_state[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
