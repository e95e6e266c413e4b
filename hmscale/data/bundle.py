"""`prepare_data(cfg)`: source -> tokenizer -> tokenised stream (cached) -> shard plan + validation rows."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hmscale.data.cachedir import atomic_dir, stable_hash
from hmscale.data.packing import pack, tokenize_documents
from hmscale.data.plan import ShardPlan, stream_digest
from hmscale.data.sources import TextSource, source_from_config
from hmscale.data.tokenizer import get_tokenizer, tokenizer_fingerprint

SPLITS = ("train", "validation")
STREAM_VERSION = 1


@dataclass
class DataBundle:
    tokenizer: object  # a transformers tokenizer (PreTrainedTokenizerFast for the embedded BPE)
    plan: ShardPlan
    val_tokens: np.ndarray  # int32 [n, L]
    val_seq_idx: np.ndarray  # int32 [n, L]
    vocab_size: int
    eos_id: int
    source: str = ""
    stream_dir: str | None = None
    info: dict = field(default_factory=dict)


def tokenized_streams(source: TextSource, tokenizer, eos_id: int, cache_dir: str | Path, log=print) -> Path:
    """Tokenise both splits once; cache `{split}.tokens.npy` (int32) and `{split}.doc_lens.npy` atomically."""
    fp = tokenizer_fingerprint(tokenizer)
    key = stable_hash({"v": STREAM_VERSION, "tokenizer": fp, "source": source.description,
                       "train": source.key("train"), "validation": source.key("validation"), "eos": eos_id})
    target = Path(cache_dir) / "tokens" / key
    if (target / "meta.json").exists():
        meta = json.loads((target / "meta.json").read_text())
        log(f"[data] tokens: cached stream at {target} ({meta['train']['tokens']:,} train tokens)")
        return target

    def build(tmp: Path):
        meta = {"source": source.description, "tokenizer_fingerprint": fp, "eos_id": eos_id}
        for split in SPLITS:
            t0 = time.perf_counter()
            docs = source.documents(split)
            tokens, lens = tokenize_documents(tokenizer, docs, eos_id)
            np.save(tmp / f"{split}.tokens.npy", tokens)
            np.save(tmp / f"{split}.doc_lens.npy", lens)
            meta[split] = {"documents": len(docs), "chars": sum(len(d) for d in docs), "tokens": int(len(tokens)),
                           "digest": stream_digest(tokens, lens)}
            log(f"[data] tokens: {split}: {len(docs)} documents -> {len(tokens):,} tokens "
                f"in {time.perf_counter() - t0:.1f} s")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    atomic_dir(target, build)
    log(f"[data] tokens: cached at {target}")
    return target


def prepare_data(cfg, log=print) -> DataBundle:
    """Everything the stages need from the data: tokenizer, train shard plan, validation rows."""
    d = cfg.data
    source = source_from_config(d)
    tokenizer = get_tokenizer(cfg, source, log=log)
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer.name_or_path: the tokenizer has no eos token; documents need one to be packed")
    stream = tokenized_streams(source, tokenizer, int(eos_id), d.cache_dir, log=log)
    meta = json.loads((stream / "meta.json").read_text())
    tokens = np.load(stream / "train.tokens.npy", mmap_mode="r")
    lens = np.load(stream / "train.doc_lens.npy")
    plan = ShardPlan(tokens, lens, d.seq_len, d.sequences_per_shard,
                     tokenizer_fingerprint=meta["tokenizer_fingerprint"], source=source.description,
                     content_digest=meta["train"]["digest"], stream_path=stream / "train")
    if plan.num_sequences == 0:
        raise ValueError(f"data.seq_len: the train split has {len(tokens)} tokens, fewer than one row of {d.seq_len}; "
                         "use more documents or a shorter seq_len")
    val_tokens, val_seq_idx = pack(np.load(stream / "validation.tokens.npy"), np.load(stream / "validation.doc_lens.npy"), d.seq_len)
    if len(val_tokens) == 0:
        raise ValueError(f"data.val_fraction: the validation split has fewer than {d.seq_len} tokens; "
                         "raise val_fraction or max_documents")
    vocab_size = len(tokenizer)
    log(f"[data] plan {plan.hash}: {plan.num_shards} shards x {plan.sequences_per_shard} x {plan.seq_len} tokens "
        f"({plan.total_tokens:,} train tokens), {len(val_tokens)} validation rows, vocab {vocab_size}")
    return DataBundle(tokenizer=tokenizer, plan=plan, val_tokens=val_tokens, val_seq_idx=val_seq_idx,
                      vocab_size=vocab_size, eos_id=int(eos_id), source=source.description, stream_dir=str(stream),
                      info=meta)
