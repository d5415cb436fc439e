"""SpecConfig: validation, flat options, CLI flags, switch-off rule."""
import pytest

from kiln.cli.main import build_parser, given
from kiln.config import EngineConfig, SpecConfig
from kiln.errors import ConfigError
from kiln.llm.request import Request
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.spec_decode.proposer import plan_drafts


@pytest.mark.parametrize(
    "bad",
    [
        dict(spec_method="medusa"),
        dict(num_speculative_tokens=0),
        dict(ngram_min_n=3, ngram_max_n=2),
        dict(draft_num_layers=0),
        dict(max_batch_for_speculation=0),
    ],
)
def test_invalid_options_raise_config_error(bad):
    with pytest.raises(ConfigError):
        SpecConfig(**bad)


@pytest.mark.parametrize(("options", "message"), [
    # Each was accepted and ignored without a word (a draft model path that did not exist too).
    (dict(num_speculative_tokens=8), "num_speculative_tokens does nothing with no spec_method "),
    # "draft_model does nothing with spec_method unset and a draft_model" before
    (dict(draft_model="/nonexistent/draft.gguf"),
     r"draft_model does nothing with no spec_method \(set spec_method draft or ngram\)$"),
    (dict(spec_method="ngram", draft_num_layers=3), "draft_num_layers does nothing with spec_method ngram"),
    (dict(spec_method="draft", ngram_max_n=2), "ngram_max_n does nothing with spec_method draft"),
    (dict(spec_method="draft", draft_model="/m", draft_num_layers=3),
     "draft_num_layers does nothing with spec_method draft and a draft_model"),
    (dict(spec_method="draft", draft_model=""), "draft_model must not be empty"),
])
def test_options_the_method_does_not_read_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**options)


def test_off_by_default_and_flags_reach_the_config():
    assert EngineConfig().spec.spec_method is None
    parser, names = build_parser()
    args = parser.parse_args(["serve", "--spec-method", "ngram", "--num-speculative-tokens", "3"])
    config = EngineConfig.from_flat(**given(args, names["engine"]))
    assert config.spec == SpecConfig(spec_method="ngram", num_speculative_tokens=3)


def decoding(rid, max_tokens=10, n_out=1, **params):
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, **params))
    r.output_token_ids = [4] * n_out
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_plan_drafts_limits_and_opt_outs():
    config = SpecConfig(spec_method="ngram", num_speculative_tokens=4, max_batch_for_speculation=5)
    prefilling = decoding("p")
    prefilling.num_computed_tokens = 1
    running = [
        decoding("a"),
        decoding("near-max", max_tokens=4, n_out=2),  # room for 1 draft + the bonus token
        decoding("opt-out", speculate=False),
        decoding("logprobs", logprobs=1),
        decoding("last", max_tokens=3, n_out=2),  # only the bonus token is left
        prefilling,
    ]
    chosen, counts = plan_drafts(running[:5], config, max_model_len=100)
    assert [r.request_id for r in chosen] == ["a", "near-max"] and counts == [4, 1]
    chosen, counts = plan_drafts([decoding("ctx")], config, max_model_len=6)
    assert counts == [2]  # positions 4, 5 < max_model_len
    assert plan_drafts(running, config, max_model_len=100) == ([], [])  # 6 running > 5: off
