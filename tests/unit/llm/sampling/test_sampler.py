import math

import pytest
import torch

from kiln.errors import InvalidRequestError
from kiln.llm.request import Request
from kiln.llm.sampling.penalties import apply_penalties, apply_top_k_top_p_min_p
from kiln.llm.sampling.sampler import Sampler, folded_seed, row_argmax
from kiln.llm.sampling_params import SamplingParams

V = 32


def req(rid="r", prompt=(1, 2, 3), out=(), **kw):
    r = Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=(0,))
    r.output_token_ids = list(out)
    return r


def logits(n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def test_greedy_is_argmax():
    lg = logits(4)
    toks = Sampler()(lg, [req(str(i), temperature=0) for i in range(4)])
    assert [t.token_id for t in toks] == lg.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_row_argmax_is_argmax_with_ties_nan_and_inf(dtype):
    """Greedy tokens come from `max` (faster over bf16 rows than `argmax`): the
    same first index among equal maxima, NaN taken as the maximum, a row of
    -inf giving 0, at a real vocabulary's width."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (9, 49152), generator=g).to(dtype)  # thousands of ties per row
    x[2, [40000, 7, 123]] = float("nan")
    x[5] = float("-inf")
    x[6, 49151] = float("inf")
    assert row_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert row_argmax(x)[[2, 5, 6]].tolist() == [7, 0, 49151]


def test_bf16_logits_sample_as_their_float32_copy():
    """The runner hands a bf16 model's logits over in bf16 (LlamaModel.head_logits):
    greedy rows (ties included: bf16 makes many) pick the token the float32 copy
    gives, and processed rows (penalties, logprobs, seeded sampling) compute on
    that copy."""
    lg = logits(6).bfloat16()
    lg[1, 7] = lg[1, 3] = lg[1].max()  # a tie: the first index wins in both
    plain = [req(str(i), temperature=0) for i in range(6)]
    assert [t.token_id for t in Sampler()(lg, plain)] == [t.token_id for t in Sampler()(lg.float(), plain)]
    processed = [req("a", temperature=0, logprobs=2), req("b", temperature=0.7, seed=3),
                 req("c", temperature=0, repetition_penalty=1.3, out=(5, 6))]
    ours, ref = Sampler()(lg[:3], processed), Sampler()(lg[:3].float(), processed)
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in ours] == [
        (t.token_id, t.logprob, t.top_logprobs) for t in ref]


def test_seeded_request_is_reproducible_whatever_the_batch():
    def draws(batch_size, sampler_seed):
        s = Sampler(seed=sampler_seed)
        out = []
        for step in range(20):
            lg = logits(batch_size, seed=step)
            lg[batch_size - 1] = logits(1, seed=step)[0]  # our request's row
            reqs = [req(f"other{i}", temperature=1.0) for i in range(batch_size - 1)]
            reqs.append(req("me", temperature=0.8, seed=1234))
            out.append(s(lg, reqs)[-1].token_id)
        return out

    alone = draws(1, 0)
    assert draws(5, 99) == alone
    assert draws(3, 7) == alone
    assert len(set(alone)) > 1  # it really samples


def test_seeds_that_differ_above_32_bits_draw_differently():
    # torch's CPU generator keeps a seed's low 32 bits: these four drew the same tokens.
    seeds = (1, 2**32 + 1, 2**63 + 1, 2**40 + 1)
    assert len({folded_seed(s) for s in seeds}) == 4 and folded_seed(7) == 7
    assert folded_seed(-(2**63) + 1) == folded_seed(2**63 + 1)  # one 64-bit value, signed or not
    lg = logits(1).repeat(64, 1) / 4  # a flat distribution: different generators disagree somewhere
    draws = [tuple(t.token_id for t in Sampler()(lg, [req(str(i), seed=s) for i in range(64)])) for s in seeds]
    assert len(set(draws)) == 4


def test_unseeded_requests_differ_between_rows():
    lg = torch.zeros(64, V)
    toks = Sampler()(lg, [req(str(i), temperature=1.0) for i in range(64)])
    assert len({t.token_id for t in toks}) > 10


def test_sampling_matches_softmax_distribution():
    # Chi-square goodness of fit at a fixed seed; critical value for
    # df=7 at alpha=0.001 is 24.32.
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    lg = torch.full((1, V), float("-inf"))
    lg[0, :8] = base
    expected = torch.softmax(base / 0.7, -1)
    s = Sampler(seed=3)
    n = 4000
    batch = lg.repeat(n, 1)
    toks = s(batch, [req(str(i), temperature=0.7) for i in range(n)])
    counts = torch.bincount(torch.tensor([t.token_id for t in toks]), minlength=8)[:8].float()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 24.32, chi2


def test_top_k_top_p_min_p_masks():
    lg = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    one = torch.ones(1)
    out = apply_top_k_top_p_min_p(lg, torch.tensor([2]), one, torch.zeros(1))
    assert torch.isinf(out[0, 2:]).all() and not torch.isinf(out[0, :2]).any()
    p = torch.softmax(lg, -1)[0]
    # top_p just above the first token's mass keeps two tokens
    out = apply_top_k_top_p_min_p(lg, torch.tensor([0]), torch.tensor([p[0].item() + 1e-3]), torch.zeros(1))
    assert (~torch.isinf(out[0])).sum() == 2
    # min_p: keep tokens with prob >= 0.3 * max prob
    out = apply_top_k_top_p_min_p(lg, torch.tensor([0]), one, torch.tensor([0.3]))
    keep = p >= 0.3 * p[0]
    assert torch.equal(~torch.isinf(out[0]), keep)


def test_top_k_one_is_greedy():
    lg = logits(8)
    toks = Sampler()(lg, [req(str(i), temperature=1.5, top_k=1) for i in range(8)])
    assert [t.token_id for t in toks] == lg.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-6, 0.009])
def test_a_tiny_temperature_samples_as_the_lowest_one_not_nan(temperature):
    # logits / 1e-38 overflowed to inf, the softmax to NaN, and every row drew token 0.
    assert SamplingParams(temperature=temperature).temperature == 0.01
    lg = logits(8)
    toks = Sampler()(lg, [req(str(i), temperature=temperature, seed=i) for i in range(8)])
    assert [t.token_id for t in toks] == lg.argmax(-1).tolist()  # gaps of ~1 over 0.01: argmax


def test_penalties_match_reference_formulas():
    lg = logits(1)
    prompt, out = [1, 2], [2, 3, 3]
    got = apply_penalties(
        lg.clone(), [prompt], [out], torch.tensor([1.3]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    want = lg.clone()
    for t in {1, 2, 3}:
        want[0, t] = want[0, t] / 1.3 if want[0, t] > 0 else want[0, t] * 1.3
    for t, c in {2: 1, 3: 2}.items():
        want[0, t] -= 0.25 * c + 0.5
    assert torch.allclose(got, want)


def test_logit_bias_and_min_tokens():
    lg = torch.zeros(1, V)
    lg[0, 0] = 10.0  # eos is the favourite
    r = req(temperature=0, min_tokens=2, logit_bias={5: 5.0})
    assert Sampler()(lg.clone(), [r])[0].token_id == 5
    r.output_token_ids = [7, 7]
    assert Sampler()(lg.clone(), [r])[0].token_id == 0


def test_logprobs_are_log_softmax_with_sorted_top_n():
    lg = logits(1)
    tok = Sampler()(lg, [req(temperature=0, logprobs=3)])[0]
    ref = torch.log_softmax(lg[0], -1)
    assert tok.token_id == int(ref.argmax())
    assert math.isclose(tok.logprob, ref[tok.token_id].item(), rel_tol=1e-5)
    assert [t for t, _ in tok.top_logprobs] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        # wrong types: accepted then failing the engine step (logprobs 2.5), silently truncated, or a
        # bare TypeError / AttributeError naming nothing
        ({"logprobs": 2.5}, "logprobs"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"prompt_logprobs": 2.5}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"temperature": "abc"}, "temperature"),
        ({"top_k": True}, "top_k"),
        ({"stop": 123}, "stop"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"structured": "abc"}, "structured"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_invalid_params_raise_named_errors(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)
