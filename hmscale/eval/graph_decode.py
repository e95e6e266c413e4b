"""Decoding HedgeMamba with one CUDA graph per token.

The recurrent state has a fixed size, so a whole decode step (every layer: conv update, feature
maps, `ssd_step`, MLP, LM head) can be captured once and replayed: one launch per token instead of
hundreds. The state lives in static buffers that the captured step updates in place.

    dec = GraphDecoder(model, prompt_ids)       # prefill (chunked kernel) + capture
    logits = dec.step(next_ids)                 # (b, vocab) for the next position
"""

from __future__ import annotations

import torch


@torch.no_grad()
def prefill(model, prompt_ids: torch.Tensor):
    """The prompt through the chunked scan: (the recurrent cache, the logits (b, vocab) for the first new token). Only
    the last position's logits are made (``logits_to_keep=1``): all (b, prompt length, vocab) of them are GBs at long
    contexts, and a view of their last position kept them allocated as long as the decoder lived."""
    out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1, return_dict=True)
    return out.cache, out.logits[:, -1]


class GraphDecoder:
    def __init__(self, model, prompt_ids: torch.Tensor, warmup: int = 2):
        if prompt_ids.device.type != "cuda":
            raise ValueError("GraphDecoder needs CUDA tensors; on CPU use model.generate()")
        self.model = model.eval()
        self.cache, self.next_logits = prefill(model, prompt_ids)
        self.pos = prompt_ids.shape[1]
        b = prompt_ids.shape[0]
        dev = prompt_ids.device
        self.static_ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.static_pos = torch.full((1, 1), self.pos, dtype=torch.long, device=dev)
        # the states the captured step reads and then overwrites in place
        self.conv = [s for s in self.cache.conv_states]
        self.ssm = [s for s in self.cache.ssm_states]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):  # compile/autotune outside the capture, on copies of the state
                saved = ([c.clone() if c is not None else None for c in self.conv], [s.clone() for s in self.ssm])
                self._step_body()
                for dst, src in zip(self.conv + self.ssm, saved[0] + saved[1]):
                    if dst is not None:
                        dst.copy_(src)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.static_logits = self._step_body()

    def _step_body(self) -> torch.Tensor:
        cache = self.cache
        cache.conv_states = list(self.conv)
        cache.ssm_states = list(self.ssm)
        logits = self.model(input_ids=self.static_ids, cache=cache, use_cache=True, position_ids=self.static_pos,
                            return_dict=True).logits
        for dst, src in zip(self.conv + self.ssm, cache.conv_states + cache.ssm_states):
            if dst is not None and src is not dst:
                dst.copy_(src)
        cache.conv_states = list(self.conv)
        cache.ssm_states = list(self.ssm)
        return logits[:, -1]

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (b,) or (b, 1); returns the logits for the following position, a tensor of its own
        (a copy: the graph's output buffer is overwritten by the next step, so kept logits changed under the caller)."""
        self.static_ids.copy_(ids.view(-1, 1))
        self.static_pos.fill_(self.pos)
        self.graph.replay()
        self.pos += 1
        return self.static_logits.clone()

    @torch.no_grad()
    def greedy(self, n: int) -> torch.Tensor:
        """n greedy tokens after the prompt, (b, n)."""
        tok = self.next_logits.argmax(-1)
        if n < 1:
            return tok.new_empty(tok.shape[0], 0)
        out = [tok]
        for _ in range(n - 1):
            tok = self.step(tok).argmax(-1)
            out.append(tok)
        return torch.stack(out, dim=1)
