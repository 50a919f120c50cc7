#!/usr/bin/env python3
"""Writes the tokenizer of the tiny HF fixtures (vocabulary 256): a byte-level BPE, the kind
GLM-5's and DeepSeek-V3's tokenizers are, trained with HF `tokenizers` on the short text below
(its alphabet is the characters of that text, so only ASCII prompts encode), with one special
token, `<|endoftext|>`. Also writes `tokenizer-expected.json`: prompts, their ids and each id's
text, as the Python library gives them, for `tests/prompt.rs`.

    pip install tokenizers
    python3 tools/make_tokenizer.py tests/fixtures/hf/glm5-sparse
"""

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = """
Multi-head latent attention keeps one small latent vector per token in the cache instead of
keys and values for every head. The queries of each head are projected, and the keys and values
are rebuilt from the latent when attention runs. Weight absorption folds the key projection into
the query and the value projection into the output, so decode reads only the latent: fewer bytes
per token, more arithmetic per byte. A debugger steps through the forward pass op by op, shows
what each op wrote and where, and compares the engine with a reference until the first op that
departs from it. Hello world! The quick brown fox jumps over the lazy dog. 0123456789 ,.;:?!'"()-
"""

PROMPTS = ["Hello world", "The latent cache holds one vector per token.", "attention"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<|endoftext|>"], initial_alphabet=[],
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    assert tok.get_vocab_size() <= 256, tok.get_vocab_size()
    tok.save(os.path.join(out, "tokenizer.json"))
    expected = []
    for p in PROMPTS:
        ids = tok.encode(p).ids
        expected.append({"prompt": p, "ids": ids, "pieces": [tok.decode([i]) for i in ids],
                         "decoded": tok.decode(ids)})
    with open(os.path.join(out, "tokenizer-expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"vocabulary {tok.get_vocab_size()}; {PROMPTS[0]!r} -> {expected[0]['ids']}")


if __name__ == "__main__":
    main()
