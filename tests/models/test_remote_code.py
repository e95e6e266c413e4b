"""An exported HedgeMamba loads with trust_remote_code=True in a Python that never imported hmscale."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.models.remote_code import AUTO_MAP, write_remote_code
from hmscale.teacher.flavors import neox_config


def test_remote_code_load_in_a_fresh_interpreter(tmp_path):
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=97)).eval())).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:  # away from the identity init
            layer.mixer.A_scale.add_(0.3)
            layer.mixer.z_proj.weight.normal_(std=0.1)
    first, again = tmp_path / "first", tmp_path / "again"
    model.save_pretrained(first)  # every HedgeMamba save is remote-code loadable
    assert json.loads((first / "config.json").read_text())["auto_map"] == AUTO_MAP
    ids = torch.arange(1, 40)[None] % 97
    with torch.no_grad():
        want = model(ids).logits

    def load_in_a_fresh_python(src, save_to=None):
        code = (
            "import sys, torch\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(src)!r}, trust_remote_code=True).eval()\n"
            "ids = torch.arange(1, 40)[None] % 97\n"
            "with torch.no_grad():\n"
            f"    torch.save(m(ids).logits, {str(src / 'logits.pt')!r})\n"
            + (f"m.save_pretrained({str(save_to)!r})\n" if save_to else "")
            + "print(type(m).__name__)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().endswith("HedgeMambaForCausalLM")
        torch.testing.assert_close(torch.load(src / "logits.pt"), want, rtol=0, atol=0)

    load_in_a_fresh_python(first, save_to=again)  # loaded through remote code, then saved again
    load_in_a_fresh_python(again)
    assert sorted(p.name for p in again.glob("*.py")) == ["modeling_hedgemamba.py"]  # no model sources copied


def test_only_hedgemamba_directories(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="not a HedgeMamba model"):
        write_remote_code(tmp_path)


def test_auto_model_loads_the_backbone_of_a_saved_hedgemamba(tmp_path):
    # AutoModel (embeddings / features) as for transformers' own models: the backbone, the LM head's input as output
    from transformers import AutoModel

    import hmscale.models  # noqa: F401  (registers the Auto classes)

    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=97)).eval())).eval()
    model.save_pretrained(tmp_path)
    backbone = AutoModel.from_pretrained(tmp_path).eval()
    assert type(backbone).__name__ == "HedgeMambaModel"
    ids = torch.arange(1, 40)[None] % 97
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states[-1]
        got = backbone(ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)
