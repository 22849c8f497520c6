"""Registers, spills and shared memory of muxd's Triton kernels (decode attention, the KV-cache writes, the argmax),
compiled for a CUDA architecture without a GPU (Triton's bundled ptxas and cuobjdump), and the programs one SM then
holds at once. A memory-bound kernel hides its loads' latency with the programs resident on an SM and the K/V tiles
each has in flight (Triton pipelines the page loop: `--stages` - 1 tiles ahead, each in shared memory); registers and
shared memory both bound the programs. Each kernel is compiled as a launch specializes it (pointers and strides
divisible by 16: without that Triton cannot pipeline the loads) and tiled as muxd launches it unless --warps,
--pages-per-block or --stages says otherwise (those three apply to the attention kernels). Run with the Triton of the
GPU machines (the CUDA lock's) it also proves every kernel compiles there: a newer Triton may accept what it rejects.

    python scripts/kernel_registers.py [--arch 90] [--warps W] [--group 4] [--pages-per-block P] [--stages S]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REGISTERS_PER_SM = 65536
SHARED_KB_PER_SM = 228  # sm_80 and sm_90 (H100, H200): 228 KB an SM, of which each resident program reserves 1 KB
PTR = "*bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--warps", type=int, default=None, help="warps a program (default: each kernel's own)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages-per-block", type=int, default=None, help="pages a loop (default: each kernel's own)")
    ap.add_argument("--stages", type=int, default=None, help="software-pipelining stages of the page loop "
                    "(default: each kernel's own)")
    args = ap.parse_args()
    from appliance.engine.compile import pin_triton_defaults

    pin_triton_defaults()  # compiled as the engine compiles them
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.attention import kv_write_kernels as kv_write
    from appliance.attention import triton_decode as tiling
    from appliance.attention import triton_decode_kernels as kernels
    from appliance.engine import argmax_kernels as argmax
    from appliance.engine.sampler import ARGMAX_SLICE

    target = GPUTarget("cuda", args.arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    gp = max(16, 1 << (args.group - 1).bit_length())
    heads, half = 8 * args.group, args.head_dim // 2  # Llama-3-8B's heads; NORM: Qwen3's q/k norms
    shape = {"G": args.group, "GP": gp, "D": args.head_dim, "PAGE": 16, "PDL": True,  # as launched on sm_90
             "HEADS": heads, "KV_HEADS": 8, "GROUP": args.group, "GROUP_PAD": 1 << (args.group - 1).bit_length(),
             "HALF": half}
    row = 8 * args.head_dim
    vocab_slices = 1 << (-(-128256 // ARGMAX_SLICE) - 1).bit_length()  # Llama-3's vocabulary
    split = (args.warps or tiling.NUM_WARPS, args.pages_per_block or tiling.PAGES_PER_BLOCK,
             args.stages or tiling.NUM_STAGES)
    rope_types = ["*", "*i64", "*", "*i64"]  # the fused QKV, positions, the cos/sin table, the slots
    cases = {  # name: kernel, runtime argument types, (warps, pages a loop, stages), other constants
        "decode_partial": (kernels.decode_partial, ["*", "*", "*", "*i32", "*i32", "*i32", "*fp32", "*fp32", "fp32",
                                                    "i32", "i32", "i64", "i64", "i64"], split, {"SPLITS": 16}),
        **{f"decode_partial_rope{' (norm)' if norm else ''}": (
            kernels.decode_partial_rope, rope_types + ["*", "*", "*", "*", "*i32", "*i32", "*i32", "*fp32", "*fp32",
                                                       "fp32", "fp32", "i32", "i32", "i64", "i64", "i64"],
            split, {"SPLITS": 16, "NORM": norm}) for norm in (False, True)},
        "decode_merge": (kernels.decode_merge, ["*fp32", "*fp32", "*i32", "*", "i32", "i32"],
                         (args.warps or 4, split[1], args.stages or 3), {"SPLITS": 16}),  # Triton's defaults
        "decode_balanced": (kernels.decode_balanced, ["*", "*", "*", "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32",
                                                      "*i32", "*", "fp32", "i32", "i32", "i64", "i64", "i64", "i32",
                                                      "i32"],
                            (args.warps or tiling.BALANCED_WARPS,
                             args.pages_per_block or tiling.BALANCED_PAGES_PER_BLOCK,
                             args.stages or tiling.BALANCED_STAGES), {}),
        **{f"rope_write_kv_kernel{' (norm)' if norm else ''}": (
            kv_write.rope_write_kv_kernel, rope_types + ["*", "*", "*", "*", "*", "i32", "i32", "fp32"], (4, None, 3),
            {"NORM": norm}) for norm in (False, True)},
        "write_kv_kernel": (kv_write.write_kv_kernel, ["*", "*", "*", "*", "*i64", "i32", "i32"], (4, None, 3),
                            {"ROW": row, "BLOCK": row}),
        "argmax_slices_kernel": (argmax.argmax_slices_kernel, ["*", "i32", "i32", "*fp32", "*i32", "i32"],
                                 (8, None, 3), {"BLOCK": ARGMAX_SLICE}),
        "argmax_pick_kernel": (argmax.argmax_pick_kernel, ["*fp32", "*i32", "i32", "*i64", "i32"], (1, None, 3),
                               {"SLICES": vocab_slices}),
    }
    print(f"| kernel (sm_{args.arch}) | warps | pages a loop | stages | registers | spill bytes | shared KB | "
          "programs an SM |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (fn, types, (warps, ppb, stages), extra) in cases.items():
        params = list(fn.arg_names)
        consts = {k: v for k, v in {**shape, **({"PPB": ppb} if ppb else {}), **extra}.items() if k in params}
        runtime = [p for p in params if p not in consts]
        signature = {p: (PTR if t == "*" else t) for p, t in zip(runtime, types)}
        signature.update({p: "constexpr" for p in consts})
        # as a launch specializes them: muxd's pointers and strides are multiples of 16 (scalars and flags are not)
        aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                   if p in runtime and (signature[p].startswith("*") or p.startswith("stride"))}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned),
                                  target=target, options={"num_warps": warps, "num_stages": stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        fields = dict(kv.split(":") for line in usage.splitlines() if "REG:" in line for kv in line.split())
        regs, stack = int(fields["REG"]), int(fields["STACK"])
        per_program = -(-regs // 8) * 8 * 32 * warps  # registers are allocated per warp, 8 at a time
        shared_kb = compiled.metadata.shared / 1024
        programs = min(REGISTERS_PER_SM // per_program, int(SHARED_KB_PER_SM // (shared_kb + 1)))
        print(f"| {name} | {warps} | {ppb or '-'} | {stages if ppb else '-'} | {regs} | {stack} | {shared_kb:.1f} | "
              f"{programs} |")


if __name__ == "__main__":
    main()
