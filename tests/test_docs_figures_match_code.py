"""README.md and docs/CACHE_FORMAT.md, read on a CPU machine: the figures and defaults
the docs state that no other test held to the code. Fast: no training, no Ray (one shard written to tmp_path)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CACHE_FORMAT = (REPO / "docs" / "CACHE_FORMAT.md").read_text()


def _bytes_per_token(n_layers, d_model, n_heads, seq_len, dtype="bfloat16", token_fraction=1.0, topk=0, layers=None,
                     vocab=50304):
    from hmscale.teacher.cache.format import TENSORS, CaptureSpec, TeacherShape, bytes_per_sample, layout

    spec = CaptureSpec(layers=tuple(range(n_layers) if layers is None else layers), tensors=TENSORS, dtype=dtype,
                       token_fraction=token_fraction, topk=topk)
    return bytes_per_sample(layout(spec, TeacherShape(n_layers, d_model, n_heads, vocab), seq_len)) / seq_len


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_cache_format_bytes_section_is_what_the_layout_gives():
    # docs/CACHE_FORMAT.md, "Bytes": Pythia-160m 36,885 bytes/token, Pythia-1b 131,097, top-32 adds 129; fp8 at 10 % of
    # positions 10,276 (all 12 layers) and 2,576 (layers 0, 5, 11): the exact tar bytes the writer's layout gives
    section = CACHE_FORMAT.split("## Bytes", 1)[1]
    m = re.search(r"Pythia-160m \(12 layers, d = 768, L = 2048\): ([\d,]+) bytes/token; Pythia-1b \(16 layers, "
                  r"d = 2048\): ([\d,]+) bytes/token; top-32 adds ([\d,]+)", section)
    assert m, "docs/CACHE_FORMAT.md's Bytes section changed its wording: update this test"
    full160, full1b, top32 = map(_number, m.groups())
    assert round(_bytes_per_token(12, 768, 12, 2048)) == full160
    assert round(_bytes_per_token(16, 2048, 8, 2048)) == full1b
    assert round(_bytes_per_token(12, 768, 12, 2048, topk=32) - _bytes_per_token(12, 768, 12, 2048)) == top32
    m = re.search(r"`token_fraction = 0\.1`: ([\d,]+) bytes/token \(all 12 layers\), ([\d,]+) \(layers 0, 5, 11\)",
                  section)
    assert m, "docs/CACHE_FORMAT.md's fp8 figures changed their wording: update this test"
    fp8_all, fp8_three = map(_number, m.groups())
    assert round(_bytes_per_token(12, 768, 12, 2048, "fp8_e4m3", 0.1)) == fp8_all
    assert round(_bytes_per_token(12, 768, 12, 2048, "fp8_e4m3", 0.1, layers=(0, 5, 11))) == fp8_three
    # and the README's "36.9 KB/token" of the same spec
    assert "36.9 KB/token" in README and round(_bytes_per_token(12, 768, 12, 2048) / 1000, 1) == 36.9


def _write_shard(path, spec, shape, seq_len, samples):
    from hmscale.teacher.cache.format import layout
    from hmscale.teacher.cache.writer import ShardWriter

    fields = layout(spec, shape, seq_len)
    writer = ShardWriter(path, 0)
    for row in range(samples):
        writer.add_sample(f"000000-{row:04d}", {n: np.zeros(f.shape, np.dtype(f.npy_dtype)) for n, f in fields.items()})
    return fields, writer.commit()


@pytest.mark.parametrize("topk, samples, shard_bytes", [(5, 3, 81_920), (4, 8, 204_800)])
def test_cache_format_manifest_example_figures_are_the_writers(tmp_path, topk, samples, shard_bytes):
    # docs/CACHE_FORMAT.md, "Manifest": the example's teacher (2 layers, d 64, 4 heads, vocab 300), seq_len 32, bf16,
    # top-5: bytes_per_token 768.0 and 81,920 bytes for a shard of 3 samples; the tests' tiny run with top-4: 768.0,
    # shards of 8 samples at 204,800 bytes. Written here by the shard writer itself.
    import json

    from hmscale.teacher.cache.format import TENSORS, CaptureSpec, TeacherShape, bytes_per_sample

    example = json.loads(CACHE_FORMAT.split("## Manifest", 1)[1].split("```", 2)[1].removeprefix("json\n"))
    t, plan, cap = example["teacher"], example["plan"], example["capture"]
    shape = TeacherShape(t["n_layers"], t["d_model"], t["n_heads"], t["vocab_size"])
    assert t["head_dim"] == shape.head_dim and example["layout"]["seq_len"] == plan["seq_len"]
    spec = CaptureSpec(layers=tuple(cap["layers"]), tensors=tuple(cap["tensors"]), dtype=cap["dtype"],
                       token_fraction=cap["token_fraction"], seed=cap["seed"], topk=topk, topk_dtype=cap["topk_dtype"])
    assert tuple(cap["tensors"]) == TENSORS and cap["topk"] == 5
    fields, info = _write_shard(tmp_path / "shard-000000.tar", spec, shape, plan["seq_len"], samples)
    assert bytes_per_sample(fields) / plan["seq_len"] == example["layout"]["bytes_per_token"] == 768.0
    assert info.bytes == (tmp_path / "shard-000000.tar").stat().st_size == shard_bytes
    assert f"{shard_bytes:,}" in CACHE_FORMAT
    entry = example["shards"]["0"]
    if samples == entry["samples"]:
        assert info.bytes == entry["bytes"] and info.tokens == entry["tokens"] == samples * plan["seq_len"]
    assert re.fullmatch(r"v1-[0-9a-f]{20}", example["key"])


def test_cache_key_is_the_formula_the_format_page_gives():
    # docs/CACHE_FORMAT.md, "Directory": key = "v1-" + sha256(json({"format_version": 1, "teacher": fingerprint,
    # "plan": plan hash, "capture": capture spec}))[:20], JSON with sorted keys, the capture spec as in the manifest
    import hashlib
    import json

    from hmscale.teacher.cache.format import FORMAT_VERSION, CaptureSpec, cache_key

    assert '`key = "v1-" + sha256(json({"format_version": 1, "teacher": fingerprint, "plan": plan hash, ' \
           '"capture": capture spec}))[:20]`' in CACHE_FORMAT and FORMAT_VERSION == 1
    spec = CaptureSpec(layers=(0, 3), tensors=("attn_output",), dtype="fp8_e4m3", token_fraction=0.25, seed=7, topk=8)
    blob = json.dumps({"format_version": 1, "teacher": "f" * 64, "plan": "0123456789abcdef",
                       "capture": spec.to_json()}, sort_keys=True)
    assert cache_key("f" * 64, "0123456789abcdef", spec) == "v1-" + hashlib.sha256(blob.encode()).hexdigest()[:20]


def test_cache_writer_threads_are_the_documented_default(monkeypatch):
    # README, "Teacher cache": HMSCALE_CACHE_WRITERS sets how many; default: half the cores, 2 to 8, for a
    # GPU worker, one on CPU (docs/CACHE_FORMAT.md, "Writing": 1 on a CPU, cores/2 in [2, 8] on a GPU)
    import hmscale.teacher.cache.worker as worker

    assert "half the cores, 2 to 8, for a GPU worker, one on CPU" in README
    monkeypatch.delenv("HMSCALE_CACHE_WRITERS", raising=False)
    for cores, expected in ((2, 2), (6, 3), (8, 4), (16, 8), (128, 8)):
        monkeypatch.setattr(worker.os, "cpu_count", lambda cores=cores: cores)
        assert worker.default_writer_threads("cuda") == expected
        assert worker.default_writer_threads("cpu") == 1
    monkeypatch.setenv("HMSCALE_CACHE_WRITERS", "3")
    assert worker.default_writer_threads("cpu") == worker.default_writer_threads("cuda") == 3


def test_compat_chunk_is_a_power_of_two_from_16_default_64(monkeypatch):
    # README: `HMSCALE_COMPAT_CHUNK`, a power of two >= 16, default 64
    from kernels import compat

    assert "`HMSCALE_COMPAT_CHUNK`, a power of two >= 16, default 64" in README
    monkeypatch.delenv("HMSCALE_COMPAT_CHUNK", raising=False)
    assert compat._chunk() == 64
    for ok in ("16", "128"):
        monkeypatch.setenv("HMSCALE_COMPAT_CHUNK", ok)
        assert compat._chunk() == int(ok)
    for bad in ("8", "48", "x"):
        monkeypatch.setenv("HMSCALE_COMPAT_CHUNK", bad)
        with pytest.raises(ValueError, match="HMSCALE_COMPAT_CHUNK"):
            compat._chunk()


def test_the_intervals_and_sizes_the_readme_quotes_are_the_codes():
    from hmscale.data import bundle, packing
    from hmscale.eval.long_context import long_context_eval

    # "HedgeMamba models ... are fed `4096`-token segments carrying their recurrent state"
    assert "are fed `4096`-token segments" in README
    assert inspect.signature(long_context_eval).parameters["segment"].default == 4096
    # "Data preparation streams the corpus (... progress every 30 s)"; "the stream is checkpointed every minute"
    assert "progress every 30 s" in README and "checkpointed every minute" in README
    params = inspect.signature(bundle.tokenized_streams).parameters
    assert params["progress_s"].default == 30.0 and params["checkpoint_s"].default == 60.0
    # "A document over 1M characters is tokenised in pieces cut at newlines"
    assert "A document over 1M characters is tokenised in pieces" in README
    assert packing.PIECE_CHARS == 1 << 20


def test_the_exported_model_module_only_imports_the_installed_package(tmp_path):
    # README: "the export carries a short module that takes the model from the installed package" (no model code copied)
    import ast

    from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM

    assert "the export carries a short module that takes the model from the installed package" in README
    cfg = HedgeMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64)
    HedgeMambaForCausalLM(cfg).save_pretrained(tmp_path)
    module = (tmp_path / "modeling_hedgemamba.py").read_text()
    tree = ast.parse(module)
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    assert "from hmscale.models.hedgemamba import" in module


def test_every_benchmark_prints_its_run_line_but_the_readers_the_readme_names():
    # README, "Development": `benchmarks/*.py` measure (each prints a `run:` line first ...; not `gpu_gaps.py`,
    # `ncu_lines.py` and `ssd_registers.py`, which only read a trace or an export or compile). Those print none
    readers = {"gpu_gaps.py", "ncu_lines.py", "ssd_registers.py"}
    assert "not `gpu_gaps.py`, `ncu_lines.py` and `ssd_registers.py`" in README
    silent = sorted(f.name for f in (REPO / "benchmarks").glob("*.py")
                    if f.name != "_runinfo.py" and "_runinfo" not in f.read_text())
    assert silent == sorted(readers), f"benchmarks without the run: line (benchmarks/_runinfo.py): {silent}"


def test_the_benchmarks_sections_the_readme_cites_exist():
    # README cites its figures as (BENCHMARKS.md, "Long context"): each such name is the start of a section heading
    headings = re.findall(r"^#{2,3} (.+)$", (REPO / "BENCHMARKS.md").read_text(), re.M)
    cited = set(re.findall(r'BENCHMARKS\.md, "([^"]+)"', README))
    assert cited, "README cites no BENCHMARKS.md section by name: update this test"
    missing = sorted(c for c in cited if not any(h.startswith(c) for h in headings))
    assert not missing, f"README cites BENCHMARKS.md sections that do not exist: {missing}"


def test_a_txt_file_holding_only_a_byte_order_mark_is_empty(tmp_path):
    # README, "Your own data": "Empty files (a byte-order mark alone included) and documents are skipped". True of
    # .jsonl / .json (tests/data/test_jsonl_sources.py); a .txt file of a BOM alone became a document "\ufeff",
    # and a .txt file starting with a BOM kept it as its first character
    from hmscale.data.sources import FileSource

    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf")
    (tmp_path / "doc.txt").write_bytes(b"\xef\xbb\xbfhello world\n")
    source = FileSource([str(tmp_path)], val_fraction=0.01)
    docs = [d for split in ("train", "validation") for d in source.documents(split)]
    assert docs == ["hello world\n"]


def test_a_txt_file_with_a_byte_order_mark_changes_its_sources_identity_and_no_other(tmp_path):
    # the mark was read as text before: data built from such a file must not be reused; other files keep their key
    from hmscale.data.sources import FileSource

    (tmp_path / "plain.txt").write_text("hello world\n")
    plain = FileSource([str(tmp_path / "plain.txt")]).description
    assert FileSource([str(tmp_path / "plain.txt")]).description == plain
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello world\n")
    assert "bom-dropped" not in plain
    assert "bom-dropped" not in FileSource([str(tmp_path / "plain.txt"), str(tmp_path / "bom.txt")])._digests[1][1][:64]
    assert FileSource([str(tmp_path / "bom.txt")])._digests[0][1].endswith(":bom-dropped")
