"""The SLO contract: the examples validate; every kind of mistake names its field path and line; `muxd slo check`."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.cli.main import app
from appliance.errors import ContractError
from appliance.slo.contract import load_contract, parse_contract

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "configs" / "slo").glob("*.yaml"))

VALID = """\
version: 1
name: test
targets:
  ttft: {ms: 500, per_1k_tokens_ms: 100}
  tbt: {ms: 50}
classes:
  chat: {priority: 0}
  batch:
    priority: 2
    targets:
      tbt: {ms: 200}
overload: {mode: shed, queue_limit: 8}
"""


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_validate(path):
    contract = load_contract(path)
    for name in contract.class_names():
        slo = contract.slo_for(name)
        assert slo.ttft_ms > 0 and slo.tbt_ms > 0
    assert {p.stem for p in EXAMPLES} >= {"chat", "long-context", "batch"}
    assert load_contract(EXAMPLES[0]).slo_for(None).name == load_contract(EXAMPLES[0]).default_class_name


def test_class_targets_inherit_and_override():
    c = parse_contract(VALID)
    chat, batch = c.slo_for("chat"), c.slo_for("batch")
    assert (chat.tbt_ms, batch.tbt_ms) == (50, 200)
    assert batch.ttft_ms == 500 and batch.priority == 2
    assert chat.ttft_target_ms(2000) == pytest.approx(700)  # 500 + 100 per 1k uncached tokens
    assert c.default_class_name == "chat"
    assert c.overload.mode == "shed" and c.overload.queue_limit == 8


@pytest.mark.parametrize("text, line, path, words", [
    (VALID.replace("  tbt: {ms: 50}", "  tbt: {ms: 50, colour: red}"), 5, "targets.tbt.colour",
     ["unknown key 'colour'", "ms, percentile"]),
    (VALID.replace("ms: 500,", "ms: fast,"), 4, "targets.ttft.ms", ["valid number", "'fast'"]),
    (VALID.replace("{ms: 50}", "{ms: -50}"), 5, "targets.tbt.ms", ["greater than 0", "-50"]),
    (VALID.replace("{ms: 50}", "{ms: 50, percentile: 120}"), 5, "targets.tbt.percentile",
     ["less than or equal to 100", "120"]),
    (VALID.replace("  batch:\n", "  chat:\n"), 8, "classes.chat", ["duplicate class 'chat'", "line 7"]),
    (VALID.replace("mode: shed", "mode: drop"), 12, "overload.mode", ["'shed' or 'queue'", "'drop'"]),
    (VALID.replace("      tbt: {ms: 200}", "      tbt: {ms: 200}\n      ttfb: {ms: 1}"), 12,
     "classes.batch.targets.ttfb", ["unknown key 'ttfb'", "ttft, tbt, tpot, e2e"]),
    (VALID + "default_class: premium\n", 13, "default_class", ["'premium'", "chat, batch"]),
    (VALID.replace("  tbt: {ms: 50}\n", ""), 3, "targets.tbt", ["required"]),
    (VALID.replace("queue_limit: 8", "queue_limit: 0"), 12, "overload.queue_limit", ["greater than or equal to 1"]),
    (VALID.replace("name: test", "name: test\nattainment: 1.5"), 3, "attainment", ["less than or equal to 1"]),
])
def test_each_mistake_names_field_and_line(text, line, path, words):
    with pytest.raises(ContractError) as info:
        parse_contract(text, "c.yaml")
    problems = [p for p in info.value.problems if p.path == path]
    assert problems, f"no problem at {path}: {info.value.problems}"
    assert problems[0].line == line
    message = str(info.value)
    assert f"c.yaml:{line}: {path}:" in message
    for word in words:
        assert word in message


def test_all_problems_reported_at_once():
    bad = VALID.replace("{ms: 50}", "{ms: -1}").replace("mode: shed", "mode: maybe").replace("priority: 2",
                                                                                              "priority: high")
    with pytest.raises(ContractError) as info:
        parse_contract(bad)
    assert {p.path for p in info.value.problems} == {"targets.tbt.ms", "overload.mode", "classes.batch.priority"}
    assert [p.line for p in info.value.problems] == sorted(p.line for p in info.value.problems)


def test_not_yaml_and_not_a_mapping():
    with pytest.raises(ContractError) as info:
        parse_contract("targets: [1,\n")
    assert info.value.problems[0].line == 2 and "not valid YAML" in str(info.value)
    with pytest.raises(ContractError, match="must be a mapping"):
        parse_contract("- 1\n- 2\n")
    with pytest.raises(ContractError, match="cannot read"):
        load_contract("/nonexistent/contract.yaml")


def test_impossible_e2e_below_ttft():
    with pytest.raises(ContractError) as info:
        parse_contract(VALID.replace("  tbt: {ms: 50}", "  tbt: {ms: 50}\n  e2e: {ms: 100}"))
    assert info.value.problems[0].path == "targets.e2e.ms"
    assert "below the TTFT target" in str(info.value)


def test_slo_check_cli(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["slo", "check", str(EXAMPLES[0])], env={"COLUMNS": "200"})
    assert ok.exit_code == 0, ok.output
    assert "valid" in ok.output and load_contract(EXAMPLES[0]).class_names()[0] in ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(VALID.replace("{ms: 50}", "{ms: 0}").replace("mode: shed", "mode: drop"))
    result = runner.invoke(app, ["slo", "check", str(bad)], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert f"{bad}:5: targets.tbt.ms" in result.output and f"{bad}:12: overload.mode" in result.output


@pytest.mark.parametrize("args, message", [
    (["--slo", "BAD"], "bad.yaml:5: targets.tbt.ms"),
    (["--slo", "/nonexistent.yaml"], "cannot read"),
    (["--policy", "fastest"], "mux, chunked, serial, layerwise"),
    (["--policy", "chunked", "--chunk-budget", "0"], "--chunk-budget"),
])
def test_serve_checks_contract_and_policy_before_starting(text_checkpoint, tmp_path, args, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(VALID.replace("{ms: 50}", "{ms: 0}"))
    args = [str(bad) if a == "BAD" else a for a in args]
    result = CliRunner().invoke(app, ["serve", "--model", str(text_checkpoint), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_serve_help_lists_policy_flags():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    for flag in ("--policy", "--planner", "--slo", "--profile", "--chunk-budget", "mux"):
        assert flag in result.output
