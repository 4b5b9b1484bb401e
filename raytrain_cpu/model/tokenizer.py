"""Tokenizers: the bundled one (no download) and the model's own.

The bundled tokenizer is a 2048-token byte-level BPE trained on the bundled wikitext-2
training text, small enough that a few-hundred-thousand-parameter model spends most of its
parameters on layers rather than on the embedding. Rebuild it with
`python -m raytrain_cpu.model.tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).parents[1] / "assets"
BUNDLED_TOKENIZER = ASSETS / "tokenizer"
BUNDLED_WIKITEXT = ASSETS / "wikitext-2"
BUNDLED_SFT = ASSETS / "sft"  # chat and instruction examples made from the bundled wikitext
EOS = "<|endoftext|>"


def resolve_tokenizer_path(tokenizer: str, model_name_or_path: str) -> str:
    """The path or hub id AutoTokenizer should load: 'bundled', '' (the model's own) or explicit."""
    if tokenizer == "bundled":
        return str(BUNDLED_TOKENIZER)
    return tokenizer or model_name_or_path


def load_tokenizer(path: str):
    """A fast tokenizer with an EOS token (used as the document separator when packing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {path!r} has no EOS token; packing needs one to separate documents.")
    return tok


# What transformers 5 writes into tokenizer_config.json about how this process loaded the
# tokenizer: a copy given to someone else (an export, the data cache's) must not say it.
LOAD_TIME_KEYS = ("is_local", "local_files_only")


def save_tokenizer(tok, out: str | Path) -> None:
    """tok.save_pretrained(out), without the load-time keys in its tokenizer_config.json."""
    tok.save_pretrained(str(out))
    path = Path(out) / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if any(k in config for k in LOAD_TIME_KEYS):
            path.write_text(json.dumps({k: v for k, v in config.items() if k not in LOAD_TIME_KEYS}, indent=2) + "\n")


def build_bundled_tokenizer(vocab_size: int = 2048) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(BUNDLED_WIKITEXT / "test.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None)
    fast.model_max_length = 1_000_000
    fast.save_pretrained(str(BUNDLED_TOKENIZER))
    return BUNDLED_TOKENIZER


if __name__ == "__main__":
    print(build_bundled_tokenizer())
