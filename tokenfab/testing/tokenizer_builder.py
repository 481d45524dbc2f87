"""Build a small, real byte-level BPE tokenizer offline, deterministically.

No machine here reaches a model hub, so tiny checkpoints (tests, the embedded default model) carry a tokenizer
trained on a corpus generated from a fixed word list and a seeded RNG. Byte-level BPE covers any UTF-8 text.
The saved folder loads with ``transformers.AutoTokenizer.from_pretrained`` and has a ChatML chat template.
"""
from __future__ import annotations

import json
import os
import random

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are have not had but were his "
    "her they one all their there been has when who will more no if out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right "
    "used take three access code room number answer question model token engine server request cache block expert "
    "power energy cost device memory latency throughput prefill decode attention layer router weight value key query "
    "python function return class import print list dict string integer float true false none def self"
).split()


def build_corpus(num_sentences: int = 6000, seed: int = 0) -> list[str]:
    """A deterministic pseudo-English corpus with digits, punctuation, code-ish lines and chat markers."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_sentences):
        kind = i % 5
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if kind == 0:
            s = " ".join(words).capitalize() + rng.choice([".", "!", "?", ","])
        elif kind == 1:
            s = f"The access code for room {rng.randint(0, 9999)} is {rng.randint(0, 99999)}."
        elif kind == 2:
            s = f"def {words[0]}_{words[1]}({words[2]}, {words[3]}):\n    return {words[2]} + {rng.randint(0, 99)}"
        elif kind == 3:
            s = f"Question: what is {rng.randint(0, 999)} + {rng.randint(0, 999)}? Answer: {rng.randint(0, 1999)}"
        else:
            s = " ".join(words) + f" {rng.randint(0, 10**6)} ({rng.choice(_WORDS)}); \"{rng.choice(_WORDS)}\""
        lines.append(s)
    return lines


def build_tokenizer(out_dir: str, vocab_size: int = 1024, model_max_length: int = 1 << 20) -> str:
    """Train a byte-level BPE tokenizer with ``vocab_size`` entries and save it in HF format to ``out_dir``.

    Returns ``out_dir``. Token ids 0..4 are the special tokens (bos=0, eos=1, pad=2, im_start=3, im_end=4).

    Raises:
        ValueError: vocab_size too small to hold the 256 byte tokens plus specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 8:
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS) + 8}, got {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Record the chat template in tokenizer_config.json too (older loaders read it from there).
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir
