"""``torch.compile`` applied from outside the model code, block by block (torchtitan's habit).

Each transformer / HedgeMamba block (the classes a model lists in ``_no_split_modules``) is compiled in
place with ``nn.Module.compile``; everything else (embeddings, LM head, loss) stays eager. In a
HedgeMamba block the Triton SSD scan is one opaque custom op inside the graph (no graph break), so each block
is one graph forward and one backward: inductor fuses the elementwise work around the scan (the causal conv,
rotary, the Hedgehog feature maps, dt/A, the gate) into a few kernels. With the plain-PyTorch SSD backend
(CPU) the scan runs outside the graphs.

The first steps pay the compilation (tens of seconds per distinct block shape on a GPU). Shapes are
compiled static (``dynamic=False``): a training run feeds one micro-batch shape.

``mode`` is torch.compile's (``parallel.compile_mode``): ``reduce-overhead`` replays each block's forward and
backward graphs as CUDA graphs (torch's CUDA-graph trees). Unlike ``parallel.cuda_graphs`` (one capture around
each whole block, refused under ZeRO-1/2) it runs under DeepSpeed's ZeRO-1/2 optimizers, whose gradient hooks
run outside the graphs: on one H200 the compiled 410m student's step went from 206.9 to 174.0 ms with the same
loss after 9 steps (BENCHMARKS.md, "Student training").

Two rules make it safe in a training loop (stage 2 follows both): mark the start of each forward
(``torch.compiler.cudagraph_mark_step_begin``), and never keep a graph's output past the next replay. Parameter
gradients are such outputs: where they accumulate in ``param.grad`` over micro-batches (no ZeRO, ZeRO-1) the next
backward replay overwrites the stored gradient; :func:`keep_gradients_out_of_graph_pool` copies each incoming
gradient out of the pool first. (ZeRO-2 copies them into its own buckets as they arrive.)
"""

from __future__ import annotations

from torch import nn

__all__ = ["apply_compile", "compile_targets", "keep_gradients_out_of_graph_pool"]


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`apply_compile` compiles: instances of the model's ``_no_split_modules`` classes."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules: nothing to compile block by block")
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_compile(model: nn.Module, *, mode: str | None = None) -> int:
    """Compile every block of ``model`` in place; returns how many were compiled."""
    blocks = compile_targets(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no module of the classes {model._no_split_modules} found")
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
    return len(blocks)


def _copy_out(grad):
    return grad.clone()


def keep_gradients_out_of_graph_pool(model: nn.Module) -> int:
    """Under CUDA-graph replay (``mode="reduce-overhead"``) a parameter's gradient is a graph output living in the
    graphs' memory pool; autograd stores it in ``param.grad`` as it is, and the next micro-batch's replay writes
    over it before it is accumulated into. A hook on each trainable parameter hands autograd a copy instead (one
    extra copy of the gradients per backward). Returns how many parameters got the hook."""
    n = 0
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_copy_out)
            n += 1
    return n
