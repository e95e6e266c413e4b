"""The package's import-time check that ``kernels`` is hmscale's own SSD package; the CPU model without Triton."""

import subprocess
import sys


def test_a_shadowing_kernels_package_stops_import_with_a_clear_error(tmp_path):
    fake = tmp_path / "shadow" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = object\n")  # what the hub's package exports, not ours
    env = {"PYTHONPATH": str(fake.parent), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import hmscale"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'import kernels' finds ") and str(fake / "__init__.py") in last
    assert "pip uninstall kernels" in last


def test_hmscale_finds_its_own_kernels_package(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import hmscale, kernels; print(callable(kernels.ssd))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_the_model_runs_and_decodes_on_a_cpu_without_triton(tmp_path):
    """Where Triton does not install (macOS, some ARM hosts) a saved HedgeMamba still runs on the CPU: forward,
    backward and generation with the recurrent state (the decode step's PyTorch path imports no Triton)."""
    code = """
import sys
sys.modules["triton"] = None  # an import of triton now fails, as where it is not installed
import torch
from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM
torch.manual_seed(0)
cfg = HedgeMambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
m = HedgeMambaForCausalLM(cfg).eval()
ids = torch.randint(1, 97, (2, 9))
m(ids, labels=ids).loss.backward()
out = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
with torch.no_grad():
    full = m(out[:, :-1]).logits[:, -4:].argmax(-1)
assert torch.equal(out[:, 9:], full), (out, full)
print("ok", "triton" in sys.modules and sys.modules["triton"] is None)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "ok True"


def test_the_cli_and_the_config_import_no_torch(tmp_path):
    """`hmscale --help`, `hmscale check` and config errors answer without the ML stack's imports (the config imported
    the teacher package, whose loader imported the models, transformers and torch: ~5 s for `hmscale --help`)."""
    code = ("import sys, hmscale.cli, hmscale.config, hmscale.teacher.flavors; "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'ray') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    r = subprocess.run([sys.executable, "-c", "from hmscale.teacher import load_teacher; print(callable(load_teacher))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "True", r.stderr
