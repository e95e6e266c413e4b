"""Quick pretraining of a Pythia-shaped miniature teacher (demo and tests: no hub access needed).

AdamW with linear warmup and a cosine decay whose progress is the larger of step/steps and
elapsed/seconds, so the schedule completes whichever budget runs out first. Reports the
validation perplexity next to a unigram model's on the same targets (the bar it must clear).
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from hmscale.eval.perplexity import perplexity, unigram_perplexity
from hmscale.teacher.flavors import get_flavor, neox_config


def lr_at(step: int, progress: float, lr: float, warmup: int, min_ratio: float = 0.1, warmup_frac: float = 0.05) -> float:
    """Linear warmup (ends after `warmup` steps or `warmup_frac` of the budget, whichever first), then cosine."""
    progress = min(max(progress, 0.0), 1.0)
    ramp = max((step + 1) / max(warmup, 1), progress / warmup_frac)
    if ramp < 1:
        return lr * ramp
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain_teacher(flavor, vocab_size: int, train_tokens: np.ndarray, *, steps: int = 300, seconds: float = 90.0,
                     lr: float = 3e-3, batch_size: int = 16, seed: int = 0, val_tokens: np.ndarray | None = None,
                     log=print, warmup: int | None = None, weight_decay: float = 0.1, grad_clip: float = 1.0,
                     eval_rows: int = 128, device: str = "cpu"):
    """Pretrain a fresh miniature GPTNeoXForCausalLM on rows of train_tokens (int32 [n, L]).

    Stops at `steps` optimizer steps or after `seconds` of training, whichever comes first.
    Returns (model in eval mode, stats dict with steps, seconds, tokens, losses and, with val_tokens,
    val_ppl and unigram_ppl measured on the same first `eval_rows` validation rows).
    """
    from transformers import GPTNeoXForCausalLM

    f = get_flavor(flavor) if isinstance(flavor, str) else flavor
    train_tokens = np.asarray(train_tokens) if not isinstance(train_tokens, np.ndarray) else train_tokens
    n, seq_len = train_tokens.shape
    if seq_len > f.max_positions:
        raise ValueError(f"data.seq_len: {seq_len} exceeds the {f.name} teacher's {f.max_positions} positions")
    if int(np.max(train_tokens[: min(n, 256)])) >= vocab_size:
        raise ValueError(f"token ids exceed vocab_size={vocab_size}")
    torch.manual_seed(seed)
    config = neox_config(f, vocab_size)
    model = GPTNeoXForCausalLM(config).to(device)
    model.train()
    # on CUDA: bf16 autocast (fp32 master weights); on CPU: plain fp32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else contextlib.nullcontext()
    decay = [p for name, p in model.named_parameters() if p.ndim >= 2 and "embed" not in name]
    no_decay = [p for name, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in name)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = warmup if warmup is not None else max(1, min(20, steps // 10))
    rng = np.random.default_rng(seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[teacher] pretraining {f.name} ({n_params / 1e6:.2f} M params, vocab {vocab_size}) on {n} rows x {seq_len}: "
        f"up to {steps} steps / {seconds:.0f} s, batch {batch_size}, lr {lr:g}")
    t0 = time.perf_counter()
    losses: list[float] = []
    step = 0
    next_report = 10.0
    while step < steps:
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
        cur_lr = lr_at(step, max(step / steps, elapsed / seconds), lr, warmup)
        for group in opt.param_groups:
            group["lr"] = cur_lr
        rows = np.sort(rng.integers(0, n, size=batch_size))
        ids = torch.as_tensor(np.asarray(train_tokens[rows]), dtype=torch.long).to(device, non_blocking=True)
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.detach())
        step += 1
        if time.perf_counter() - t0 >= next_report:
            losses = [float(x) for x in losses]
            log(f"[teacher]   step {step}  loss {np.mean(losses[-10:]):.3f}  lr {cur_lr:.2e}  "
                f"{time.perf_counter() - t0:.0f} s")
            next_report += 15.0
    losses = [float(x) for x in losses]
    train_seconds = time.perf_counter() - t0
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    stats = {
        "flavor": f.name, "params": n_params, "vocab_size": vocab_size, "seq_len": seq_len, "steps": step,
        "seconds": round(train_seconds, 2), "tokens": step * batch_size * seq_len,
        "tokens_per_s": round(step * batch_size * seq_len / max(train_seconds, 1e-9), 1),
        "first_loss": losses[0] if losses else None, "final_loss": float(np.mean(losses[-10:])) if losses else None,
    }
    if val_tokens is not None and len(val_tokens):
        t1 = time.perf_counter()
        rows = np.asarray(val_tokens[:eval_rows])
        stats["val_rows"] = len(rows)
        stats["val_ppl"] = perplexity(model, rows, batch_size=max(batch_size, 16))
        stats["unigram_ppl"] = unigram_perplexity(train_tokens, rows, vocab_size)
        stats["eval_seconds"] = round(time.perf_counter() - t1, 2)
        log(f"[teacher] {f.name}: {step} steps in {train_seconds:.1f} s; validation perplexity {stats['val_ppl']:.2f} "
            f"vs unigram {stats['unigram_ppl']:.2f} (ratio {stats['val_ppl'] / stats['unigram_ppl']:.2f})")
    else:
        final = f"final loss {stats['final_loss']:.3f}" if losses else "no step made (untrained)"
        log(f"[teacher] {f.name}: {step} steps in {train_seconds:.1f} s; {final}")
    return model, stats
