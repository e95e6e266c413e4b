"""A researcher's own local Pythia-style checkpoint as teacher: a GPTNeoXForCausalLM saved with ``save_pretrained``
beside a byte-level BPE fast tokenizer with Pythia's special tokens, its vocabulary padded past the tokenizer's length.

Relative paths (``-s teacher.name_or_path=my-pythia -s data.paths=[corpus]``, run from the folder holding them) worked
with ``parallel.engine=local`` but not with the default Ray engine: Ray Train's workers run in another working
directory and rebuilt the config there, so every worker stopped on "data.paths: 'corpus' does not exist" (or loaded the
teacher as a hub id), three times over, after the teacher cache was built."""

from pathlib import Path

import pytest
import torch

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # the quick brown fox\n" * 12 for i in range(40)]


def build_local_pythia(out: Path, vocab: int = 300, pad_to: int = 320, parallel: bool = True, tied: bool = False,
                       dtype=torch.float32, seed: int = 0) -> int:
    """A Pythia-shaped checkpoint folder (model + GPTNeoXTokenizerFast, vocab padded as Pythia's 50304 vs 50277);
    returns the tokenizer's length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = GPTNeoXTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                unk_token="<|endoftext|>")
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=pad_to, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, rotary_pct=0.25,
                        use_parallel_residual=parallel, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    GPTNeoXForCausalLM(cfg).to(dtype).save_pretrained(out)
    fast.save_pretrained(out)
    assert len(fast) < pad_to
    return len(fast)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_teacher")
    build_local_pythia(root / "my-pythia")
    (root / "corpus").mkdir()
    for i, d in enumerate(DOCS):
        (root / "corpus" / f"doc{i:02d}.txt").write_text(d)
    return root


def test_ray_workers_get_the_relative_inputs_the_driver_resolved(workdir, tmp_path, monkeypatch):
    from hmscale.config import build_config
    from hmscale.data import prepare_data
    from hmscale.teacher import get_teacher
    from ray_jobs import distill

    monkeypatch.chdir(workdir)
    cfg = build_config({}, ["teacher.name_or_path=my-pythia", "data.source=files", "data.paths=[corpus]",
                            f"data.cache_dir={tmp_path}/dc", f"cache.root={tmp_path}/tc", f"output_dir={tmp_path}/run",
                            "data.seq_len=32", "data.sequences_per_shard=4", "budget.total_tokens=256",
                            "parallel.engine=ray"])
    seen = {}

    def fake_ray(cfg_, config, run_dir, **_):
        # what train_func does first in a Ray Train worker, whose working directory is not the driver's
        monkeypatch.chdir(tmp_path)
        wcfg = build_config(config["cfg"])
        data = prepare_data(wcfg, log=lambda *a, **k: None)
        seen["vocab"] = get_teacher(wcfg, data, log=lambda *a, **k: None).config.vocab_size
        return {}

    monkeypatch.setattr(distill, "_run_ray", fake_ray)
    distill.run_distill(cfg, prepared={"cache_dir": None}, log=lambda *a, **k: None)
    assert seen["vocab"] == 320
    # the run's identity keeps the paths as given (a rerun from the same folder is the same run)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "- corpus\n" in saved and "name_or_path: my-pythia\n" in saved


def test_absolute_inputs_leave_hub_ids_and_globs_as_they_are(workdir, monkeypatch):
    from hmscale.config import build_config

    monkeypatch.chdir(workdir)
    hub = build_config({}, ["teacher.name_or_path=EleutherAI/pythia-70m", "data.source=files",
                            "data.paths=[corpus/doc0*.txt]"]).with_absolute_inputs()
    assert hub.teacher.name_or_path == hub.tokenizer.name_or_path == "EleutherAI/pythia-70m"
    assert hub.data.paths == [str(workdir / "corpus" / "doc0*.txt")]
    local = build_config({}, ["teacher.name_or_path=./my-pythia", "data.source=files",
                              "data.paths=[corpus]"]).with_absolute_inputs()
    assert local.teacher.name_or_path == local.tokenizer.name_or_path == str(workdir / "my-pythia")
