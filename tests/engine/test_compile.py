"""Regional torch.compile on CPU: one compiled layer serves every layer and token count (no recompilation per layer),
the final norm is compiled too, and the compiled model generates the same greedy tokens as eager."""
from __future__ import annotations

import os

import torch
from tiny_models import build_tiny_checkpoint

from appliance.config import Config
from appliance.engine.compile import _torch_default_inductor_dir, use_cache_dirs
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams


def test_compile_caches_go_to_muxds_cache_directory_unless_chosen(tmp_path, monkeypatch):
    """Importing torch._dynamo (compiling does) sets TORCHINDUCTOR_CACHE_DIR to torch's default: that one moves under
    muxd's cache directory (where a container keeps it); a directory the user set stays, for Triton's cache too."""
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))
    default = _torch_default_inductor_dir()
    assert default is not None
    for before in (default, None):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
        use_cache_dirs()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    use_cache_dirs()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "my-triton")


def test_compiled_layers_are_shared_and_match_eager(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters  # imported here: seconds that collection would spend on every worker

    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))
    # whatever compile_layers sets them to is undone after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    build_tiny_checkpoint("qwen3", tmp_path, num_layers=3)
    torch._dynamo.reset()
    counters.clear()
    compiled = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64, compile=True))
    eager = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64))
    assert compiled.compiled and not eager.compiled
    prompts = [[1, 5, 7, 9, 11, 13], list(range(3, 40)), [4]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [c.token_ids for c in compiled.generate(prompts, params)] == \
        [c.token_ids for c in eager.generate(prompts, params)]
    # first layer (no residual yet) and the rest, each for one token and for a symbolic count: 3 layers, 4 graphs;
    # the final norm, for one token and for a symbolic count: 2 more
    assert counters["stats"]["unique_graphs"] == 6
    # the final norm without a residual runs eagerly (no graph more), with one as its two graphs, same values
    norm = compiled.runner.model.model.norm
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # as the engine's tensors: compiled code guards on the dispatch keys
        for rows in (1, 5):
            x, r = (torch.randn(rows, norm.weight.numel(), generator=gen) for _ in range(2))
            assert torch.equal(norm(x), type(norm).forward(norm, x))
            torch.testing.assert_close(norm(x, r)[0], type(norm).forward(norm, x, r)[0])
    assert counters["stats"]["unique_graphs"] == 6
    assert (tmp_path / "cache" / "inductor").is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


def test_the_residual_add_stays_out_of_the_projection(tmp_path, monkeypatch):
    """Inductor turns `linear(x, w) + r` into one addmm (on CUDA, a copy of r, then a GEMM adding it); with muxd's
    post-grad pass the GEMM stays plain and the add joins the kernel that reads the sum (here the norm), same values."""
    from torch._inductor.utils import run_and_get_code

    from appliance.engine.compile import residual_add_apart

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def block(x, w, r):
        h = torch.nn.functional.linear(x, w) + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), h

    gen = torch.Generator().manual_seed(0)
    x, w, r = (torch.randn(shape, generator=gen) for shape in ((6, 32), (48, 32), (6, 48)))
    expected = block(x, w, r)
    codes = {}
    for name, options in (("fused", {}), ("apart", {"post_grad_custom_post_pass": residual_add_apart()})):
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(block, dynamic=True, options=options), x, w, r)
        codes[name] = "\n".join(code)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want)
    assert "addmm" in codes["fused"]  # what Inductor does by itself (the pass has something to undo)
    assert "addmm" not in codes["apart"] and "extern_kernels.mm(" in codes["apart"]


def test_triton_keeps_the_fp_fusion_muxd_was_measured_with_unless_the_user_chose(tmp_path, monkeypatch):
    """Triton 3.10 turns floating-point fusion off by default; an engine pins it on before any kernel compiles, and a
    value the user set stays."""
    from appliance.engine import compile as compile_module

    build_tiny_checkpoint("llama", tmp_path, num_layers=1)
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=16))
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == "1"
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    compile_module.pin_triton_defaults()
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == "0"
