"""Vocabulary-parallel LM head losses: two gloo ranks, each holding half of the logits, give the losses and
the (sliced) gradients of the plain full-vocabulary losses: cross-entropy, cached top-k KD and online KD
(fp32 math in both, so fp32 tolerances: the sums are taken in another order)."""

import pytest
import torch

from hmscale.train.stage2 import causal_lm_losses

V, TEACHER_V = 12, 14  # the live teacher may have padding rows past the student's vocabulary


def _case(kind: str):
    g = torch.Generator().manual_seed(0)
    b, l = 2, 9
    logits = torch.randn(b, l, V, generator=g, dtype=torch.float32) * 3
    ids = torch.randint(0, V, (b, l), generator=g)
    batch, teacher, kd, T = {}, None, 0.0, 1.0
    if kind == "topk":
        batch = {"topk_ids": torch.randint(0, V, (b, l, 4), generator=g),
                 "topk_logprobs": torch.log_softmax(torch.randn(b, l, 4, generator=g), -1)}
        kd, T = 0.7, 2.0
    elif kind == "online":
        teacher = torch.randn(b, l, TEACHER_V, generator=g, dtype=torch.float32) * 2
        kd, T = 0.7, 1.5
    return logits, ids, batch, teacher, kd, T


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from hmscale.parallel import build_mesh
    from hmscale.parallel.vocab import VocabShard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        mesh = build_mesh(tp=2)
        n = V // 2
        shard = VocabShard(rank * n, (rank + 1) * n, V, mesh.tp_group, 2)
        res = {}
        for kind in ("ce", "topk", "online"):
            logits, ids, batch, teacher, kd, T = _case(kind)
            local = logits[..., shard.start:shard.end].clone().requires_grad_(True)
            loss, extras = causal_lm_losses(local, ids, batch, kd, T, ce_weight=0.5, teacher_logits=teacher,
                                            vocab_shard=shard)
            loss.backward()
            res[kind] = {"loss": loss.detach(), "ce": extras["ce"], "kd": extras.get("kd"), "grad": local.grad}
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_losses_match_full_vocabulary(tmp_path):
    from hmscale.train.launch import spawn_workers

    spawn_workers(_worker, 2, str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for kind in ("ce", "topk", "online"):
        logits, ids, batch, teacher, kd, T = _case(kind)
        full = logits.clone().requires_grad_(True)
        loss, extras = causal_lm_losses(full, ids, batch, kd, T, ce_weight=0.5, teacher_logits=teacher)
        loss.backward()
        assert kind == "ce" or extras["kd"].abs() > 1e-3  # the KD term is really there
        for r in range(2):
            got = res[r][kind]
            torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-7, msg=f"{kind} rank {r}")
            torch.testing.assert_close(got["ce"], extras["ce"], rtol=1e-5, atol=1e-7)
            if kind != "ce":
                torch.testing.assert_close(got["kd"], extras["kd"], rtol=1e-5, atol=1e-7)
        grad = torch.cat([res[0][kind]["grad"], res[1][kind]["grad"]], dim=-1)
        torch.testing.assert_close(grad, full.grad, rtol=1e-5, atol=1e-8, msg=kind)


def test_labels_with_a_sharded_head_is_a_clear_error():
    from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
    from hmscale.parallel.vocab import VocabShard

    model = HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, chunk_size=8))
    model.vocab_shard = VocabShard(0, 8, 16, None, 2)
    ids = torch.randint(0, 16, (1, 5))
    with pytest.raises(ValueError, match="sharded by vocabulary"):
        model(input_ids=ids, labels=ids)


def test_whole_head_note_only_when_tp_does_not_divide_the_vocabulary():
    from hmscale.parallel import whole_head_note

    assert whole_head_note(50304, 1) is None and whole_head_note(50304, 2) is None and whole_head_note(50304, 8) is None
    note = whole_head_note(50257, 2)  # GPT-2's odd vocabulary
    assert "parallel.tp=2" in note and "50,257" in note and "stays whole" in note
    assert "would shard it" in whole_head_note(100, 3)  # 2, 4, 5 divide 100
    assert "4" in whole_head_note(100, 3).split("tp of ")[1]
