"""``save_pretrained(dir, push_to_hub=True)`` uploads what loads with ``trust_remote_code=True``: config.json's
``auto_map`` and the one-line ``modeling_hedgemamba.py``. transformers uploads inside its own ``save_pretrained``, and
both were written after it returned, so the Hub repo had neither: a fresh Python without ``import hmscale.models``
could not load it. The Hub is unreachable here: a fake stands in for it (repo creation, commits into a folder)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import torch
import transformers.modeling_utils as modeling_utils
import transformers.utils.hub as hub
from transformers import GPTNeoXForCausalLM

from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.models.remote_code import AUTO_MAP, MODULE
from hmscale.teacher.flavors import neox_config


class FakeHub:
    """create_repo / create_commit of ``HfApi``, the commit copying each file into ``root`` as it is at commit time."""

    def __init__(self, root):
        self.root = root

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            dst = self.root / op.path_in_repo
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(op.path_or_fileobj, "rb") as f:
                dst.write_bytes(f.read())


def test_save_pretrained_push_to_hub_uploads_the_remote_code(tmp_path, monkeypatch):
    repo = tmp_path / "hub_repo"
    fake = FakeHub(repo)
    monkeypatch.setattr(modeling_utils, "hf_api", lambda: fake)
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    monkeypatch.setattr(modeling_utils, "create_and_tag_model_card",
                        lambda *a, **k: SimpleNamespace(save=lambda path: open(path, "w").close()))
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=97)).eval())).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:  # away from the identity init
            layer.mixer.z_proj.weight.normal_(std=0.1)
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="someone/hedgemamba")
    assert (repo / "model.safetensors").exists()  # the fake hub received the upload
    assert json.loads((repo / "config.json").read_text()).get("auto_map") == AUTO_MAP
    assert (repo / f"{MODULE}.py").read_text() == (tmp_path / "local" / f"{MODULE}.py").read_text()
    # and the uploaded repo loads in a Python that never imported hmscale, computing what the model computes
    ids = torch.arange(1, 30)[None] % 97
    with torch.no_grad():
        want = model(ids).logits
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(repo)!r}, trust_remote_code=True).eval()\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(torch.arange(1, 30)[None] % 97).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, rtol=0, atol=0)
