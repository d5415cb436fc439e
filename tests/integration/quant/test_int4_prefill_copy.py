"""`--int4-prefill-weights` on the default model in bf16: with `bf16` the kept
Q4_1 projections multiply a prompt of 128+ tokens through their bf16 copy (in
lane layout, or oneDNN-packed where the CPU has AMX; the engine reports the
copy's bytes), with `int4` through the codes only; both answer the question
the prompt asks."""
import pytest

from kiln import SamplingParams
from kiln.llm.engine.loop import memory_bytes
from kiln.llm.kernels import ops
from kiln.llm.kernels.tuning import INT4_LANES_PACKED_MIN_ROWS
from kiln.llm.quant import int4_lanes
from kiln.llm.quant.int4_lanes import Int4LaneLinear

pytestmark = pytest.mark.skipif(
    not ops.bf16_dot_products(), reason="int4 lane layout needs bf16 dot products (AVX512_BF16)"
)

FACTS = (
    "Here are some facts about Europe. France has its capital in Paris and its longest river is the Loire. "
    "Italy has its capital in Rome and is shaped like a boot. Spain has its capital in Madrid and borders "
    "Portugal. Austria has its capital in Vienna and is known for music. Poland has its capital in Warsaw. "
    "The Netherlands has its capital in Amsterdam and many canals. Belgium has its capital in Brussels. "
)
CHAT = [{"role": "user", "content": FACTS * 2 + "Question: what is the capital of Germany?"}]


@pytest.fixture
def packed_calls(monkeypatch):
    """Row counts of every multiply through an int4 projection's copy (a module's
    call: a oneDNN-packed copy always, one in lane layout from 16 rows)."""
    rows = []
    real_packed, real_lanes = int4_lanes.linear_packed, int4_lanes.linear_w4l_bf16

    def spy_packed(x, packed):
        rows.append(x.shape[0])
        return real_packed(x, packed)

    def spy_lanes(x, lanes, params, group_size, copy=None):
        if copy is not None and x.shape[0] >= 16:  # kLaneCopyMinRows, linear_w4l_bf16.cpp
            rows.append(x.shape[0])
        return real_lanes(x, lanes, params, group_size, copy)

    monkeypatch.setattr(int4_lanes, "linear_packed", spy_packed)
    monkeypatch.setattr(int4_lanes, "linear_w4l_bf16", spy_lanes)
    return rows


@pytest.mark.parametrize("choice", ["bf16", "int4"])
def test_a_long_prompt_takes_the_copy_only_when_kept(make_smollm2_engine, smollm2_tokenizer, packed_calls, choice):
    llm = make_smollm2_engine(dtype="bfloat16", int4_prefill_weights=choice, num_blocks=64)
    model = llm.engine.core.runner.model
    lanes = [m for m in model.modules() if isinstance(m, Int4LaneLinear)]
    assert len(lanes) == 120  # 30 layers x (qkv, o, gate_up, down)
    copies = sum(2 * m.in_features * m.out_features for m in lanes)
    packed = memory_bytes(llm.engine.core.runner)["packed_bytes"]
    head = model.lm_head_packed.numel() * model.lm_head_packed.element_size()
    assert packed - head >= copies if choice == "bf16" else packed == head

    ids = smollm2_tokenizer.apply_chat_template(CHAT)
    assert len(ids) >= INT4_LANES_PACKED_MIN_ROWS
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert "Berlin" in out.text, out.text
    if choice == "bf16":  # the prompt's step through the copies, the (one-row) decode steps not
        assert packed_calls and set(packed_calls) == {len(ids)} and len(packed_calls) == 120
    else:
        assert packed_calls == []
