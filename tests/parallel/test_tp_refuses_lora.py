"""``apply_tensor_parallel`` on a model whose linear layers carry LoRA adapters (``hmscale.models.lora``).

Found on the walk: the sharding rebuilt each layer from its ``weight`` and ``bias`` alone, so a ``LoRALinear``
became a plain column/row-parallel linear and its ``lora_A`` / ``lora_B`` were dropped without a word (4 adapter
tensors before, 0 after): whatever they had trained was gone, and the model no longer computed what it did. The
config refuses ``stage2.lora_rank`` with ``parallel.tp > 1``; the library function now refuses too, in one line,
before it changes anything.
"""

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.models.lora import apply_lora
from hmscale.parallel import ParallelMesh, apply_tensor_parallel


def _model():
    torch.manual_seed(0)
    return HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=2,
                                                  num_attention_heads=4, chunk_size=8))


def _mesh():  # building the shards needs no collective: a tp=2 mesh without groups
    return ParallelMesh(world_size=2, rank=0, tp_size=2, dp_size=1, tp_rank=0, dp_rank=0)


@pytest.mark.parametrize("targets", [["in_proj", "out_proj"], ["dense_4h_to_h"], ["lm_head"]])
def test_tensor_parallel_refuses_lora_layers_and_leaves_the_model_whole(targets):
    model = _model()
    apply_lora(model, targets, 2, 4.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="LoRA") as err:
        apply_tensor_parallel(model, _mesh(), vocab_parallel="lm_head" in targets)
    assert "\n" not in str(err.value)
    after = dict(model.named_parameters())
    assert set(after) == set(before)  # no adapter dropped, no layer half-sharded
    assert all(torch.equal(after[n], t) for n, t in before.items())
    assert all(layer.mixer.n_heads == 4 for layer in model.backbone.layers)


def test_tensor_parallel_without_lora_still_shards():
    model = _model()
    apply_tensor_parallel(model, _mesh(), vocab_parallel=True)
    assert all(layer.mixer.n_heads == 2 for layer in model.backbone.layers)
    assert model.vocab_shard.size == 10


def test_sharding_twice_still_says_already_sharded():
    model = _model()
    apply_tensor_parallel(model, _mesh())
    with pytest.raises(ValueError, match="already sharded"):
        apply_tensor_parallel(model, _mesh())
