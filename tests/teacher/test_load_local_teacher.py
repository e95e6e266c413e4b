"""teacher.name_or_path pointed at local directories the way a user would: checkpoint formats load exactly, the
students' exact init holds for each teacher variant, and what is not a usable GPT-NeoX teacher is refused in one line
(it loaded as random weights, or as a 20B-parameter model, or distilled eos-only rows, before)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel

from hmscale.models.convert import compare_logits, to_hedgehog, to_hedgemamba
from hmscale.teacher import get_teacher, load_teacher
from hmscale.teacher.fingerprint import teacher_fingerprint

V = 64


def neox(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**base)).eval()
    with torch.no_grad():  # biases and LayerNorms away from their trivial init
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and any(k in msg for k in ("teacher.name_or_path", "tokenizer.name_or_path", "cache.capture"))
    return msg


# ----------------------------------------------------------------------------------------------- refusals


def test_other_architectures_are_refused_before_any_weight_is_allocated(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError) as err:  # loaded as a GPTNeoX with every weight random, silently
        load_teacher(tmp_path / "llama")
    assert "llama" in one_line(err) and "GPT-NeoX" in str(err.value)
    # GPT-2's config.json has none of GPTNeoXConfig's keys: its defaults (GPT-NeoX-20B's shape) were allocated
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(tmp_path / "gpt2")

    def allocate(*a, **k):
        raise AssertionError("GPTNeoXForCausalLM.from_pretrained called on a GPT-2 checkpoint")

    monkeypatch.setattr(GPTNeoXForCausalLM, "from_pretrained", allocate)
    with pytest.raises(ValueError) as err:
        load_teacher(tmp_path / "gpt2")
    assert "gpt2" in one_line(err)


def test_missing_weights_and_mismatched_shapes_are_refused(tmp_path):
    torch.manual_seed(0)
    GPTNeoXModel(neox().config).save_pretrained(tmp_path / "backbone")  # no LM head: it would be random
    with pytest.raises(ValueError) as err:
        load_teacher(tmp_path / "backbone")
    assert "lm_head.weight" in one_line(err)
    neox().save_pretrained(tmp_path / "mismatch")
    cfg = json.loads((tmp_path / "mismatch" / "config.json").read_text())
    cfg["vocab_size"] = 2 * V
    (tmp_path / "mismatch" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:  # was a RuntimeError traceback
        load_teacher(tmp_path / "mismatch")
    assert "config.json" in one_line(err)


def test_scaled_rotary_is_refused(tmp_path):
    """The capture's q, k and both students use the plain rotary: a linear-scaled teacher was silently not matched."""
    neox(rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError) as err:
        load_teacher(tmp_path / "t")
    assert "rope_type='linear'" in one_line(err)


def test_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(FileNotFoundError) as err:
        load_teacher(f)
    assert "is a file" in one_line(err)


def _cfg(path, *extra):
    from hmscale.config import build_config

    return build_config({}, [f"teacher.name_or_path={path}", *extra])


def test_teacher_directory_without_tokenizer_is_refused(tmp_path):
    """tokenizer.name_or_path defaults to the teacher's directory; without tokenizer files there AutoTokenizer gives
    an empty tokenizer, every document became its eos token alone, and the whole recipe ran on that (rc 0)."""
    from hmscale.data.tokenizer import load_tokenizer

    from hmscale.data.tokenizer import TokenizerLoadError

    neox().save_pretrained(tmp_path / "t")
    cfg = _cfg(tmp_path / "t")
    assert cfg.tokenizer.name_or_path == str(tmp_path / "t")
    with pytest.raises(TokenizerLoadError) as err:  # where the tokenizer loads: before any data is prepared
        load_tokenizer(cfg.tokenizer.name_or_path)
    assert "encodes text to no tokens" in one_line(err)


def test_a_teacher_path_under_home_is_found_for_its_tokenizer_and_shape(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hmscale.data.tokenizer import load_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))
    neox().save_pretrained(tmp_path / "models" / "t")
    tok = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(tmp_path / "models" / "t")
    assert len(load_tokenizer("~/models/t")) == 4
    with pytest.raises(ValueError, match="cache.capture.layers"):  # the layer check sees the teacher's config
        _cfg("~/models/t", "cache.capture.layers=[99]")


def test_topk_larger_than_a_local_teachers_vocabulary_is_one_line(tmp_path):
    """config.py checks cache.capture.topk against published Pythias only; a local teacher's failed in the forward."""
    neox().save_pretrained(tmp_path / "t")
    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: [1, 2])
    data = SimpleNamespace(tokenizer=tok, vocab_size=V)
    assert get_teacher(_cfg(tmp_path / "t", f"cache.capture.topk={V}"), data, log=lambda *a: None).config.vocab_size == V
    with pytest.raises(ValueError) as err:
        get_teacher(_cfg(tmp_path / "t", f"cache.capture.topk={V + 1}"), data, log=lambda *a: None)
    assert f"cache.capture.topk<={V}" in one_line(err)


# ----------------------------------------------------------------------------------------------- formats


