"""muxd's Triton decode kernel (attention/triton_decode.py) against the torch reference, run by Triton's interpreter
on the CPU (a subprocess: the interpreter is chosen when kernels are defined), and the rules that pick it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from appliance.attention import AttentionMetadata, page_layout, uses_triton_decode
from appliance.attention.triton_decode import (BALANCED_PROGRAMS_PER_SM, MAX_BATCH, PROGRAMS_PER_SM, TritonDecode,
                                               balance, partials, splits_for, unsupported)
from appliance.errors import ConfigError

triton = pytest.importorskip("triton")

# a batch of rows of `lens` tokens over pages in random order, its new K/V written, and the torch reference's output
BATCH = textwrap.dedent("""
    import numpy as np, torch
    from appliance.attention import AttentionMetadata, TorchAttention, page_layout
    PAGE, D = 16, 32

    def batch(heads, kv_heads, lens, gen, pool=300):
        pages, order, used = [], torch.randperm(pool, generator=gen).numpy().astype(np.int32), 0
        for n in lens:
            k = -(-n // PAGE)
            pages.append(order[used:used + k])
            used += k
        ends = np.array(lens, np.int64)
        qo, kv_indptr, kv_indices, last, _, slots = page_layout(ends - 1, ends, pages, PAGE)
        meta = AttentionMetadata(qo, kv_indptr, kv_indices, last, ends.astype(np.int32), PAGE,
                                 torch.from_numpy(slots))
        cache = torch.randn(2, pool + 1, PAGE, kv_heads, D, generator=gen)
        q = torch.randn(len(lens), heads, D, generator=gen)
        k, v = (torch.randn(len(lens), kv_heads, D, generator=gen) for _ in range(2))
        expected = TorchAttention().forward(q, k, v, cache.clone(), meta)  # writes the new K/V, then attends
        TorchAttention().forward(q, k, v, cache, meta)  # the same K/V write
        return meta, cache, q, expected
""")

CHECK = BATCH + textwrap.dedent("""
    from appliance.attention.triton_decode import TritonDecode
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, lens in [(8, 2, [1024]), (2, 2, [1, 37, 300]), (7, 1, [513, 16]), (8, 2, [20, 1])]:
        meta, cache, q, expected = batch(heads, kv_heads, lens, gen, pool=200)
        dec = TritonDecode(heads, kv_heads, D, len(lens), 200, torch.device("cpu"))
        dec.plan(meta)
        out = dec.run(q, cache[0], cache[1])
        err = (out - expected).abs().max().item()
        print(heads, kv_heads, lens, dec.splits, err)
        assert err < 1e-4, (heads, kv_heads, lens, err)
    print("ok")
""")


def test_kernel_matches_the_torch_reference_in_the_interpreter(interpreted):
    """GQA groups of 4, 1 and 7, one to three rows, lengths 1 to 1024 (splits past a row's end, a row of one
    token), pages in random order."""
    out = interpreted["CHECK"]
    assert out.strip().endswith("ok"), out


BALANCED = BATCH + textwrap.dedent("""
    from appliance.attention.triton_decode import BalancedTritonDecode
    gen = torch.Generator().manual_seed(1)
    for heads, kv_heads, lens, sms, tiling in [
            (8, 2, [1024, 3, 40, 700, 1], 4, {}), (4, 4, [17, 300, 16], 2, {}), (7, 1, [513, 33], 1, {}),
            (8, 2, [20, 1, 64], 64, {}),
            (8, 2, [200, 90, 5], 8, dict(waves=6, min_pages=2, pages_per_block=2))]:  # another tiling
        meta, cache, q, expected = batch(heads, kv_heads, lens, gen)
        scratch = torch.zeros(1 << 20, dtype=torch.uint8) if sms == 2 else None  # partials in a shared buffer
        dec = BalancedTritonDecode(heads, kv_heads, D, len(lens), 300, torch.device("cpu"), sm_count=sms,
                                   scratch=scratch, **tiling)
        assert scratch is None or dec.partial_out.data_ptr() == scratch.data_ptr()
        dec.plan(meta)
        cut = int((dec.items.view(-1, 5)[:, 4] > 1).sum())
        for _ in range(2):  # the merging item leaves its counter at zero for the next launch
            out = dec.run(q, cache[0], cache[1])
            err = (out - expected).abs().max().item()
            print(heads, kv_heads, lens, sms, cut, err)
            assert err < 1e-4, (heads, kv_heads, lens, err)
            assert not dec.counts.any()
    print("ok")
""")


def test_balanced_kernel_matches_the_torch_reference_in_the_interpreter(interpreted):
    """The balanced form: rows of 1 to 1,024 tokens cut into work items for GPUs of 1 to 64 SMs (long rows into
    several items merged in the kernel, short ones whole), GQA groups of 4, 1 and 7, pages in random order."""
    out = interpreted["BALANCED"]
    assert out.strip().endswith("ok"), out
    cuts = [int(line.split()[-2]) for line in out.strip().splitlines()[:-1]]
    assert max(cuts) > 1 and min(cuts) == 0  # some plans cut rows, one cut none


ROPE = BATCH + textwrap.dedent("""
    from appliance.attention.kv_write import apply_rope, write_kv
    from appliance.attention.triton_decode import TritonDecode
    gen = torch.Generator().manual_seed(2)
    angles = torch.arange(2048.0)[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None, :]
    table = torch.stack([torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)], 1).contiguous()
    # rows of 1, 16 and 17 tokens: the newest token alone in its split's loop, the last of a page, alone in a page
    for heads, kv_heads, lens, norm in [(8, 2, [400], False), (2, 2, [1, 37, 300], False),
                                        (7, 1, [130, 17], True), (8, 2, [16, 1], True)]:
        meta, cache, _, _ = batch(heads, kv_heads, lens, gen, pool=200)
        positions = torch.tensor(lens) - 1
        qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * D, generator=gen)
        norms = tuple(1 + 0.1 * torch.randn(D, generator=gen) for _ in range(2)) if norm else (None, None)
        # the reference: the rotary reference, the K/V write, then the torch reference's attention on the rotated q
        # (the split kernel `run` matches that reference: test_kernel_matches_the_torch_reference_in_the_interpreter)
        ref_cache = cache.clone()
        q, k, v = apply_rope(qkv, positions, table, heads, *norms, 1e-6)
        write_kv(k, v, ref_cache, meta.slot_mapping)
        expected = TorchAttention().forward(q.contiguous(), k, v, ref_cache.clone(), meta)
        dec = TritonDecode(heads, kv_heads, D, len(lens), 200, torch.device("cpu"))
        dec.plan(meta)
        out = dec.run_rope(qkv, positions, table, cache, meta.slot_mapping, *norms, 1e-6)
        err, cache_err = (out - expected).abs().max().item(), (cache - ref_cache).abs().max().item()
        print(heads, kv_heads, lens, norm, err, cache_err)
        assert err < 1e-4 and cache_err < 1e-5, (heads, kv_heads, lens, err, cache_err)
    print("ok")
