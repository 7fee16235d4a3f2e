"""QuantConfig: ignore patterns and reading a checkpoint's quantization_config."""

import copy

import pytest

import quantkit.config as config_module
from quantkit.config import QuantConfig, UnknownSchemeError


def test_ignore_takes_globs_last_parts_and_regular_expressions():
    config = QuantConfig.preset("int8", ignore=("lm_head", "*down_proj", "re:.*layers\\.1\\.self_attn\\.q_proj$"))
    assert config.is_ignored("lm_head")
    assert config.is_ignored("model.layers.3.mlp.down_proj")
    assert config.is_ignored("model.layers.1.self_attn.q_proj")
    assert not config.is_ignored("model.layers.11.self_attn.q_proj")
    assert not config.is_ignored("model.layers.1.self_attn.k_proj")


def _written(scheme="int8-static"):
    return QuantConfig.preset(scheme).to_quantization_config(ignore=["lm_head"])


def test_written_config_reads_back():
    read = QuantConfig.from_quantization_config(_written())
    assert (read.weight_type, read.activations, read.ignore) == ("int8", "static", ("lm_head",))


@pytest.mark.parametrize("path, value, message", [
    (("input_activations", "symmetric"), False, "8-bit symmetric activations"),
    (("weights", "dynamic"), True, "static weights"),
    (("targets",), ["re:.*mlp.*"], "targets="),
])
def test_schemes_quantkit_cannot_run_are_refused(path, value, message):
    qc = copy.deepcopy(_written())
    group = qc["config_groups"]["group_0"]
    *parents, key = path
    for parent in parents:
        group = group[parent]
    group[key] = value
    with pytest.raises(UnknownSchemeError, match=message):
        QuantConfig.from_quantization_config(qc)


@pytest.mark.parametrize("ignore", [None, 3, ("lm_head", 7)])
def test_ignore_that_is_not_patterns_is_refused(ignore):
    with pytest.raises(ValueError, match=r"must be a tuple of module-name patterns"):
        QuantConfig(ignore=ignore)


def test_ignore_takes_a_string_a_list_or_a_set():
    assert QuantConfig(ignore="lm_head").ignore == ("lm_head",)
    assert QuantConfig(ignore=["lm_head", "*.down_proj"]).ignore == ("lm_head", "*.down_proj")
    assert QuantConfig(ignore={"lm_head", "*.down_proj"}).ignore == ("*.down_proj", "lm_head")


def test_sequential_gptq_is_a_gptq_option_and_reads_back():
    with pytest.raises(ValueError, match="gptq_sequential=True needs gptq=True"):
        QuantConfig(gptq_sequential=True)
    config = QuantConfig.preset("fp8", gptq=True, gptq_sequential=True)
    read = QuantConfig.from_quantization_config(config.to_quantization_config(ignore=["lm_head"]))
    assert read.gptq and read.gptq_sequential
    # A recipe's sequential setting goes with its GPTQ when GPTQ is turned off...
    recipes = {**config_module.RECIPES, "seq": {"fp8": {"gptq": True, "gptq_sequential": True}}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_module, "RECIPES", recipes)
        assert not QuantConfig.preset("fp8", "seq", gptq=False).gptq_sequential
        # ...but asking for both off and on at once is refused.
        with pytest.raises(ValueError, match="needs gptq=True"):
            QuantConfig.preset("fp8", "seq", gptq=False, gptq_sequential=True)
