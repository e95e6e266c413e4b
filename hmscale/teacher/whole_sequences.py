"""Teacher forwards over whole, unpadded sequences, without a host synchronisation.

Before every forward transformers builds the attention mask (`create_causal_mask`). Given no attention mask it first
looks for packed sequences in the position ids (`find_packed_sequence_indices`), whose result it reads in an `if`:
the host waits there for the GPU, once a forward, and cannot queue the next batch's work (or the device copies of the
last batch's captures) ahead of it. hmscale's teacher forwards (capture for stage 1 and the cache, online KD) run
whole sequences at the default positions, where that check finds nothing and SDPA's own causal path runs.

`whole_sequences(model)` runs the block under an attention implementation registered with transformers that has the
same SDPA function but no mask builder: the mask step then returns no mask without reading a tensor, and each layer
makes the same causal SDPA call (the same logits, bit for bit: tests/teacher/test_whole_sequences.py). Only for
forwards without an attention mask or custom position ids (inside the block neither would be applied); models not on
transformers' "sdpa" implementation run unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

NAME = "hmscale_whole_sequence_sdpa"
_registered = None  # None: not tried; True: NAME registered; False: this transformers has no such check to skip


def _register() -> bool:
    """Registers NAME once; False on a transformers whose `masking_utils` has no packed-sequence check: there is no
    sync to skip, and the mask code of such a version was not checked with a name it does not know."""
    global _registered
    if _registered is None:
        try:
            from transformers import AttentionInterface
            from transformers import masking_utils
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
        except ImportError:
            _registered = False
            return False
        _registered = hasattr(masking_utils, "find_packed_sequence_indices")
        if _registered:
            AttentionInterface.register(NAME, sdpa_attention_forward)
    return _registered


@contextmanager
def whole_sequences(model):
    """Within the block, `model`'s forwards skip transformers' mask builder (see the module docstring)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _register():  # eager, flash, nested, older
        yield model
        return
    config._attn_implementation = NAME
    try:
        yield model
    finally:
        config._attn_implementation = "sdpa"
