"""Weights moved into one allocation (kiln/llm/models/weight_arena.py): every
movable parameter and buffer ends up in one storage, in module order, with the
same values; parameters keep their identity (tied weights stay tied); views,
storages shared by two tensors and inference-mode tensors stay where they are;
outputs are unchanged."""
import torch
from torch import nn

from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.weight_arena import ALIGN, gather_weights

ARCH = LlamaArch(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
    tie_word_embeddings=True, rope_scaling=None, bos_token_id=1, eos_token_ids=(2,),
)


def storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()] if t.numel()}


def test_a_finished_model_holds_its_weights_in_one_allocation_tied_weights_tied():
    torch.manual_seed(0)
    model = LlamaModel(ARCH, max_positions=128)
    model.finish(torch.device("cpu"), torch.float32, "int4", group_size=32)
    assert model.lm_head is model.embed_tokens
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    assert len(storages(model)) == 1 and len(tensors) > 10
    offsets = [t.data_ptr() - tensors[0].untyped_storage().data_ptr() for t in tensors]
    assert all(o % ALIGN == 0 for o in offsets)
    assert gather_weights(model) == 0  # already moved: each tensor is now a view of the one allocation


def test_values_and_outputs_are_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.rand(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    expected = model(x) * model.scale
    params = list(model.parameters())
    moved = gather_weights(model)
    assert moved == sum((t.numel() * 4 + ALIGN - 1) // ALIGN * ALIGN for t in before.values())
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))  # identity kept
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(x) * model.scale, expected)
    assert len(storages(model)) == 1


def test_views_and_shared_storages_stay_where_they_are():
    base = torch.arange(32.0)
    model = nn.Module()
    model.register_buffer("upper", base[16:])  # a view: does not own its storage
    model.register_buffer("a", torch.ones(4))
    model.register_buffer("b", model.a.view(2, 2))  # shares a's storage
    model.register_buffer("own", torch.zeros(8))
    with torch.inference_mode():
        model.register_buffer("inference", torch.ones(3))  # made under inference mode: cannot be rebound
    ptrs = {n: b.data_ptr() for n, b in model.named_buffers()}
    assert gather_weights(model) == ALIGN  # only `own` (32 bytes, padded)
    assert {n: b.data_ptr() for n, b in model.named_buffers() if n != "own"} == {
        n: p for n, p in ptrs.items() if n != "own"
    }
    assert model.own.data_ptr() != ptrs["own"] and torch.equal(model.own, torch.zeros(8))
    assert gather_weights(nn.Module()) == 0
