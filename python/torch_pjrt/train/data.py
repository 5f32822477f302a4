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

__all__ = ["ByteTokenizer", "load_tokenizer", "SyntheticTokens", "TokenChunks", "build_dataset", "ResumableBatches"]


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


def load_tokenizer(name: str):
    return ByteTokenizer() if name == "byte" else _HFTokenizer(name)


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
            raise ValueError(f"data.source: {tokens.numel()} tokens, fewer than one row of data.seq_len={seq_len}")
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
            raise FileNotFoundError(f"config key 'data.source': no file matches {part.strip()!r}")
        files += found
    return files


def read_texts(files, text_field="text", use_datasets=None) -> list[str]:
    """The documents of local .txt (one per line) / .jsonl files, through HF `datasets` when it is installed."""
    jsonl = [f.endswith((".jsonl", ".json")) for f in files]
    if any(jsonl) and not all(jsonl):
        raise ValueError("config key 'data.source': mix of jsonl and text files")
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
            raise KeyError(f"config key 'data.text_field': {field!r} not in {ds.column_names}")
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
                        raise KeyError(f"config key 'data.text_field': {text_field!r} not in {path}")
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
        raise ValueError(f"config key 'data.tokenizer': {len(tokenizer)} ids, more than the model's vocab_size "
                         f"{vocab_size} (set model.config.vocab_size)")
    ids = []
    for text in read_texts(_files(cfg.source), cfg.text_field, use_datasets):
        ids += tokenizer.encode(text)
    return TokenChunks(torch.tensor(ids, dtype=torch.long), cfg.seq_len)


class ResumableBatches(torch.utils.data.Sampler):
    """Index lists of one rank's micro-batches: global micro-batch k holds positions
    [k*m, (k+1)*m) of the epoch's permutation (m = global_batch / grad_accum), and rank r of
    dp takes its r-th equal part. `start` counts global micro-batches already consumed."""

    def __init__(self, n, micro_global, dp_rank, dp_size, seed, start=0):
        if micro_global % dp_size:
            raise ValueError(f"a global micro-batch of {micro_global} does not split over {dp_size} data-parallel ranks")
        if micro_global > n:
            raise ValueError(f"config key 'data.global_batch': a micro-batch of {micro_global} exceeds the {n} samples")
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
