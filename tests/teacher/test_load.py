"""load_teacher: local directories (fp32 / bf16), frozen + eval; clear one-line errors otherwise."""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.teacher import load_teacher
from hmscale.teacher.flavors import neox_config
from hmscale.config import looks_like_path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", 128))
    path = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(path)
    return model, path


def test_load_local_fp32_and_bf16(saved):
    model, path = saved
    t = load_teacher(path)
    assert isinstance(t, GPTNeoXForCausalLM) and not t.training
    assert all(not p.requires_grad for p in t.parameters())
    assert t.dtype == torch.float32
    for (n, a), (_, b) in zip(model.state_dict().items(), t.state_dict().items()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(t(ids).logits, model.eval()(ids).logits)
    tb = load_teacher(str(path), dtype="bfloat16")
    assert tb.dtype == torch.bfloat16 and all(not p.requires_grad for p in tb.parameters())


def test_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_teacher(tmp_path / "missing")
    msg = str(err.value)
    assert "\n" not in msg and "does not exist" in msg and "teacher.name_or_path" in msg
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_teacher(tmp_path)
    with pytest.raises(ValueError, match="teacher.dtype"):
        load_teacher(tmp_path, dtype="int8")


def test_hub_ids_are_not_paths():
    assert not looks_like_path("EleutherAI/pythia-70m")
    assert looks_like_path("./runs/teacher") and looks_like_path("/abs/path") and looks_like_path("a/b/c")


def test_unreachable_hub_id_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as err:
        load_teacher("hmscale-test/not-a-real-model")
    assert "teacher.name_or_path" in str(err.value) and "\n" not in str(err.value)
