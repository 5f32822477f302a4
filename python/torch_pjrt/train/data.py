"""Token data for the trainer: a synthetic set, or local text / jsonl files, and a resumable order.

Samples are fixed-length token rows (seq_len). The order is a seeded permutation per epoch;
`ResumableBatches` yields each data-parallel rank its slice of every global micro-batch,
starting at any position, so a resumed run sees exactly the batches the straight run saw.
"""
from __future__ import annotations

import glob
import json
import os

import torch

from .config import ConfigError

__all__ = ["ByteTokenizer", "load_tokenizer", "hf_tokenizer", "SyntheticTokens", "TokenChunks", "build_dataset", "split_held_out",
           "ResumableBatches"]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def __len__(self):
        return 256


class _HFTokenizer:
    def __init__(self, path):
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text):
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        eos = self._tok.eos_token_id
        return ids + ([eos] if eos is not None else [])

    def __len__(self):
        return len(self._tok)


def _byte_chars() -> dict[int, str]:
    """byte -> the character that stands for it in byte-level BPE vocabularies (GPT-2's convention, which
    `tokenizers`' ByteLevel pre-tokenizer produces): printable Latin-1 bytes are themselves, the other bytes
    take the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    chars, unprintable = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + unprintable)
            unprintable += 1
    return chars


def byte_tokenizer_for_hf():
    """The byte tokenizer as a transformers tokenizer (ids = UTF-8 bytes, no merges, no special tokens), so an
    exported model trained on bytes loads its tokenizer with AutoTokenizer.from_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_chars().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def hf_tokenizer(name: str):
    """data.tokenizer as a transformers tokenizer, for export (save_pretrained)."""
    if name == "byte":
        return byte_tokenizer_for_hf()
    return load_tokenizer(name)._tok


def load_tokenizer(name: str):
    if name == "byte":
        return ByteTokenizer()
    if not os.path.isdir(name):
        raise ConfigError(f"config key 'data.tokenizer': {name!r} is neither byte nor a local tokenizer directory")
    return _HFTokenizer(name)


class SyntheticTokens(torch.utils.data.Dataset):
    """Learnable synthetic rows: token t = (start + stride * t) mod vocab, with a per-row start and a stride
    from a small set, so the next token follows from the last two and the loss falls quickly."""

    def __init__(self, num_samples, seq_len, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        stride = torch.randint(1, 8, (num_samples, 1), generator=g)
        self.rows = (start + stride * torch.arange(seq_len)) % vocab_size

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return self.rows[i]


class TokenChunks(torch.utils.data.Dataset):
    """One long token stream cut into rows of seq_len (the tail that does not fill a row is dropped)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        n = tokens.numel() // seq_len
        if n == 0:
            raise ConfigError(f"config key 'data.source': {tokens.numel()} tokens, fewer than one row of "
                              f"data.seq_len={seq_len}")
        self.rows = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return self.rows[i]


def _files(source: str) -> list[str]:
    files = []
    for part in source.split(","):
        found = sorted(glob.glob(os.path.expanduser(part.strip())))
        if not found:
            raise ConfigError(f"config key 'data.source': no file matches {part.strip()!r}")
        files += found
    return files


def read_texts(files, text_field="text", use_datasets=None) -> list[str]:
    """The documents of local .txt (one per line) / .jsonl files, through HF `datasets` when it is installed."""
    jsonl = [f.endswith((".jsonl", ".json")) for f in files]
    if any(jsonl) and not all(jsonl):
        raise ConfigError("config key 'data.source': mix of jsonl and text files")
    if use_datasets is None:
        try:
            import datasets  # noqa: F401
            use_datasets = True
        except ImportError:
            use_datasets = False
    if use_datasets:
        import datasets
        ds = datasets.load_dataset("json" if jsonl[0] else "text", data_files=files, split="train")
        field = text_field if jsonl[0] else "text"
        if field not in ds.column_names:
            raise ConfigError(f"config key 'data.text_field': {field!r} not in {ds.column_names}")
        return [t for t in ds[field] if t]
    texts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                if jsonl[0]:
                    record = json.loads(line)
                    if text_field not in record:
                        raise ConfigError(f"config key 'data.text_field': {text_field!r} not in {path}")
                    line = record[text_field]
                if line:
                    texts.append(line)
    return texts


def build_dataset(cfg, vocab_size, use_datasets=None):
    """cfg: the DataConfig."""
    if cfg.source == "synthetic":
        return SyntheticTokens(cfg.num_samples, cfg.seq_len, vocab_size)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"config key 'data.tokenizer': {len(tokenizer)} ids, more than the model's vocab_size "
                         f"{vocab_size} (set model.config.vocab_size)")
    ids = []
    for text in read_texts(_files(cfg.source), cfg.text_field, use_datasets):
        ids += tokenizer.encode(text)
    return TokenChunks(torch.tensor(ids, dtype=torch.long), cfg.seq_len)


def split_held_out(dataset, fraction: float):
    """(training rows, held-out rows): the last round(fraction * len) rows are held out. The tail, not a random
    pick, so that a text file's held-out rows are one contiguous stretch that no training row overlaps."""
    n = len(dataset)
    held = round(fraction * n)
    if held < 1 or held >= n:
        raise ConfigError(f"config key 'eval.fraction': {fraction} of {n} rows holds out {held}; need 1 to {n - 1}")
    return (torch.utils.data.Subset(dataset, range(n - held)),
            torch.utils.data.Subset(dataset, range(n - held, n)))


class ResumableBatches(torch.utils.data.Sampler):
    """Index lists of one rank's micro-batches: global micro-batch k holds positions
    [k*m, (k+1)*m) of the epoch's permutation (m = global_batch / grad_accum), and rank r of
    dp takes its r-th equal part. `start` counts global micro-batches already consumed."""

    def __init__(self, n, micro_global, dp_rank, dp_size, seed, start=0):
        if micro_global % dp_size:
            raise ValueError(f"a global micro-batch of {micro_global} does not split over {dp_size} data-parallel ranks")
        if micro_global > n:
            raise ConfigError(f"config key 'data.global_batch': a micro-batch of {micro_global} exceeds the {n} samples")
        self.n, self.m, self.rank, self.dp, self.seed, self.start = n, micro_global, dp_rank, dp_size, seed, start
        self.per_epoch = n // micro_global

    def __len__(self):
        return 1 << 62

    def __iter__(self):
        k = self.start
        while True:
            epoch, j = divmod(k, self.per_epoch)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
            local = self.m // self.dp
            first = j * self.m + self.rank * local
            yield perm[first: first + local].tolist()
            k += 1
