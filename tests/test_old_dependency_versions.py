"""Review of 16dfe5b..06785a9 (eval inputs_dir, teacher checks, short-cache note, tp, engine, cli, config): what the
changes left wrong.

* `hmscale.cli.main` catches ``typer.TyperException``, which typer has only since 0.26 (the vendored click): with the
  ``typer>=0.12`` pyproject.toml allowed, a mistyped option raised an AttributeError traceback instead of one line.
* `hmscale check` imported torch (and the training package) for the short-cache note even where no cache.max_tokens
  is set, so it can print none: ~1.5 s instead of ~0.3 s, against what tests/test_package.py promises for it.
* The scaled-rotary refusal read only ``rope_parameters``: a transformers 4 config object (which pyproject.toml
  allows, and rotary_fraction / rope_theta read) keeps the scaling in ``rope_scaling``, and went through.
* `load_teacher` imported ``huggingface_hub.errors.StrictDataclassError`` unconditionally: a huggingface_hub older than
  its strict dataclasses (which transformers 4 may install) made every teacher load an ImportError.
"""

import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_declared_typer_floor_has_the_exception_class_the_cli_catches():
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name == "typer")
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors and min(floors) >= Version("0.26"), req  # typer.TyperException (hmscale.cli.main) came with 0.26


def test_check_without_a_cache_limit_imports_no_torch(tmp_path):
    code = ("import sys; from hmscale.cli import main; rc = main(['check']); "
            "print('imported', sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules), rc, "
            "file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "imported [] 0", r.stderr[-2000:]


def test_a_transformers_4_config_with_rope_scaling_is_refused():
    from hmscale.models.neox_attention import check_default_rope

    # GPTNeoXConfig of transformers 4: rope_scaling, rotary_pct, rotary_emb_base; no rope_parameters
    old = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rotary_pct=0.25, rotary_emb_base=10000)
    with pytest.raises(ValueError, match=r"rope_type='linear'") as err:
        check_default_rope(old, "HedgehogForCausalLM")
    assert "\n" not in str(err.value)
    check_default_rope(SimpleNamespace(rope_scaling=None, rotary_pct=0.25), "HedgehogForCausalLM")  # plain: taken


def test_a_teacher_loads_with_a_huggingface_hub_without_strict_dataclasses(tmp_path, monkeypatch):
    import huggingface_hub.errors
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hmscale.teacher.load import load_teacher

    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)).save_pretrained(tmp_path / "t")
    monkeypatch.delattr(huggingface_hub.errors, "StrictDataclassError")  # (huggingface_hub < 0.32)
    model = load_teacher(tmp_path / "t")
    assert model.config.num_hidden_layers == 1 and not model.training

