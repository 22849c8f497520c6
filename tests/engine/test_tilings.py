"""The single-token graph's tilings tables (engine/tilings.py): their key, their files, the choice, and reading a
tuned Inductor cache; the one-row product the single-token graph is written with (model_zoo/layers.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from appliance.engine import tilings
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.layers import DecoderLayer, RotaryEmbedding, matvec


@pytest.fixture(scope="module", autouse=True)
def needs_inductors_triton_heuristics():
    """Imported when the tests run: at collection it cost seconds (torch._dynamo) on every pytest worker."""
    pytest.importorskip("torch._inductor.runtime.triton_heuristics")


KEY = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.5.0", "layer": "abc", "pdl": True}
KERNEL = '''
import triton

@triton_heuristics.reduction(
    size_hints={'x': 1, 'r0_': 4096},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
)
@triton.jit
def triton_red_fused_mm_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
'''


def _layer(**changes) -> DecoderLayer:
    cfg = ModelConfig(**{**dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                max_position_embeddings=128), **changes})
    return DecoderLayer(cfg, 0, RotaryEmbedding(cfg.head_dim, cfg.rope))


def test_layer_signature_follows_shapes_dtypes_and_eps():
    base = tilings.layer_signature(_layer())
    assert base == tilings.layer_signature(_layer())
    assert base != tilings.layer_signature(_layer(intermediate_size=96))
    assert base != tilings.layer_signature(_layer(rms_norm_eps=1e-6))
    assert base != tilings.layer_signature(_layer().to(torch.bfloat16))


def _table(path, key=KEY, kernels=None):
    path.write_text(json.dumps({"key": key, "kernels": kernels or {"h1": {"XBLOCK": 4, "R0_BLOCK": 1024,
                                                                           "num_warps": 4, "num_stages": 1}}}))
    return path


def test_choice_follows_the_setting(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tilings, "SHIPPED", shipped)
    monkeypatch.delenv(tilings.ENV, raising=False)
    assert tilings.choose(KEY).source == "tuned" and tilings.choose(KEY).options() == {}
    _table(shipped / "other.json", key={**KEY, "gpu": "NVIDIA H100 80GB HBM3"})
    _table(shipped / "h200.json")
    chosen = tilings.choose(KEY)
    assert chosen.source == "shipped h200"
    assert chosen.options() == {"coordinate_descent_tuning": False, "autotune_lookup_table": chosen.kernels}
    assert chosen.describe()["kernels"] == 1 and chosen.describe()["gpu"] == "NVIDIA H200"
    assert tilings.choose({**KEY, "torch": "2.13.0"}).source == "tuned"  # another torch: no table
    monkeypatch.setenv(tilings.ENV, "tune")
    assert tilings.choose(KEY).source == "tuned"
    monkeypatch.setenv(tilings.ENV, str(_table(tmp_path / "mine.json", kernels={"h2": {"num_warps": 8,
                                                                                       "num_stages": 2}})))
    assert tilings.choose(KEY).kernels == {"h2": {"num_warps": 8, "num_stages": 2}}
    assert tilings.choose({**KEY, "layer": "other"}).source == "tuned"  # a file for another model is not used
    monkeypatch.setenv(tilings.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="MUXD_TILINGS=.*missing.json: tilings table .*cannot read it"):
        tilings.choose(KEY)


def test_shipped_tables_load_and_name_a_model_muxd_ships_a_config_for():
    """Each shipped table is valid and keyed by the bf16 layer of a model in configs/models (a table whose layer
    signature no model has would never be chosen)."""
    signatures = {}
    for config in sorted((Path(__file__).resolve().parents[2] / "configs" / "models").glob("*/config.json")):
        cfg = ModelConfig.from_file(config)
        with torch.device("meta"):
            layer = DecoderLayer(cfg, 0, RotaryEmbedding(cfg.head_dim, cfg.rope)).to(torch.bfloat16)
        signatures[tilings.layer_signature(layer)] = config.parent.name
    tables = sorted(tilings.SHIPPED.glob("*.json"))
    assert tables, "no shipped tilings table"
    for path in tables:
        table = tilings.load(path)
        assert set(table["key"]) == {"gpu", "torch", "triton", "layer", "pdl"}, path.name
        assert table["kernels"], path.name
        assert path.stem.startswith(signatures.get(table["key"]["layer"], "no model")), path.name


@pytest.mark.parametrize("text, why", [("not json", "cannot read it as JSON"), ("[]", "'key' and 'kernels'"),
                                        ('{"key": {}, "kernels": {"h": {"num_warps": "4", "num_stages": 1}}}',
                                         "integer num_warps")])
def test_bad_table_files_are_named(tmp_path, text, why):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why) as err:
        tilings.load(path)
    assert str(path) in str(err.value)


def test_a_tuned_cache_gives_the_hashes_inductor_looks_up(tmp_path):
    """The hash of a kernel file is Inductor's lookup key of the kernel (its size hints as the autotuner prints
    them and its Triton function); a kernel coordinate descent tuned is read with its tiling, others are not."""
    from torch._inductor.runtime.triton_heuristics import generate_lookup_hash_from_source_code

    expected = generate_lookup_hash_from_source_code(str({'x': 1, 'r0_': 4096}),
                                                     KERNEL.split("@triton.jit\n")[1])
    assert tilings.source_hash(KERNEL) == expected
    assert tilings.source_hash("def not_a_kernel(): pass\n") is None
    tuned, untuned = tmp_path / "ab" / "tuned.py", tmp_path / "cd" / "untuned.py"
    for path, coordesc in ((tuned, True), (untuned, False)):
        path.parent.mkdir()
        path.write_text(KERNEL.replace("mm_0", path.stem))
        tilings._best_config_path(path).write_text(json.dumps(
            {"XBLOCK": 2, "R0_BLOCK": 2048, "num_warps": 8, "num_stages": 1, "found_by_coordesc": coordesc,
             "time_taken_ms": 12, "configs_hash": "x"}))
    (tmp_path / "ab" / "wrapper.py").write_text("print('no kernel')\n")
    assert tilings.tuned_kernels(tmp_path) == {expected: {"XBLOCK": 2, "R0_BLOCK": 2048, "num_warps": 8,
                                                          "num_stages": 1}}
    assert tilings.kernel_hashes(tmp_path) == {expected}  # the kernel's name is not part of its hash


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_row_product_is_the_linear_layer(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(1, 256, dtype=dtype), torch.randn(96, 256, dtype=dtype)
    got, want = matvec(x, w), F.linear(x.float(), w.float())
    assert got.dtype == dtype and got.shape == (1, 96)
    torch.testing.assert_close(got.float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def test_a_kernel_in_both_graphs_takes_the_tiling_tuned_last(tmp_path):
    """The same kernel code under two names (the first layer's graph and the others') has one lookup hash: the
    table keeps the tiling whose tuning was written last."""
    for i, (name, block) in enumerate((("first_3", 64), ("others_4", 16))):
        path = tmp_path / name / f"{name}.py"
        path.parent.mkdir()
        path.write_text(KERNEL.replace("mm_0", name))
        best = tilings._best_config_path(path)
        best.write_text(json.dumps({"XBLOCK": 1, "R0_BLOCK": block, "num_warps": 4, "num_stages": 1,
                                    "found_by_coordesc": True}))
        os.utime(best, ns=(10**18 + i, 10**18 + i))
    assert [t["R0_BLOCK"] for t in tilings.tuned_kernels(tmp_path).values()] == [16]