""")


# runs the checks above one after another, each in a namespace of its own, printing its name before its output
DRIVER = textwrap.dedent("""
    import json, sys, traceback
    for name, code in json.loads(sys.argv[1]).items():
        print("=== " + name, flush=True)
        try:
            exec(compile(code, name, "exec"), {"__name__": name})
        except BaseException:
            traceback.print_exc(file=sys.stdout)
""")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """The output of each interpreter check (CHECK, BALANCED, ROPE): one subprocess runs them all, importing torch and
    Triton once; a check that fails prints its traceback and the others still run."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    checks = json.dumps({"CHECK": CHECK, "BALANCED": BALANCED, "ROPE": ROPE})
    result = subprocess.run([sys.executable, "-c", DRIVER, checks], env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    sections = result.stdout.split("=== ")[1:]
    return {section.split("\n", 1)[0]: section.split("\n", 1)[1] for section in sections}


def test_rope_folded_into_the_split_kernel_matches_the_rotary_kernel_then_attention(interpreted):
    """`run_rope` (q/k norms, rotation and the new K/V write inside the attention kernel) against the rotary
    reference, the K/V write and the torch reference's attention: the output and every cache entry, GQA groups of 4,
    1 and 7."""
    out = interpreted["ROPE"]
    assert out.strip().endswith("ok"), out


def test_balanced_plans_cut_long_rows_into_equal_items():
    items = balance(np.array([65] * 63 + [2048, 1]), target=66, capacity=66 + 2 * 65)
    used = items[items[:, 0] >= 0]
    assert (items[len(used):] == -1).all()
    rows, n = used[:, 0], used[:, 4]
    assert (n[rows < 63] == 1).all() and (n[rows == 64] == 1).all()  # short rows whole
    long = used[rows == 63]
    assert len(long) == long[0, 4] > 8 and (long[:, 3] == np.flatnonzero(rows == 63)[0]).all()
    assert long[0, 1] == 0 and long[-1, 2] == 2048 and (long[1:, 1] == long[:-1, 2]).all()  # the row, in order
    size = long[:, 2] - long[:, 1]
    assert (size[:-1] == size[0]).all() and 0 < size[-1] <= size[0]  # equal items, the last no longer
    assert len(balance(np.full(256, 4000), target=66, capacity=66 + 512)) == 66 + 512  # capped at the capacity
    assert (balance(np.full(256, 4000), target=66, capacity=66 + 512)[:, 4] <= 32).all()


def test_partials_live_in_the_scratch_buffer_that_holds_them():
    scratch = torch.zeros(4 * 10 * 33, dtype=torch.uint8)
    out, lse = partials(10, 32, torch.device("cpu"), scratch)
    assert out.data_ptr() == scratch.data_ptr() and lse.data_ptr() == scratch.data_ptr() + 4 * 320
    assert (out.numel(), lse.numel(), out.dtype) == (320, 10, torch.float32)
    out, lse = partials(11, 32, torch.device("cpu"), scratch)  # too small: buffers of their own
    assert out.data_ptr() != scratch.data_ptr() and (out.numel(), lse.numel()) == (352, 11)


def test_splits_shrink_as_rows_grow():
    assert [splits_for(b) for b in (1, 2, 3, 4, 5, 8, 16)] == [64, 32, 16, 16, 8, 8, 8]


def test_unsupported_shapes_are_named():
    assert unsupported(32, 8, 128, 16) is None
    assert "head_dim 96" in unsupported(32, 8, 96, 16)
    assert "page size 24" in unsupported(32, 8, 128, 24)
    assert "do not group" in unsupported(30, 8, 128, 16)


def test_which_backends_run_it():
    cfg = SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=128)
    for kernel in ("auto", "triton"):  # split-KV up to MAX_BATCH rows, balanced beyond
        assert all(uses_triton_decode(kernel, cfg, b, 16) for b in (1, MAX_BATCH, MAX_BATCH + 1, 256))
        assert not uses_triton_decode(kernel, cfg, None, 16)  # eager backends keep flashinfer
    assert not uses_triton_decode("flashinfer", cfg, 1, 16)
    odd = SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=96)
    assert not uses_triton_decode("auto", odd, 1, 16)
    with pytest.raises(ConfigError, match="--decode-kernel triton cannot serve this model: head_dim 96"):
        uses_triton_decode("triton", odd, 1, 16)
    with pytest.raises(ConfigError, match="decode kernel 'fast' is unknown"):
        uses_triton_decode("fast", cfg, 1, 16)


