"""Text generation with a saved model; HedgeMamba decodes with its recurrent state (O(1) per token)."""

from __future__ import annotations

import time

import torch


def load_model_and_tokenizer(model_dir: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hmscale.models  # noqa: F401  (registers HedgeMamba with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def generate_text(model_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                  device: str = "cpu") -> tuple[str, dict]:
    model, tok = load_model_and_tokenizer(model_dir, device)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]], device=device)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=tok.eos_token_id)
    if temperature > 0:
        kwargs["temperature"] = temperature
    out = model.generate(input_ids=ids, **kwargs)
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    return prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), {
        "prompt_tokens": int(ids.shape[1]), "new_tokens": new, "tokens_per_s": new / max(dt, 1e-9)}
