"""Fixtures for the teacher-cache tests: a random miniature teacher and a small deterministic plan."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.data.plan import ShardPlan
from hmscale.teacher.flavors import neox_config

VOCAB = 300
SEQ_LEN = 32


def make_teacher(seed: int = 0):
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = neox_config("pythia-nano", vocab_size=VOCAB)
    cfg._attn_implementation = "eager"
    return GPTNeoXForCausalLM(cfg).eval()


def make_data(shards: int = 4, per_shard: int = 3, seq_len: int = SEQ_LEN, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = shards * per_shard * seq_len
    tokens = rng.integers(1, VOCAB, size=n).astype(np.int32)
    doc_lens = np.full(n // 16, 16, dtype=np.int64)
    plan = ShardPlan(tokens, doc_lens, seq_len, per_shard, source=f"random-{seed}")
    return SimpleNamespace(plan=plan, vocab_size=VOCAB, eos_id=0)


def make_cfg(root, **over):
    items = [f"cache.root={root}", "cache.batch_size=2", "teacher.flavor=pythia-nano"]
    items += [f"{k}={v}" for k, v in over.items()]
    return build_config({}, items)


@pytest.fixture
def teacher():
    return make_teacher()


@pytest.fixture
def data():
    return make_data()


def live_capture(teacher, plan, shard, batch_size, layers):
    """The teacher's live capture of one shard on the teacher's device, batched like the cache worker:
    {key: {layer: (attn_input, attn_output)}}, on the CPU."""
    from hmscale.teacher.capture import capture_layers

    s = plan.shard(shard)
    dev = next(teacher.parameters()).device
    out = {}
    for b0 in range(0, len(s["keys"]), batch_size):
        ids = torch.from_numpy(s["tokens"][b0 : b0 + batch_size]).long().to(dev)
        with torch.no_grad():
            caps = capture_layers(teacher, ids, layers=layers, qkv=False)
        for j, key in enumerate(s["keys"][b0 : b0 + batch_size]):
            out[key] = {i: (caps[i].attn_input[j].cpu(), caps[i].attn_output[j].cpu()) for i in layers}
    return out


def shard_bytes(cache_dir):
    return {p.name: p.read_bytes() for p in sorted(cache_dir.iterdir())}


@pytest.fixture
def tools():
    """The factories, for tests that need more than one teacher / plan / config."""
    return SimpleNamespace(make_teacher=make_teacher, make_data=make_data, make_cfg=make_cfg, shard_bytes=shard_bytes,
                           live_capture=live_capture)


@pytest.fixture
def forwarded(monkeypatch):
    """The shard ids that get a teacher forward in this process (the local engine goes through run_shards)."""
    from hmscale.teacher.cache.worker import ShardWorker

    seen, real = [], ShardWorker.run_shards

    def spy(self, shard_ids, *a, **k):
        seen.extend(shard_ids)
        return real(self, shard_ids, *a, **k)

    monkeypatch.setattr(ShardWorker, "run_shards", spy)
    return seen