def _legacy_dir(model, path, dtype, shards=1):
    """A checkpoint as Pythia's on the hub: old config keys (rotary_pct, rotary_emb_base), `embed_out`, the old
    attention buffers, pytorch_model.bin (sharded with an index when shards > 1), saved in `dtype`."""
    path.mkdir()
    sd = {("embed_out.weight" if k == "lm_head.weight" else k): v.to(dtype) for k, v in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        sd[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
    keys = sorted(sd)
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin")
    else:
        weight_map = {}
        for j in range(shards):
            name = f"pytorch_model-{j + 1:05d}-of-{shards:05d}.bin"
            part = keys[j::shards]
            torch.save({k: sd[k] for k in part}, path / name)
            weight_map.update({k: name for k in part})
        (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    c = model.config
    rope = c.rope_parameters
    (path / "config.json").write_text(json.dumps({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "torch_dtype": str(dtype).split(".")[1],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size, "hidden_act": "gelu",
        "rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"],
        "max_position_embeddings": 128, "use_parallel_residual": c.use_parallel_residual, "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "transformers_version": "4.24.0"}))


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "legacy-bin", "legacy-sharded-bin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_checkpoint_formats_load_the_same_weights(tmp_path, fmt, dtype):
    model = neox(rotary_pct=0.5, rotary_emb_base=20000.0)
    ref = neox(rotary_pct=0.5, rotary_emb_base=20000.0)  # the weights rounded to dtype, computing in fp32
    ref.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    path = tmp_path / "t"
    if fmt == "safetensors":
        model.to(dtype).save_pretrained(path)
    elif fmt == "sharded":
        model.to(dtype).save_pretrained(path, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").exists()
    else:
        _legacy_dir(model, path, dtype, shards=1 if fmt == "legacy-bin" else 3)
    t = load_teacher(path)
    assert t.dtype == torch.float32 and t.config.rope_parameters["rope_theta"] == 20000.0
    assert t.config.rope_parameters["partial_rotary_factor"] == 0.5
    for name, w in ref.state_dict().items():
        assert torch.equal(t.state_dict()[name], w), name
    ids = torch.arange(24)[None] % V
    with torch.no_grad():
        assert torch.equal(t(ids).logits, ref(ids).logits)


# ----------------------------------------------------------------------------------------------- exact init


VARIANTS = {
    "pythia": {},
    "serial-residual": dict(use_parallel_residual=False),
    "full-rotary": dict(rotary_pct=1.0),
    "rope-base-5e5": dict(rotary_emb_base=500000.0),
    "odd-rotary-dims": dict(hidden_size=60, num_attention_heads=3, intermediate_size=96),  # head 20: 5 rotary dims
    "five-heads": dict(hidden_size=80, num_attention_heads=5, intermediate_size=100, hidden_act="gelu_new"),
    "no-attention-bias": dict(attention_bias=False),
    "tied": dict(tie_word_embeddings=True),
    "padded-vocab": dict(vocab_size=128),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_init_for_teacher_variants(tmp_path, variant):
    """HedgeMamba at init computes the Hedgehog student (the documented promise), for each teacher as loaded from
    disk; and the capture's recomputed q, k, v give the teacher's own attention output."""
    from hmscale.models.neox_attention import softmax_attention
    from hmscale.teacher.capture import capture_layers

    neox(**VARIANTS[variant]).save_pretrained(tmp_path / "t")
    teacher = load_teacher(tmp_path / "t")
    ids = torch.arange(70)[None] * 5 % V  # longer than one chunk (64)
    for layer in capture_layers(teacher, ids).values():
        torch.testing.assert_close(softmax_attention(layer.q, layer.k, layer.v), layer.attn_output, rtol=1e-5, atol=1e-6)
    student = to_hedgehog(teacher)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for fm in student.feature_maps:
            fm.weight.add_(0.5 * torch.randn(fm.weight.shape, generator=g))
            fm.bias.copy_(0.3 * torch.randn(fm.bias.shape, generator=g))
    model = to_hedgemamba(student).eval()
    assert compare_logits(student, model, ids)["max_rel"] <= 1e-5


# ----------------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_the_weights_not_the_file_layout_nor_the_process(tmp_path):
    model = neox()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    _legacy_dir(model, tmp_path / "legacy", torch.float32, shards=2)
    fps = {name: teacher_fingerprint(load_teacher(tmp_path / name)) for name in ("one", "sharded", "legacy")}
    assert len(set(fps.values())) == 1, fps
    code = ("import sys; from hmscale.teacher import load_teacher; from hmscale.teacher.fingerprint import "
            "teacher_fingerprint; print(teacher_fingerprint(load_teacher(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "one")], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == fps["one"]
    with torch.no_grad():
        model.gpt_neox.layers[1].mlp.dense_4h_to_h.weight[3, 5] += 1e-3
    model.save_pretrained(tmp_path / "changed")
    assert teacher_fingerprint(load_teacher(tmp_path / "changed")) != fps["one"]
    assert teacher_fingerprint(load_teacher(tmp_path / "one", dtype="bfloat16")) != fps["one"]


def test_rows_longer_than_a_loaded_teachers_positions_are_noted(tmp_path):
    """A hub or local teacher distilled on rows past its max_position_embeddings (rotary: it runs) said nothing; the
    students then learn its extrapolation. One note, naming the setting; none within its positions."""
    neox().save_pretrained(tmp_path / "t")  # 128 positions
    data = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens=False: [1, 2]), vocab_size=V)
    for seq_len, noted in ((128, False), (256, True)):
        lines = []
        get_teacher(_cfg(tmp_path / "t", f"data.seq_len={seq_len}"), data, log=lines.append)
        notes = [line for line in lines if "note" in line]
        assert bool(notes) == noted and all("data.seq_len<=128" in n and "\n" not in n for n in notes), lines
