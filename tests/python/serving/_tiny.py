"""What the vLLM tests share: a tiny random-init Llama, a local word-level tokenizer for it, and the environment
of a child process that runs vLLM on tpu from the source tree (test_vllm_offline.py, test_vllm_server.py)."""
import importlib.metadata
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VOCAB_SIZE = 256
PAD, BOS, EOS, UNK = 0, 1, 2, 3
# The tokenizer's words: the specials, the chat template's words, then "w<id>" for every other id, so that a text
# of such words is a known list of token ids (word_text) and every id the model can emit decodes to a word.
CHAT_WORDS = ["user", "assistant", "system", ":"]
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + CHAT_WORDS
WORDS += [f"w{i}" for i in range(len(WORDS), VOCAB_SIZE)]
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (docs/serving.md says how)")


def tiny_llama(path):
    """A random-init Llama: head size 32, 4 query heads over 2 key-value heads (GQA), 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def save_word_tokenizer(path):
    """A word-level tokenizer over WORDS (no download): whitespace and punctuation split the text, a text starts
    with <s>, ids decode to their words joined by spaces; tokenizer_config.json has a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE, model_max_length=512)
    fast.save_pretrained(path)
    return fast


def word_text(ids):
    """The text the word tokenizer encodes to [<s>] + ids (ids of words, not specials)."""
    return " ".join(WORDS[i] for i in ids)


def entry_point_env(tmp_path):
    """A child's environment: torch_pjrt importable, and its vllm.platform_plugins entry point visible (where
    torch_pjrt is not installed, a stand-in distribution's metadata declares it)."""
    paths = [os.path.join(ROOT, "python")]
    declared = any(ep.value == "torch_pjrt.vllm:register"
                   for ep in importlib.metadata.entry_points(group="vllm.platform_plugins"))
    if not declared:
        info = tmp_path / "site" / "torch_pjrt_vllm_entry_point-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_pjrt_vllm_entry_point\nVersion: 0\n")
        (info / "entry_points.txt").write_text("[vllm.platform_plugins]\ntorch_pjrt = torch_pjrt.vllm:register\n")
        paths.append(str(tmp_path / "site"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("VLLM_TARGET_DEVICE", "TORCH_PJRT_VLLM"):
        env.pop(name, None)
    return env


def greedy(model, prompt, new_tokens):
    """transformers' greedy generate() on the CPU: the new token ids."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def reference_logprobs(model, prompt, tokens):
    """float32 log_softmax of the CPU model's logits at each generated position: [len(tokens), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), dim=-1)
