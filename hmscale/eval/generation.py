"""Text generation with a saved model; HedgeMamba decodes with its recurrent state (O(1) per token)."""

from __future__ import annotations

import math
import time

import torch

from hmscale.hf_load import from_pretrained

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: the first GPU when this torch sees one, else the CPU; otherwise a torch device name, checked here
    (one-line ``ValueError``) rather than deep inside the first copy."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):  # (mps, xpu, meta: torch names them, but the model would fail on the copy)
        raise ValueError(f"--device: {device!r} is not a device generate runs on; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r}, but this torch ({torch.__version__}) sees no GPU; use cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device: {device!r}, but this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU, fp32 on the CPU; else one of ``DTYPES``."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model_and_tokenizer(model_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hmscale.models  # noqa: F401  (registers HedgeMamba with the Auto classes)

    model = from_pretrained(AutoModelForCausalLM, model_dir).to(device=device, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token arrives (the prompt comes in the first ``put``):
    the prefill's time apart from the per-token decode rate."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            if torch.cuda.is_available() and value.is_cuda:
                torch.cuda.synchronize(value.device)
            self.first = time.perf_counter()

    def end(self):
        pass


def sampling_kwargs(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> dict:
    """``generate()``'s sampling arguments: greedy at temperature 0; else the softmax at that temperature, whole
    unless ``top_k`` > 0 / ``top_p`` < 1 truncate it (transformers' own default keeps the top 50 tokens)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: {temperature} must be finite and >= 0 (0 = greedy)")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k {top_k} / top_p {top_p}: top_k >= 0 (0 = off), 0 < top_p <= 1 (1 = off)")
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": top_p}


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[str, dict]:
    """The prompt and its continuation, and timings: ``prefill_s`` (the prompt through the chunked scan, to the first
    new token) and ``tokens_per_s`` (each further token, O(1) with the recurrent state). With ``temperature`` > 0 it
    samples from the whole softmax unless ``top_k`` > 0 / ``top_p`` < 1 truncate it (transformers' own default would
    keep the top 50 tokens)."""
    kwargs = dict(sampling_kwargs(temperature, top_k, top_p), max_new_tokens=max_new_tokens)
    device = torch.device(device)
    model, tok = load_model_and_tokenizer(model_dir, device, dtype)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]], device=device)
    torch.manual_seed(seed)
    kwargs["pad_token_id"] = tok.eos_token_id
    timer = _FirstToken()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=timer, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    new = out.shape[1] - ids.shape[1]
    first = timer.first if timer.first is not None else t1
    decode_s = t1 - first
    return prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), {
        "prompt_tokens": int(ids.shape[1]), "new_tokens": new, "prefill_s": first - t0,
        "tokens_per_s": (new - 1) / decode_s if new > 1 and decode_s > 0 else float("nan")}


@torch.no_grad()
def greedy_continuation(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids`` (1, t), each from a full forward of everything so far: works for any
    model whose forward takes ``input_ids`` (teacher, Hedgehog, HedgeMamba alike; the recipe's samples are short)."""
    device = next(model.parameters()).device
    seq = ids.to(device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            logits = model(input_ids=seq, return_dict=True).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    finally:
        model.train(was_training)
    return seq[0, ids.shape[1]:].tolist()


def recipe_samples(models: dict, tokenizer, row, new_tokens: int, seq_len: int) -> dict:
    """The recipe's samples: a held-out row's first tokens as the prompt (a quarter of the row, at most 16) and each
    model's greedy continuation, kept within the training length (at most ``seq_len`` tokens in all)."""
    prompt_len = max(1, min(16, seq_len // 4))
    n = max(0, min(int(new_tokens), seq_len - prompt_len))
    ids = torch.as_tensor(row[:prompt_len]).long()[None]
    text = {name: tokenizer.decode(greedy_continuation(model, ids, n), skip_special_tokens=True)
            for name, model in models.items()}
    return {"prompt": tokenizer.decode(ids[0].tolist(), skip_special_tokens=True), "new_tokens": n,
            "requested_tokens": int(new_tokens), "continuations": text}
