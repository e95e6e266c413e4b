"""The teacher-forward worker: one shard id in, one verified shard file out.

Used as-is by the local engine and wrapped in a Ray actor by `ray_jobs.cache_teacher`.
The teacher runs frozen under `torch.no_grad`; encoding and writing of batch i run on a
background thread while the teacher computes batch i+1.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hmscale.teacher.cache.format import (
    CaptureSpec,
    ShardInfo,
    TeacherShape,
    check_sample_key,
    encode,
    layer_field,
    positions_for,
    shard_name,
)
from hmscale.teacher.cache.writer import ShardWriter

FAULT_ENV = "HMSCALE_CACHE_FAULT"  # "SHARD:MARKER": die (os._exit) mid-way through SHARD once (tests)


def default_capture_fn():
    """`hmscale.teacher.capture.capture_layers` (the teacher owner's hooks)."""
    from hmscale.teacher.capture import capture_layers

    return capture_layers


def _default_capture(teacher, input_ids, layers=None):
    return default_capture_fn()(teacher, input_ids, layers=layers, qkv=False)


def _fault_point(shard_id: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    sid, marker = spec.split(":", 1)
    if int(sid) == shard_id and not os.path.exists(marker):
        Path(marker).write_text(f"killed pid {os.getpid()} mid-way through shard {shard_id}\n")
        os._exit(17)


class ShardWorker:
    def __init__(self, teacher, plan, spec: CaptureSpec, cache_dir, *, batch_size: int = 8, device=None, capture_fn=None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.teacher = teacher.to(self.device).eval().requires_grad_(False)
        self.plan = plan
        self.spec = spec
        self.shape = TeacherShape.of(self.teacher)
        self.cache_dir = Path(cache_dir)
        self.batch_size = int(batch_size)
        self.capture_fn = capture_fn or _default_capture
        self.forwards = 0  # teacher forwards run (tests assert a cached rerun runs none)

    # ------------------------------------------------------------------ one batch on the device

    @torch.no_grad()
    def forward_batch(self, tokens: np.ndarray) -> dict:
        """Device tensors per field for a batch (b, L): per-layer captures (stored dtype cast) and top-k."""
        ids = torch.from_numpy(np.ascontiguousarray(tokens)).long().to(self.device)
        layers = list(self.spec.layers) if self.spec.tensors else []
        logits = None
        if self.spec.topk and self.capture_fn is _default_capture:
            # one full forward with the hooks on: the layer captures and the logits together
            from hmscale.teacher.capture import capture_hooks

            with capture_hooks(self.teacher, layers, qkv=False) as cap:
                logits = self.teacher(input_ids=ids, use_cache=False).logits
            caps = cap.results
        else:
            caps = self.capture_fn(self.teacher, ids, layers=layers) if layers else {}
            if self.spec.topk:
                logits = self.teacher(input_ids=ids, use_cache=False).logits
        self.forwards += 1
        out = {}
        for i in layers:
            cap = caps[i]
            for t in self.spec.tensors:
                x = getattr(cap, t)
                if t == "attn_output" and x.dim() == 3:  # (b, l, h*p) -> (b, l, h, p)
                    x = x.reshape(*x.shape[:2], self.shape.n_heads, self.shape.head_dim)
                out[layer_field(i, t)] = x
        if self.spec.topk:
            logp = torch.log_softmax(logits.float(), dim=-1)
            vals, idx = logp.topk(self.spec.topk, dim=-1)
            out["topk_logprobs"], out["topk_indices"] = vals, idx
        return out

    def encode_batch(self, keys, tokens, seq_idx, dev: dict) -> list[tuple[str, dict]]:
        """Device tensors -> per-sample numpy arrays in the stored layout (runs on the writer thread)."""
        spec, L = self.spec, tokens.shape[1]
        pos = [positions_for(spec, k, L) for k in keys]
        enc = {}
        for name, x in dev.items():
            if name == "topk_logprobs":
                arr, _ = encode(x, spec.topk_dtype)
                enc[name] = (arr, None)
            elif name == "topk_indices":
                dt = np.uint16 if self.shape.vocab_size <= 65536 else np.int32
                enc[name] = (x.cpu().numpy().astype(dt), None)
            else:
                if name.endswith("attn_output") and pos[0] is not None:
                    x = torch.stack([x[j, torch.from_numpy(p).long().to(x.device)] for j, p in enumerate(pos)])
                enc[name] = encode(x, spec.dtype)
        samples = []
        for j, key in enumerate(keys):
            arrays = {"tokens": np.ascontiguousarray(tokens[j], dtype=np.int32),
                      "seq_idx": np.ascontiguousarray(seq_idx[j], dtype=np.int32)}
            if pos[j] is not None:
                arrays["positions"] = pos[j]
            for name, (arr, scale) in enc.items():
                arrays[name] = arr[j]
                if scale is not None:
                    arrays[name + "_scale"] = scale[j]
            samples.append((key, arrays))
        return samples

    # ------------------------------------------------------------------ one shard

    def run_shard(self, shard_id: int) -> ShardInfo:
        t0 = time.perf_counter()
        shard = self.plan.shard(shard_id)
        keys = [check_sample_key(k) for k in shard["keys"]]
        tokens, seq_idx = shard["tokens"], shard["seq_idx"]
        writer = ShardWriter(self.cache_dir / shard_name(shard_id), shard_id)
        pool = ThreadPoolExecutor(max_workers=1)
        pending = None
        try:
            for b0 in range(0, len(keys), self.batch_size):
                sl = slice(b0, b0 + self.batch_size)
                dev = self.forward_batch(tokens[sl])
                if pending is not None:
                    pending.result()
                    if b0 >= len(keys) // 2:
                        _fault_point(shard_id)
                pending = pool.submit(self._write, writer, keys[sl], tokens[sl], seq_idx[sl], dev)
            if pending is not None:
                pending.result()
            _fault_point(shard_id)
            info = writer.commit()
        except BaseException:
            writer.abort()
            raise
        finally:
            pool.shutdown(wait=True)
        info.seconds = time.perf_counter() - t0
        return info

    def _write(self, writer, keys, tokens, seq_idx, dev):
        for key, arrays in self.encode_batch(keys, tokens, seq_idx, dev):
            writer.add_sample(key, arrays)
