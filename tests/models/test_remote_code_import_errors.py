"""The remote-code module of an exported HedgeMamba says "needs the hmscale package" only when hmscale is what is
missing. It turned every ImportError into that line, so where hmscale is installed but cannot be imported (Hugging
Face's own ``kernels`` distribution hiding hmscale's SSD kernels, the one-line error ``import hmscale`` gives for it;
or one of hmscale's dependencies missing) the user was told to install what they have."""

import json
import subprocess
import sys

import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM


NOT_INSTALLED = (  # a finder first on the meta path that finds no hmscale, as in an environment without it
    "class _NoHmscale:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'hmscale':\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, _NoHmscale())\n"
)


def _load_error(model_dir, tmp_path, prelude: str, env_path: str | None = None) -> str:
    code = (
        "import sys\n" + prelude +
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, trust_remote_code=True)\n"
        "except ImportError as e:\n"
        "    print('ERROR:', e)\n"
    )
    import os

    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("ERROR:")]
    assert lines, (out.stdout[-1000:], out.stderr[-2000:])
    return lines[0]


def test_the_shim_names_the_real_import_error(tmp_path):
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2)).save_pretrained(model_dir)
    assert "auto_map" in json.loads((model_dir / "config.json").read_text())
    # hmscale absent: the install hint
    err = _load_error(model_dir, tmp_path, NOT_INSTALLED)
    assert "needs the hmscale package" in err
    # hmscale installed, but another 'kernels' package first on the path: import hmscale's own one-line error
    fake = tmp_path / "fake_site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("# another distribution's 'kernels' package\n")
    err = _load_error(model_dir, tmp_path, "", env_path=str(fake.parent))
    assert "needs the hmscale package" not in err
    assert "pip uninstall kernels" in err and str(fake) in err
