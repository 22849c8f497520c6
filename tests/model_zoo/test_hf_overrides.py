"""vLLM's --hf-overrides (and its older --rope-scaling and --rope-theta): config.json fields replaced when the model
is built, so that a model served with an override runs as the same weights saved with that config does."""
from __future__ import annotations

import json

import pytest
from tiny_models import build_tiny_checkpoint

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import ConfigError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (i * 7) % 200 for i in range(40)], [5 + (i * 11) % 190 for i in range(70)]]
THETA = 50.0  # far from the checkpoint's: rotations of nearby positions differ much


def _tokens(path, **flags) -> list[list[int]]:
    engine = build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64, **flags))
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]


def test_an_override_runs_as_the_checkpoint_saved_with_it(tmp_path):
    base = tmp_path / "base"
    build_tiny_checkpoint("llama", base, seed=3)  # rope_theta 500000, llama3 scaling
    saved = tmp_path / "saved"
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    build_tiny_checkpoint("llama", saved, seed=3, rope_theta=THETA, rope_scaling=scaling)
    expected = _tokens(saved)
    assert _tokens(base) != expected  # the fields matter to these prompts
    overrides = json.dumps({"rope_theta": THETA, "rope_scaling": scaling})
    assert _tokens(base, hf_overrides=overrides) == expected
    # older vLLM's flags are the same overrides
    assert _tokens(base, rope_theta=THETA, rope_scaling=json.dumps(scaling)) == expected
    engine = build_engine(Config.flat(model=str(base), num_gpu_blocks_override=64, hf_overrides=overrides))
    assert (engine.model.config.rope.type, engine.model.config.rope.factor) == ("yarn", 2.0)


@pytest.mark.parametrize("flags, message", [
    ({"hf_overrides": "{rope_theta: 1}"}, "--hf-overrides: cannot read '{rope_theta: 1}' as JSON"),
    ({"hf_overrides": "[1]"}, "--hf-overrides: expected a JSON object of config.json fields"),
    ({"rope_scaling": "yarn"}, "--rope-scaling: cannot read 'yarn' as JSON"),
    ({"rope_scaling": "4"}, "--rope-scaling: expected a JSON object of rope scaling fields, got '4'"),
    ({"rope_theta": 1e6, "hf_overrides": '{"rope_theta": 1e4}'},
     "--rope-theta and --hf-overrides set rope_theta differently; give one"),
])
def test_bad_overrides_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Config.flat(**flags)


def test_an_override_that_breaks_the_config_is_refused_naming_it(tmp_path):
    build_tiny_checkpoint("llama", tmp_path, seed=0)
    cfg = Config.flat(model=str(tmp_path), hf_overrides='{"hidden_act": "gelu"}')
    with pytest.raises(Exception, match="with --hf-overrides: field 'hidden_act' is 'gelu'"):
        cfg.check()


def test_rope_overrides_of_a_config_in_either_transformers_format(tmp_path):
    """transformers 4 keeps rope_theta and rope_scaling at the top; transformers 5 keeps both in rope_parameters,
    which wins: an override of either field reaches the rope in both formats (rope_scaling replacing the scaling
    whole, rope_theta keeping it)."""
    from appliance.model_zoo.config import ModelConfig

    build_tiny_checkpoint("llama", tmp_path, seed=0)  # saved by transformers 5: rope_parameters, llama3 scaling
    v5 = json.loads((tmp_path / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=500000.0, rope_scaling={k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"})
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    for name, raw in (("v4", v4), ("v5", v5)):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(raw))
        assert ModelConfig.from_file(path).rope.type == "llama3"
        theta = ModelConfig.from_file(path, {"rope_theta": 7.0}).rope
        assert (theta.theta, theta.type, theta.factor) == (7.0, "llama3", 8.0), name
        scaled = ModelConfig.from_file(path, {"rope_scaling": yarn}).rope
        assert (scaled.theta, scaled.type, scaled.factor, scaled.original_max_position) == (
            500000.0, "yarn", 2.0, 256), name
