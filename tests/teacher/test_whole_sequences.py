"""`whole_sequences`: the teacher's forward skips transformers' mask builder (no packed-sequence check, hence no
host synchronisation on a GPU) and gives the same logits and captures, bit for bit."""

import pytest
import torch
import transformers.masking_utils as masking_utils
from transformers import GPTNeoXForCausalLM

from hmscale.teacher.capture import capture_layers
from hmscale.teacher.flavors import neox_config
from hmscale.teacher.whole_sequences import NAME, whole_sequences


def make_teacher(device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = neox_config("pythia-nano", 97, num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                      intermediate_size=128)
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(device=device, dtype=dtype)


@pytest.fixture
def packed_check_calls(monkeypatch):
    """Counts transformers' packed-sequence checks (the call that reads a device tensor in an `if`)."""
    calls = []
    real = masking_utils.find_packed_sequence_indices

    def counted(position_ids):
        calls.append(position_ids.shape)
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


def test_same_logits_without_the_packed_check(packed_check_calls):
    model = make_teacher()
    ids = torch.randint(0, 97, (2, 29))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        assert len(packed_check_calls) == 1  # the default path checks (what the block removes)
        with whole_sequences(model):
            assert model.config._attn_implementation == NAME
            fast = model(input_ids=ids, use_cache=False).logits
    assert len(packed_check_calls) == 1
    assert torch.equal(fast, plain)
    assert model.config._attn_implementation == "sdpa"


def test_capture_uses_it_and_matches(packed_check_calls):
    model = make_teacher()
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        caps = capture_layers(model, ids, layers=[0, 2], qkv=False)
        assert packed_check_calls == []
        with whole_sequences(model):  # nested blocks are fine (the inner one changes nothing)
            again = capture_layers(model, ids, layers=[0, 2], qkv=False)
        model.config._attn_implementation = "eager"  # what the block leaves alone; the reference here
        try:
            ref = capture_layers(model, ids, layers=[0, 2], qkv=False)
        finally:
            model.config._attn_implementation = "sdpa"
    for i in (0, 2):
        assert torch.equal(caps[i].attn_input, again[i].attn_input)
        assert torch.equal(caps[i].attn_output, again[i].attn_output)
        rel = (caps[i].attn_output - ref[i].attn_output).norm() / ref[i].attn_output.norm()
        assert rel <= 1e-5  # SDPA against eager softmax attention, fp32


def test_custom_positions_keep_the_mask_builder(packed_check_calls):
    """Position ids given to capture (packed documents) go through transformers' own check, as before."""
    model = make_teacher()
    ids = torch.randint(0, 97, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        caps = capture_layers(model, ids, layers=[1], positions=positions, qkv=False)
    assert len(packed_check_calls) == 1
    assert caps[1].attn_output.shape == (1, 12, 4, 16)


def test_restored_after_an_error_and_other_implementations_untouched():
    model = make_teacher()
    with pytest.raises(RuntimeError, match="boom"):
        with whole_sequences(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with whole_sequences(model):
        assert model.config._attn_implementation == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_capture_makes_no_host_sync():
    model = make_teacher("cuda", torch.bfloat16)
    ids = torch.randint(0, 97, (4, 256), device="cuda")
    with torch.no_grad():
        capture_layers(model, ids, layers=[1], qkv=False)  # warm-up (first calls may set things up)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            caps = capture_layers(model, ids, layers=[1], qkv=False)
            with whole_sequences(model):
                logits = model(input_ids=ids, use_cache=False).logits
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(caps[1].attn_output.float()).all() and torch.isfinite(logits.float()).all()