def test_plan_refuses_a_batch_it_was_not_made_for():
    dec = TritonDecode(8, 2, 32, 2, 4, torch.device("cpu"))
    ends = np.array([5], np.int64)
    qo, kv_indptr, kv_indices, last, _, slots = page_layout(ends - 1, ends, [np.array([0], np.int32)], 16)
    meta = AttentionMetadata(qo, kv_indptr, kv_indices, last, ends.astype(np.int32), 16, torch.from_numpy(slots))
    with pytest.raises(RuntimeError, match="of 2 rows got 1 sequences"):
        dec.plan(meta)


def _gpu_triton() -> str | None:
    """The CUDA lock's Triton (the GPU machines'), which `make test` installs apart in the virtual environment."""
    lock = os.path.join(os.path.dirname(__file__), "..", "..", "packaging", "lock", "requirements-cuda.txt")
    version = next(line.split("==")[1].split()[0] for line in open(lock) if line.startswith("triton=="))
    where = os.path.join(sys.prefix, "gpu-triton")
    return where if os.path.isdir(os.path.join(where, f"triton-{version}.dist-info")) else None


@pytest.mark.parametrize("which", ["installed", "gpu"])
def test_the_kernels_fit_the_programs_per_sm_the_plans_assume(tmp_path, which):
    """Compiled for an H100/H200 without a GPU (scripts/kernel_registers.py, Triton's own ptxas), with the Triton
    installed and with the GPU machines' one (a newer Triton may accept what it rejects), every kernel compiles and
    each attention kernel as launched holds at least the programs an SM (by registers and shared memory) that the
    balanced plan and the predictor's decode plan count on, and spills nothing."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    if which == "gpu":
        where = _gpu_triton()
        if where is None:
            pytest.skip("the CUDA lock's Triton is not installed apart (`make test` puts it in .venv/gpu-triton)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    elif not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    result = subprocess.run([sys.executable, "scripts/kernel_registers.py"], env=env, capture_output=True, text=True,
                            timeout=600, cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in result.stdout.splitlines()
             if line.startswith("| ")]
    header = lines[0]  # | kernel (sm_90) | warps | pages a loop | stages | registers | spill bytes | shared KB | ...
    rows = {cells[0]: dict(zip(header, cells)) for cells in lines[1:]}
    assert {"decode_merge", "write_kv_kernel", "rope_write_kv_kernel (norm)", "argmax_pick_kernel"} <= set(rows)
    for name, least in (("decode_partial", PROGRAMS_PER_SM), ("decode_partial_rope", PROGRAMS_PER_SM),
                        ("decode_partial_rope (norm)", PROGRAMS_PER_SM), ("decode_balanced", BALANCED_PROGRAMS_PER_SM)):
        assert int(rows[name]["programs an SM"]) >= least and int(rows[name]["spill bytes"]) == 0, (name, rows[name])