"""apply_compile: blocks compiled in place give the eager model's loss and gradients."""

import copy

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.parallel import apply_compile
from hmscale.parallel.compile import compile_targets


def _model():
    torch.manual_seed(0)
    cfg = HedgeMambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           chunk_size=16)
    model = HedgeMambaForCausalLM(cfg)
    with torch.no_grad():  # move the recurrent parts off their identity init so every path is exercised
        for name, p in model.named_parameters():
            if any(k in name for k in ("dt_proj", "A_scale", "z_proj", "conv", "feature_map", ".D")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_compile_targets_are_the_blocks():
    model = _model()
    assert [type(m).__name__ for m in compile_targets(model)] == ["HedgeMambaBlock"] * 2
    with pytest.raises(ValueError, match="_no_split_modules"):
        compile_targets(torch.nn.Linear(2, 2))


def _compare_compiled_with_eager():
    eager = _model()
    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled) == 2
    assert all(b._compiled_call_impl is not None for b in compile_targets(compiled))
    assert all(b._compiled_call_impl is None for b in compile_targets(eager))
    ids = torch.randint(0, 97, (2, 40))
    # plain rows (as in training: fused_ops' functions), then packed documents (the conv's document-aware loop)
    for seq_idx in (None, torch.tensor([[0] * 25 + [1] * 15, [0] * 40])):
        losses, grads = [], []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            # the first inputs: every block reuses the first block's graph (nothing layer-specific is
            # guarded on, e.g. layer_idx: a recompile per layer ends in eager past dynamo's limit)
            with torch._dynamo.config.patch(error_on_recompile=seq_idx is None):
                out = m(input_ids=ids, labels=ids, seq_idx=seq_idx)
            out.loss.backward()
            losses.append(out.loss.detach())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_match_eager():
    """Run in a process of its own (tests/forked_python.py): inductor's compile threads make a later fork() of this
    process crash (the 2-process DeepSpeed tests fork)."""
    from tests.forked_python import run_python

    code = f"import runpy; runpy.run_path({__file__!r})['_compare_compiled_with_eager'](); print('compare-ok')"
    proc = run_python(["-c", code])
    assert proc.returncode == 0 and "compare-ok" in proc.stdout, proc.stderr[-3000:]


def _compare_fullgraph_triton_with_eager(device: str = "cpu"):
    """With the Triton backend (on CPU under TRITON_INTERPRET=1; on a GPU the compiled kernels): every block
    compiles as ONE graph (fullgraph=True fails on any graph break: the SSD scan is a custom op inside it),
    with the eager model's loss and gradients (eager: the Triton SSD and glue kernels; compiled: the SSD, conv and
    split + rotary custom ops, inductor's fusion of the rest)."""
    import kernels.conv as kconv
    import kernels.rotary as krot

    calls = {"conv": 0, "rotary": 0}
    for mod, key in ((kconv, "conv"), (krot, "rotary")):  # count the kernels' runs, eager and compiled
        real = mod._forward
        mod._forward = lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1) or _real(*a)
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _model().to(device)
    compiled = copy.deepcopy(eager)
    for block in compile_targets(compiled):
        block.compile(fullgraph=True, dynamic=False)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    losses, grads = [], []
    runs = []
    for m in (eager, compiled):
        before = dict(calls)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        runs.append({k: calls[k] - before[k] for k in calls})
    # the glue ran as the Triton kernels both times (two blocks): as custom ops inside the compiled graphs
    assert runs == [{"conv": 2, "rotary": 2}] * 2, runs
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and any("A_log" in n or "dt_proj" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_triton_scan_compiles_inside_the_block_graph():
    """A process of its own with the Triton backend (see test_compiled_blocks_match_eager): on a GPU the real
    kernels, else TRITON_INTERPRET=1 on CPU tensors (as the suite's processes have it)."""
    import os

    from tests.forked_python import run_python

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ, TRITON_INTERPRET="0" if device == "cuda" else "1", HMSCALE_SSD_BACKEND="triton",
               HMSCALE_COMPILED_GLUE="triton")  # the glue's custom ops too (the default, stated)
    code = (f"import runpy; runpy.run_path({__file__!r})['_compare_fullgraph_triton_with_eager']({device!r}); "
            "print('compare-ok')")
    proc = run_python(["-c", code], env=env)
    assert proc.returncode == 0 and "compare-ok" in proc.stdout, proc.stderr[-3000:]


def _tp2_compiled_worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from hmscale.parallel import apply_tensor_parallel, build_mesh

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        ref, model = _model(), _model()
        apply_tensor_parallel(model, build_mesh(tp=2))
        assert apply_compile(model) == 2
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):  # training steps: wrong tp gradients would show in the later losses
            ids = torch.randint(0, 97, (2, 40), generator=gen)
            pair = []
            for m, opt in zip((ref, model), opts):
                opt.zero_grad()
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
                opt.step()
                pair.append(out.loss.detach())
            losses.append(pair)
        norms = {n: p.grad.norm().item() for n, p in model.named_parameters() if "layernorm" in n and p.grad is not None}
        torch.save({"losses": losses, "norms": norms}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_blocks_compile(tmp_path):
    """tp=2 (its all-reduces inside the blocks) under apply_compile, three SGD steps: the losses of the
    unsharded eager model, and the replicated parameters get the same gradient on both ranks (spawned
    processes)."""
    from hmscale.train.launch import spawn_workers

    spawn_workers(_tp2_compiled_worker, 2, str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in res:
        for ref_loss, tp_loss in r["losses"]:
            torch.testing.assert_close(tp_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert res[0]["norms"] and res[0]["norms"] == pytest.approx(res[1]["norms"], rel=1e-5)
