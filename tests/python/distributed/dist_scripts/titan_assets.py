"""Writes the two assets torchtitan's Llama-3 debug config reads, generated here (nothing copied or downloaded).

    python titan_assets.py DIR  ->  DIR/tests/assets/tokenizer/{tokenizer.json,tokenizer_config.json}
                                    DIR/tests/assets/c4_test/data.json

The debug config reads both relative to the working directory (hf_assets_path "./tests/assets/tokenizer", the
c4_test dataset "tests/assets/c4_test"), so a run started in DIR finds them with no option. The tokenizer is a
byte-level BPE trained by the `tokenizers` library on the generated text (vocabulary 512 < the debug model's
2048); the text is seeded pseudo-English, one JSON object with a "text" field per line, as C4's files are.
"""
from __future__ import annotations

import json
import os
import random
import sys

WORDS = (
    "the a an of to in and or but is was are were be been has have had do does did will would can could "
    "model data train step loss token layer weight device graph program tensor value shard rank process "
    "small large quick slow red green blue river mountain city garden window paper music light stone "
    "learns reads writes keeps moves finds builds opens closes runs waits grows falls turns holds "
    "every each some many few other same first last next early late new old long short high low"
).split()


def documents(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def write_assets(root: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir = os.path.join(root, "tests", "assets", "tokenizer")
    data_dir = os.path.join(root, "tests", "assets", "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    docs = documents()
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "url": f"generated://{i}"}) + "\n")

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": True}, f)


if __name__ == "__main__":
    write_assets(sys.argv[1])
