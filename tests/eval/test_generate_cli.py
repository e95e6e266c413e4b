"""`hmscale generate`: a saved HedgeMamba continues a prompt (from the command line or a file) with its recurrent
cache, greedily: the text is what step-by-step argmax over full forwards gives."""

import torch
from transformers import GPTNeoXForCausalLM

from hmscale.cli import main
from hmscale.data.tokenizer import train_bpe
from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.teacher.flavors import neox_config


def _saved(tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i} + state_space_{i % 7}\n" for i in range(300)]
    tok = train_bpe(docs, 300)
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval())).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:  # away from the identity init: the state matters
            layer.mixer.A_scale.add_(0.3)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return model, tok


def test_generate_continues_a_prompt_greedily(tmp_path, capsys):
    model, tok = _saved(tmp_path)
    prompt = "def f12(x):\n    return"
    assert main(["generate", str(tmp_path / "m"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert out.rstrip("\n") == prompt + tok.decode(ids[0, n_prompt:], skip_special_tokens=True)
    assert f"[{n_prompt} prompt tokens in " in err and "s, 6 new tokens, " in err and "tokens/s after the first; cpu, float32]" in err

    (tmp_path / "prompt.txt").write_text(prompt)
    assert main(["generate", str(tmp_path / "m"), "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == out
    assert main(["generate", str(tmp_path / "m"), "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompt-file: cannot read" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "m"), "--prompt", "x", "--prompt-file", str(tmp_path / "prompt.txt")]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_generate_device_and_dtype(tmp_path, capsys):
    """--dtype picks the weights' dtype (bf16 greedy text matches a bf16 model's own argmax steps); a device this torch
    does not have, or an unknown dtype, is one line before the model loads."""
    model, tok = _saved(tmp_path)
    prompt = "def f3(x):"
    assert main(["generate", str(tmp_path / "m"), "--prompt", prompt, "--max-new-tokens", "4", "--dtype", "bf16",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    n_prompt = ids.shape[1]
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.rstrip("\n") == prompt + tok.decode(ids[0, n_prompt:], skip_special_tokens=True)
    assert err.strip().endswith("; cpu, bfloat16]")
    assert main(["generate", str(tmp_path / "m"), "--dtype", "int8"]) == 2
    assert "--dtype: 'int8' is not one of auto, fp32, bf16, fp16" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "m"), "--device", "nonsense"]) == 2
    assert "--device: 'nonsense' is not a device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", str(tmp_path / "m"), "--device", "cuda"]) == 2
        assert "sees no GPU; use cpu or auto" in capsys.readouterr().err
