"""apply_cuda_graphs: which calls take the captured graphs and which run the block's own forward (CPU: the
dispatch logic, with a stand-in for the graphed call), and a clear error off the GPU. The capture itself
needs CUDA: `test_capture_matches_eager` runs on a GPU only."""

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.models.neox_attention import rotary_cos_sin
from hmscale.parallel import apply_cuda_graphs
from hmscale.parallel.cuda_graphs import _BlockCall, _dispatch


def _model():
    torch.manual_seed(0)
    return HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, chunk_size=16))


def test_dispatch_takes_the_graph_only_for_the_captured_case():
    model = _model()
    block = model.backbone.layers[1]
    calls = []
    graph_call = _BlockCall(block)
    stand_in = lambda x, cos, sin: calls.append(1) or graph_call(x, cos, sin)  # noqa: E731
    shape = (2, 16, 32)
    fwd = _dispatch(block, stand_in, block.forward, shape, torch.float32, True)
    rope = rotary_cos_sin(torch.arange(16)[None], model.config.rotary_ndims, model.config.rotary_emb_base)
    x = torch.randn(shape, requires_grad=True)
    model.train()
    y = fwd(x, rope)
    assert calls == [1] and torch.allclose(y, block.forward(x, rope))
    fwd(x.detach(), rope)  # input without grad: not the captured case
    fwd(torch.randn(1, 16, 32, requires_grad=True), rope)  # another batch size
    fwd(x, rope, seq_idx=torch.zeros(2, 16, dtype=torch.int32))  # packed documents
    with torch.no_grad():
        fwd(x, rope)
    model.eval()
    fwd(x, rope)
    assert calls == [1]


def test_cpu_model_is_a_clear_error():
    with pytest.raises(ValueError, match="need the model on a GPU"):
        apply_cuda_graphs(_model(), 2, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_matches_eager():
    """Captured blocks give the eager model's loss and gradients over two steps (fp32, GPU)."""
    eager, graphed = _model().cuda(), _model().cuda()
    for m in (eager, graphed):
        m.get_input_embeddings().weight.requires_grad_(False)
    assert apply_cuda_graphs(graphed, 2, 16) == 2
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        out = []
        for m in (eager, graphed):
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-6)
        for name, g in out[0][1].items():
            torch.testing.assert_close(out[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
