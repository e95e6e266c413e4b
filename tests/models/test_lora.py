"""LoRA adapters (hmscale.models.lora): the wrapped layer at init is the layer; the adapter adds s B A; folding it
into the weight gives the same function; apply_lora wraps by name and refuses names that match nothing."""

import pytest
import torch
from torch import nn

from hmscale.models.lora import LoRALinear, apply_lora, merged_state_dict


def _x(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_at_init_the_wrapped_layer_is_the_layer_bit_for_bit():
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    ref = base(_x(3, 5, 24, dtype=torch.float32))
    lora = LoRALinear(base, rank=4, alpha=8.0)
    assert lora.weight is base.weight and lora.bias is base.bias  # shared, not copied
    assert torch.equal(lora(_x(3, 5, 24, dtype=torch.float32)), ref)
    assert lora.lora_A.abs().sum() > 0 and lora.scaling == 2.0


def test_the_adapter_adds_scaled_BA_and_folds_into_the_weight():
    base = nn.Linear(16, 12).double()
    lora = LoRALinear(base, rank=3, alpha=6.0).double()
    with torch.no_grad():
        lora.lora_B.copy_(_x(12, 3, seed=1))
    x = _x(7, 16, seed=2)
    want = x @ (base.weight + 2.0 * lora.lora_B @ lora.lora_A).T + base.bias
    torch.testing.assert_close(lora(x), want, rtol=1e-12, atol=1e-12)
    folded = merged_state_dict(lora, lora.state_dict())["weight"]
    torch.testing.assert_close(x @ folded.T + base.bias, want, rtol=1e-12, atol=1e-12)


def test_gradients_reach_the_adapter_when_the_base_is_frozen():
    base = nn.Linear(8, 8)
    base.requires_grad_(False)
    lora = LoRALinear(base, rank=2, alpha=2.0)
    with torch.no_grad():
        lora.lora_B.normal_()
    lora(_x(4, 8, dtype=torch.float32)).square().sum().backward()
    assert base.weight.grad is None and lora.lora_A.grad.abs().sum() > 0 and lora.lora_B.grad.abs().sum() > 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(6, 18)
        self.out_proj = nn.Linear(18, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.out_proj(torch.tanh(self.in_proj(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        for b in self.layers:
            x = x + b(x)
        return self.head(x)


def test_apply_lora_wraps_by_name_keeps_outputs_and_merges_for_export():
    torch.manual_seed(0)
    net = Net().double()
    x = _x(2, 5, 6, seed=3)
    before = net(x)
    wrapped = apply_lora(net, ["in_proj", "out_proj"], rank=2, alpha=4.0, seed=1)
    assert wrapped == ["layers.0.in_proj", "layers.0.out_proj", "layers.1.in_proj", "layers.1.out_proj"]
    assert isinstance(net.head, nn.Linear) and not isinstance(net.head, LoRALinear)
    assert torch.equal(net(x), before)
    names = {n for n, _ in net.named_parameters()}
    assert "layers.0.in_proj.weight" in names and "layers.1.out_proj.lora_B" in names
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_()
    trained = net(x)
    assert not torch.allclose(trained, before)
    state = merged_state_dict(net, net.state_dict())
    assert not any("lora" in k for k in state)
    plain = Net().double()
    plain.load_state_dict(state)  # strict: exactly the plain model's keys
    torch.testing.assert_close(plain(x), trained, rtol=1e-12, atol=1e-12)


def test_unknown_targets_name_the_choices():
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no linear layer of Net; choose from head, in_proj, out_proj"):
        apply_lora(Net(), ["in_proj", "q_proj"], rank=2, alpha=2.0)
    with pytest.raises(ValueError, match="rank must be positive"):
        LoRALinear(nn.Linear(2, 2), rank=0, alpha=1.0)
