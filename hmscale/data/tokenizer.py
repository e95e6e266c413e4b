"""Tokenizers: a Hugging Face tokenizer by name or path, or a byte-level BPE trained on the data.

The trained BPE is cached under `{cache_dir}/tokenizers/{key}`, key = hash of (the train
split's identity: file list and sizes for the embedded corpus, vocab size, training settings).
It is returned as a `PreTrainedTokenizerFast` whose eos token `<|endoftext|>` has id 0
(the id the miniature teacher configs use).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from hmscale.data.cachedir import resumable_dir, stable_hash

EOS_TOKEN = "<|endoftext|>"
BPE_VERSION = 2  # bump when the training recipe below changes (2: the document crossing max_chars is cut there)
DEFAULT_TRAIN_CHARS = 8_000_000  # first 8 M characters of the (sorted) train split: a few seconds on 2 cores


class TokenizerLoadError(OSError, ValueError):
    """A tokenizer that cannot be loaded: an OSError (what `transformers` raises) and a ValueError (a bad setting,
    reported in one line by the command line)."""


def load_tokenizer(name_or_path: str):
    """`AutoTokenizer.from_pretrained(name_or_path)`, with an eos token guaranteed."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path))  # (~/models/x, as the teacher's path)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TokenizerLoadError(f"tokenizer.name_or_path: cannot load tokenizer {name_or_path!r}: {first}") from err
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer.name_or_path: tokenizer {name_or_path!r} has no eos token; documents need one to be packed")
    # a directory without tokenizer files (a teacher's, which tokenizer.name_or_path defaults to) loads as an empty
    # tokenizer that encodes every document to its eos token alone: the whole recipe then ran on eos-only rows
    if not tok.encode("def main(): return 1  # the quick brown fox", add_special_tokens=False):
        raise TokenizerLoadError(f"tokenizer.name_or_path: {name_or_path!r} gives a tokenizer that encodes text to no "
                                 "tokens (no tokenizer files there?); save the teacher's tokenizer beside it "
                                 "(tokenizer.save_pretrained) or set tokenizer.name_or_path")
    return tok


def _wrap(tokenizer_object):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (`tokenizers`) trained on texts, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return _wrap(tok)


def bpe_cache_key(source, vocab_size: int, max_chars: int | None) -> str:
    return stable_hash({"v": BPE_VERSION, "train": source.key("train"), "vocab": vocab_size, "chars": max_chars})


def trained_tokenizer(source, vocab_size: int, cache_dir: str | Path, max_chars: int | None = DEFAULT_TRAIN_CHARS, log=print):
    """The byte-level BPE for `source`, trained once and cached on disk."""
    from transformers import PreTrainedTokenizerFast

    target = Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{bpe_cache_key(source, vocab_size, max_chars)}"
    if (target / "tokenizer.json").exists():
        log(f"[data] tokenizer: cached byte-level BPE ({vocab_size}) at {target}")
    else:
        def build(tmp: Path):
            t0 = time.perf_counter()
            texts = source.training_texts(max_chars)
            mb = sum(len(t) for t in texts) / 1e6
            log(f"[data] tokenizer: training a byte-level BPE (vocab {vocab_size}) on {len(texts)} documents, {mb:.1f} MB ...")
            tok = train_bpe(texts, vocab_size)
            tok.save_pretrained(tmp)
            log(f"[data] tokenizer: trained in {time.perf_counter() - t0:.1f} s, cached at {target}")

        # one trainer at a time, in the fixed `.{name}.partial` that an interrupted (killed) training leaves and the
        # next one clears (resume=False), not a per-process temporary a SIGKILL would leave for good; the lock apart,
        # under {data.cache_dir}/locks as the teacher's: tokenizers/ holds tokenizers only
        resumable_dir(target, build, log=log, resume=False, tag="data",
                      lock_path=target.parent.parent / "locks" / f"tokenizer-{target.name}.lock")
    tok = PreTrainedTokenizerFast.from_pretrained(target)
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == tok.eos_token_id
    return tok


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the tokenizer's full definition (vocab, merges, normaliser, special tokens)."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: its vocabulary
        h.update(repr(sorted(tok.get_vocab().items())).encode())
    h.update(repr((tok.eos_token, tok.eos_token_id, len(tok))).encode())
    return h.hexdigest()


def get_tokenizer(cfg, source, log=print):
    """The tokenizer a RunConfig asks for: `tokenizer.name_or_path`, or the cached BPE for `source`."""
    if cfg.tokenizer.name_or_path:
        return load_tokenizer(cfg.tokenizer.name_or_path)
    return trained_tokenizer(source, cfg.tokenizer.vocab_size, cfg.data.cache_dir, log=log)
