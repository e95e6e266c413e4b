"""Tensor parallelism on unusual configs (two gloo processes on CPU, fp32):
no attention bias, feature maps narrower and wider than the head, every recurrent component off, a sequential
residual with the vocabulary-parallel head, one head per rank; each on plain rows, packed documents (seq_idx) and a
left-padded row. The per-token losses and every gathered gradient equal the unsplit model's (no bug found: kept as a
regression test)."""

import torch
import torch.distributed as dist
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.parallel import apply_tensor_parallel, build_mesh
from hmscale.parallel.vocab import vocab_gather, vocab_logsumexp
from hmscale.train.launch import spawn_workers

VOCAB = 62
VARIANTS = [
    dict(attention_bias=False),
    dict(feature_dim=5),
    dict(feature_dim=11, components=dict(gate=False, conv=False, ssm=False)),
    dict(use_parallel_residual=False, vocab_parallel=True),
    dict(num_attention_heads=2, vocab_parallel=True),
]


def _model(variant):
    v = dict(variant)
    v.pop("vocab_parallel", None)
    components, feature_dim = v.pop("components", None), v.pop("feature_dim", None)
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              max_position_embeddings=64, rotary_pct=0.5)
    kw.update(v)
    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(GPTNeoXConfig(**kw)).eval()
    model = to_hedgemamba(to_hedgehog(teacher, feature_dim=feature_dim), components).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight away from its init (recurrent parts off identity, biases off zero)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for layer in model.backbone.layers:
            if model.config.ssm:
                layer.mixer.A_scale.abs_()
    return model


def _losses(model, vocab_parallel):
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    seq = torch.tensor([[0] * 6 + [1] * 7, [0] * 13], dtype=torch.int32)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    model.zero_grad(set_to_none=True)
    out = []
    for kw in (dict(), dict(seq_idx=seq), dict(attention_mask=mask)):
        z = model(ids, **kw).logits.float()
        if vocab_parallel:
            nll = vocab_logsumexp(z, model.vocab_shard) - vocab_gather(z, ids[..., None], model.vocab_shard)[..., 0]
        else:
            nll = torch.logsumexp(z, -1) - z.gather(-1, ids[..., None])[..., 0]
        nll.mean().backward()
        out.append(nll.detach())
    return torch.stack(out)


def _worker(rank, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = build_mesh(tp=2)
        res = []
        for variant in VARIANTS:
            model = _model(variant)
            vp = variant.get("vocab_parallel", False)
            apply_tensor_parallel(model, mesh, vocab_parallel=vp)
            nll = _losses(model, vp)
            grads = {}
            for name, p in model.named_parameters():
                g, dim = p.grad, getattr(p, "tp_split_dim", None)
                if dim is not None:
                    parts = [torch.empty_like(g) for _ in range(2)]
                    dist.all_gather(parts, g.contiguous(), group=mesh.tp_group)
                    g = torch.cat(parts, dim)
                grads[name] = g
            res.append((nll, grads))
        if rank == 0:
            torch.save(res, out_path)
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1_on_unusual_configs(tmp_path):
    out = tmp_path / "tp2.pt"
    spawn_workers(_worker, 2, str(out))
    res = torch.load(out, weights_only=False)
    for variant, (nll2, grads2) in zip(VARIANTS, res):
        model = _model(variant)
        nll = _losses(model, False)
        torch.testing.assert_close(nll2, nll, rtol=1e-5, atol=1e-5, msg=lambda m: f"{variant}: {m}")
        names = {n for n, _ in model.named_parameters()}
        assert set(grads2) == names, variant
        for name, p in model.named_parameters():
            scale = p.grad.abs().max().clamp_min(1e-12)
            assert float((grads2[name] - p.grad).abs().max() / scale) <= 1e-4, (variant, name)
