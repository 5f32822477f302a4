"""Padded batch shapes for the tpu runner: each step's token count and request count round up to a bucket.

torch_pjrt compiles a program per shape. Without padding every new (scheduled tokens, requests) pair the
scheduler produces is a new program; padded, a step's program is one of |token buckets| x |request buckets|,
all compiled at engine start (TpuModelRunner.warm_up_buckets), so that serving compiles nothing.

- tokens: powers of two from MIN_TOKEN_BUCKET up to max_num_batched_tokens (which is the last bucket
  whether or not it is a power of two); fewer tokens than MIN_TOKEN_BUCKET pad to it;
- requests (logit rows, block-table rows, query starts, sequence lengths): powers of two from 1 up to
  max_num_seqs (the last bucket).

What padding writes and reads (attention.py, worker.py): padded tokens come after the last request's tokens,
belong to no request (their attention rows see no key: zeros), and write their keys and values into vLLM's
null block (block 0, which the block pool never hands out); padded requests have no query tokens, no keys
(sequence length 0) and a block-table row of the null block; padded logit rows are dropped on the host
before the sampler.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 16


def _powers_of_two_up_to(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... below high, then high (high >= 1)."""
    sizes = []
    size = max(1, low)
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return tuple(sizes)


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    requests: tuple[int, ...]

    @classmethod
    def of(cls, max_num_batched_tokens: int, max_num_seqs: int) -> Buckets:
        return cls(_powers_of_two_up_to(MIN_TOKEN_BUCKET, max_num_batched_tokens),
                   _powers_of_two_up_to(1, max_num_seqs))

    @classmethod
    def from_config(cls, vllm_config) -> Buckets:
        scheduler = vllm_config.scheduler_config
        return cls.of(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)

    @staticmethod
    def _round_up(n: int, sizes: tuple[int, ...], what: str) -> int:
        i = bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} {what} in one step: more than the largest bucket, {sizes[-1]}")
        return sizes[i]

    def num_tokens(self, n: int) -> int:
        return self._round_up(n, self.tokens, "tokens")

    def num_reqs(self, n: int) -> int:
        return self._round_up(n, self.requests, "requests")

    def pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, request bucket) a step can pad to: a step has at least one token per request,
        so a request bucket is reachable from a token bucket when its smallest request count fits."""
        out = []
        for t in self.tokens:
            smallest = 1
            for r in self.requests:
                if smallest <= t:
                    out.append((t, r))
                smallest = r + 1
        return out
