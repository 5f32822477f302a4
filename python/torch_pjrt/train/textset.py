"""A small English-like text set made at run time from a seeded grammar: nothing downloaded, no copied prose.

    python -m torch_pjrt.train.textset OUT.txt [--lines 400] [--seed 0]
    python -m torch_pjrt.train examples/train_llama_tiny.yaml data.source=OUT.txt

Each line is one document of one to three sentences ("the quiet robot reads a green map near the river.").
The same (lines, seed) give the same bytes on every machine: `random.Random(seed)` with `choice` only, whose
sequence CPython keeps stable. The byte tokenizer (`data.tokenizer: byte`) reads it as UTF-8 bytes; the grammar is
ASCII, lower case, with a small vocabulary, so a tiny model learns its spelling and word order in a few dozen steps
(docs/train.md, "Proof").
"""
from __future__ import annotations

import argparse
import os
import random

__all__ = ["generate", "write_text_set"]

_DET = ["the", "a", "one", "every", "that", "this", "my", "our"]
_DET_PLURAL = ["the", "two", "three", "some", "many", "all the", "those", "our"]
_ADJ = ["small", "quiet", "green", "old", "bright", "slow", "tall", "round", "clever", "tired", "warm", "empty"]
_NOUN = ["robot", "cat", "river", "garden", "teacher", "lamp", "window", "farmer", "boat", "map", "city", "bird",
         "kettle", "engine", "letter", "hill"]
_VERB = [("reads", "read"), ("finds", "find"), ("watches", "watch"), ("builds", "build"), ("carries", "carry"),
         ("paints", "paint"), ("follows", "follow"), ("opens", "open"), ("cleans", "clean"), ("draws", "draw")]
_INTRANS = [("sleeps", "sleep"), ("waits", "wait"), ("sings", "sing"), ("runs", "run"), ("rests", "rest"),
            ("listens", "listen")]
_PREP = ["near", "under", "behind", "beside", "across", "inside", "above", "past"]
_ADV = ["slowly", "quietly", "again", "today", "at night", "every morning", "before noon", "in the rain"]
_CONJ = ["and", "but", "so", "while", "because"]


def _plural(noun: str) -> str:
    if noun.endswith(("ch", "sh", "s", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _noun_phrase(r: random.Random) -> tuple[str, bool]:
    plural = r.choice([False, False, True])
    noun = r.choice(_NOUN)
    words = [r.choice(_DET_PLURAL if plural else _DET)]
    if r.choice([True, True, False]):
        words.append(r.choice(_ADJ))
    words.append(_plural(noun) if plural else noun)
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return " ".join(words), plural


def _clause(r: random.Random) -> str:
    subject, plural = _noun_phrase(r)
    if r.choice([True, True, False]):
        verb = r.choice(_VERB)[1 if plural else 0]
        obj, _ = _noun_phrase(r)
        words = [subject, verb, obj]
    else:
        words = [subject, r.choice(_INTRANS)[1 if plural else 0]]
    if r.choice([True, False]):
        place, _ = _noun_phrase(r)
        words += [r.choice(_PREP), place]
    if r.choice([True, False, False]):
        words.append(r.choice(_ADV))
    return " ".join(words)


def _sentence(r: random.Random) -> str:
    text = _clause(r)
    if r.choice([True, False, False]):
        text += " " + r.choice(_CONJ) + " " + _clause(r)
    return text + r.choice([".", ".", ".", "!", "?"])


def generate(lines: int = 400, seed: int = 0) -> list[str]:
    """`lines` documents, each one to three sentences."""
    r = random.Random(seed)
    return [" ".join(_sentence(r) for _ in range(r.choice([1, 2, 2, 3]))) for _ in range(lines)]


def write_text_set(path: str, lines: int = 400, seed: int = 0) -> str:
    """Writes generate(lines, seed) to path, a document per line (the trainer's .txt layout); returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(generate(lines, seed)) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_pjrt.train.textset", description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--lines", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = write_text_set(args.out, args.lines, args.seed)
    print(f"{path}: {args.lines} lines, {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
