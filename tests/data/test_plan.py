"""The shard plan is deterministic and independent of the number of workers.

One worker builds every shard in-process; three separate Python processes build interleaved
subsets in reverse order: process 0 runs the whole pipeline from a fresh, empty cache (it trains
the tokenizer and tokenises the corpus itself), processes 1 and 2 receive the pickled plan as a
Ray worker would. Every shard must be byte-identical.
"""

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hmscale.config import build_config
from hmscale.data import ShardPlan, prepare_data

SETTINGS = {"tokenizer": {"vocab_size": 400}, "data": {"max_documents": 40, "seq_len": 64, "sequences_per_shard": 16}}

WORKER = textwrap.dedent(
    """
    import json, pickle, sys
    import numpy as np
    settings, cache, worker, workers, out = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if cache.endswith(".pkl"):
        with open(cache, "rb") as f:
            plan = pickle.load(f)
    else:
        from hmscale.config import build_config
        from hmscale.data import prepare_data
        settings["data"]["cache_dir"] = cache
        plan = prepare_data(build_config(settings), log=lambda *a: None).plan
    mine = [i for i in range(plan.num_shards) if i % workers == worker][::-1]
    arrays = {"hash": np.frombuffer(plan.hash.encode(), dtype=np.uint8)}
    for i in mine:
        s = plan.shard(i)
        arrays[f"tokens_{i}"], arrays[f"seq_idx_{i}"] = s["tokens"], s["seq_idx"]
        arrays[f"keys_{i}"] = np.array(s["keys"])
    np.savez(out, **arrays)
    """
)


def _cfg(cache):
    s = json.loads(json.dumps(SETTINGS))
    s["data"]["cache_dir"] = str(cache)
    return build_config(s)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(_cfg(tmp_path_factory.mktemp("cache")), log=lambda *a: None)


def test_one_worker_equals_three_processes(data, tmp_path):
    plan = data.plan
    assert plan.num_shards >= 6
    ref = {i: plan.shard(i) for i in range(plan.num_shards)}
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    sources = [tmp_path / "fresh_cache", tmp_path / "plan.pkl", tmp_path / "plan.pkl"]
    procs = [
        subprocess.Popen([sys.executable, str(script), json.dumps(SETTINGS), str(sources[w]), str(w), "3",
                          str(tmp_path / f"w{w}.npz")], cwd=Path(__file__).resolve().parents[2],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for w in range(3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    seen = set()
    for w in range(3):
        z = np.load(tmp_path / f"w{w}.npz")
        assert bytes(z["hash"]).decode() == plan.hash
        for i in range(w, plan.num_shards, 3):
            assert z[f"tokens_{i}"].dtype == np.int32 and z[f"seq_idx_{i}"].dtype == np.int32
            assert z[f"tokens_{i}"].tobytes() == ref[i]["tokens"].tobytes()
            assert z[f"seq_idx_{i}"].tobytes() == ref[i]["seq_idx"].tobytes()
            assert list(z[f"keys_{i}"]) == ref[i]["keys"]
            seen.add(i)
    assert seen == set(range(plan.num_shards))


def test_shards_tile_the_stream(data):
    plan = data.plan
    S, L = plan.sequences_per_shard, plan.seq_len
    shards = [plan.shard(i) for i in range(plan.num_shards)]
    assert sum(len(s["keys"]) for s in shards) == plan.num_sequences
    assert all(len(s["keys"]) == S for s in shards[:-1]) and 1 <= len(shards[-1]["keys"]) <= S
    assert shards[1]["keys"][0] == "000001-0000" and shards[0]["keys"][3] == "000000-0003"
    # the shards deal the stream's rows in the plan's fixed order: put back in stream order they are the stream
    rows = np.concatenate([s["tokens"] for s in shards])
    order = np.concatenate([plan.shard_rows(i) for i in range(plan.num_shards)])
    assert sorted(order.tolist()) == list(range(plan.num_sequences))
    stream = rows[np.argsort(order)].reshape(-1)
    assert np.array_equal(stream, np.asarray(np.load(Path(data.stream_dir) / "train.tokens.npy"))[: plan.total_tokens])
    for s in shards:
        assert s["tokens"].shape == s["seq_idx"].shape and s["tokens"].shape[1] == L
        assert (s["seq_idx"][:, 0] == 0).all() and (np.diff(s["seq_idx"], axis=1) >= 0).all()
    with pytest.raises(IndexError):
        plan.shard(plan.num_shards)


def test_plan_pickles_by_path_and_hash_tracks_settings(data):
    plan = data.plan
    blob = pickle.dumps(plan)
    assert len(blob) < 4096  # the stream travels as a path, not as arrays
    again = pickle.loads(blob)
    assert again.hash == plan.hash
    assert again.shard(2)["tokens"].tobytes() == plan.shard(2)["tokens"].tobytes()
    tokens = np.asarray(np.load(Path(data.stream_dir) / "train.tokens.npy"))
    lens = np.load(Path(data.stream_dir) / "train.doc_lens.npy")
    same = ShardPlan(tokens, lens, plan.seq_len, plan.sequences_per_shard,
                     tokenizer_fingerprint=plan.tokenizer_fingerprint, source=plan.source)
    assert same.hash == plan.hash  # the content digest is recomputed identically
    assert ShardPlan(tokens, lens, plan.seq_len, plan.sequences_per_shard + 1,
                     tokenizer_fingerprint=plan.tokenizer_fingerprint, source=plan.source).hash != plan.hash
    bumped = tokens.copy()
    bumped[5] = (bumped[5] + 1) % data.vocab_size
    assert ShardPlan(bumped, lens, plan.seq_len, plan.sequences_per_shard,
                     tokenizer_fingerprint=plan.tokenizer_fingerprint, source=plan.source).hash != plan.hash


def test_bundle(data):
    assert data.val_tokens.dtype == np.int32 and data.val_seq_idx.dtype == np.int32
    assert data.val_tokens.shape[1] == 64 and len(data.val_tokens) > 0
    assert data.vocab_size == len(data.tokenizer) <= 400
    assert data.eos_id == data.tokenizer.eos_token_id == 0
    assert int(data.plan.all_tokens().max()) < data.vocab_size
