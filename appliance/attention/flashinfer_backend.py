"""flashinfer attention backend (CUDA): paged prefill (new tokens over cached prefix + themselves, causal, ragged
batches) and paged decode, K/V written into pages by slot.

One instance owns one workspace and its wrappers: the engine's eager instance plans once per forward; each captured
decode batch size gets its own instance made with `graph_batch_size`, whose decode wrapper keeps its index buffers
fixed (`use_cuda_graph=True`) so that only `run()` is captured and `plan()` refreshes the buffers before a replay.
`plan()` writes its schedule into a pinned host buffer and copies it to the device without waiting: backends that
share a workspace share a ring of such buffers, used in turn (`PlanStaging`: two, more while a plan's copy waits
behind queued prefill), so that the next step's plan, made while the current step runs, never rewrites a buffer
whose copy has not run yet, and never waits for a busy stream to reach it.
A graph instance made with `triton_decode` runs muxd's own decode kernels (attention/triton_decode.py) instead of
flashinfer's decode: the split-KV kernel up to `MAX_BATCH` rows (faster at a few rows, where decode attention is bound
by latency), beyond them its balanced form.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from appliance.attention.kv_write import rope_kernel_takes, rope_write_kv, write_kv
from appliance.attention.metadata import AttentionMetadata
from appliance.attention.pinned import PinnedRing, Ring
from appliance.attention.triton_decode import MAX_BATCH, BalancedTritonDecode, TritonDecode

if TYPE_CHECKING:  # the package's __init__ imports this module lazily
    from appliance.attention import AttentionShape

WORKSPACE_BYTES = 128 << 20
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# the CUDA-core decode kernel is built for group sizes 1, 2, 4, 8; from 4 up the tensor-core path (the prefill
# kernels) reads the KV faster (measured: 1.5x at batch 64, context 1k, group 4), and it takes any group (Qwen2.5-7B's
# 7)
CUDA_CORE_DECODE_GROUPS = (1, 2)
MAX_PLAN_BUFFERS = 6  # pinned plan buffers of one workspace at most (8 MiB each)


class PlanStaging:
    """Pinned host buffers that plan() writes a schedule into before its asynchronous copy to the device, used in
    turn; a buffer is rewritten only once the copy from it has run (an event each). Two suffice while plans follow
    the device closely; a prefill plan queued behind several steps of prefill on its stream adds a buffer (up to
    `MAX_PLAN_BUFFERS`) rather than make the host wait for that stream (attention/pinned.py)."""

    def __init__(self, like: torch.Tensor) -> None:
        self._like = like
        self.buffers = [torch.empty(like.shape, dtype=like.dtype, pin_memory=True) for _ in range(2)]
        self.ring = Ring(self.buffers, MAX_PLAN_BUFFERS)
        self._indices = PinnedRing(torch.int32, pinned=True)

    def indices_on(self, indices, device: torch.device) -> torch.Tensor:
        """Page indices on the device, copied without waiting. A CUDA-graph decode wrapper copies host indices into
        its fixed buffer with a blocking copy, which would wait for every kernel queued before it (the step still
        running); from the device its copy is queued like the rest of the plan."""
        packed, _ = self._indices.stage([indices])
        out = packed.to(device, non_blocking=True)
        self._indices.done()
        return out

    def next(self, grow: bool = True) -> torch.Tensor:
        """The buffer for the next plan (one whose last copy has run). `grow` false: a plan that writes a buffer
        of its own (not one of these) waits for the copy two plans back, as that buffer's only guard."""
        slot = self.ring.acquire(grow)
        if self.buffers[slot] is None:
            self.buffers[slot] = torch.empty(self._like.shape, dtype=self._like.dtype, pin_memory=True)
        return self.buffers[slot]

    def copied(self) -> None:
        """The plan's copy from the current buffer is queued on the current stream."""
        self.ring.release()

    def fits(self, wrapper) -> bool:
        """The buffers hold what `wrapper`'s plan writes (its int workspace's size)."""
        return self.buffers[0].numel() * self.buffers[0].element_size() >= \
            wrapper._int_workspace_buffer.numel() * wrapper._int_workspace_buffer.element_size()


def _stages(wrapper) -> bool:
    """The wrapper plans through a pinned buffer it reads from an attribute at each plan() (flashinfer 0.5: where
    it does not, the wrapper keeps its own buffer and the staging ring only orders the plans, without growing)."""
    return hasattr(wrapper, "_pin_memory_int_workspace_buffer") and hasattr(wrapper, "_int_workspace_buffer")


class Workspaces(NamedTuple):
    """A (float, int) device workspace pair and its plan staging, which several backends used one after another on
    one stream may share."""

    float_buffer: torch.Tensor
    int_buffer: torch.Tensor
    staging: PlanStaging


def make_workspaces(device: torch.device) -> Workspaces:
    int_buffer = torch.zeros(8 << 20, dtype=torch.uint8, device=device)
    return Workspaces(torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), int_buffer,
                      PlanStaging(int_buffer))


def prefill_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel flashinfer's paged prefill runs here ("fa3" on Hopper, else "fa2"), as its "auto" choice makes
    it; "unknown" where this flashinfer does not say."""
    try:
        from flashinfer.utils import determine_attention_backend

        return determine_attention_backend(torch.device(device), 0, False, False, dtype, dtype)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return "unknown"


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the backend is unusable
        return False
    return True


class FlashInferAttention:
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, cfg: AttentionShape, dtype: torch.dtype, device: torch.device, *,
                 graph_batch_size: int | None = None, max_pages: int = 0,
                 decode_tensor_cores: bool | None = None,
                 workspaces: Workspaces | None = None, triton_decode: bool = False) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = dtype
        group = cfg.num_heads // cfg.num_kv_heads
        self.decode_tensor_cores = (group not in CUDA_CORE_DECODE_GROUPS if decode_tensor_cores is None
                                    else decode_tensor_cores)
        # (float, int) workspaces; graph backends of one stream share one pair: their replays never overlap
        self.workspace = (workspaces.float_buffer if workspaces is not None
                          else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
        self.graph_batch_size = graph_batch_size
        self.prefill = None
        self.prefill_kernel = prefill_kernel(device, dtype)
        self.triton = None
        if triton_decode:
            if graph_batch_size is None:
                raise ValueError("the Triton decode kernel serves CUDA-graph batches (give graph_batch_size)")
            shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, graph_batch_size, max_pages, device)
            if graph_batch_size <= MAX_BATCH:
                self.triton = TritonDecode(*shape)
            else:  # its partials in the shared float workspace (the graphs of one stream never overlap)
                self.triton = BalancedTritonDecode(*shape, scratch=None if workspaces is None else
                                                   workspaces.float_buffer)
            self.decode = None
        elif graph_batch_size is None:
            self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
        else:
            bs = graph_batch_size
            self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(max(max_pages, bs), dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=device))
        if workspaces is not None:
            for wrapper in (self.prefill, self.decode):
                if wrapper is not None:
                    wrapper.reset_workspace_buffer(workspaces.float_buffer, workspaces.int_buffer)
        # the wrappers' own pinned buffers give way to the staging ring (wrappers of one instance plan one at a time)
        wrappers = [w for w in (self.prefill, self.decode) if w is not None and _stages(w)]
        if workspaces is not None:
            self.staging = workspaces.staging
        else:
            self.staging = PlanStaging(max((w._int_workspace_buffer for w in wrappers), key=torch.Tensor.numel,
                                           default=torch.empty(0, dtype=torch.uint8)))
        for w in wrappers:
            if self.staging.fits(w):
                w._pin_memory_int_workspace_buffer = self.staging.buffers[0]
        self._active = None
        self._plan_key: tuple | None = None  # the prefill layout last planned

    def prepare(self, m: AttentionMetadata) -> None:
        # the layer ranges of one prefill batch, launched step after step, share one plan: planning again would
        # (below) wait for the device to reach the previous launch
        key = (m.page_size, m.qo_indptr.tobytes(), m.kv_indptr.tobytes(), m.last_page_len.tobytes(),
               m.kv_indices.tobytes()) if not m.decode_only and self.prefill is not None else None
        if key is not None and key == self._plan_key and self._active is self.prefill:
            return
        self._plan_key = key
        if self.triton is not None:
            if not m.decode_only:
                raise RuntimeError("a CUDA-graph attention backend runs decode batches only")
            self.triton.plan(m)
            self._active = self.triton
            return
        # plan() writes its schedule into a pinned host buffer and copies it to the device asynchronously; when
        # launches queue up on a busy stream (the next step planned while this one runs, prefill beside decode), a
        # copy may not have run yet: the staging ring rewrites a buffer only after its copy has
        wrapper = self.decode if m.decode_only else self.prefill
        staged_here = wrapper is not None and _stages(wrapper) and self.staging.fits(wrapper)
        staged = self.staging.next(grow=staged_here)
        if staged_here:
            wrapper._pin_memory_int_workspace_buffer = staged
        # plain host tensors: staging them through pinned memory measured 25-35 us slower per plan (H200)
        qo_indptr, indptr, indices, last, seq_lens = (torch.from_numpy(a) for a in (
            m.qo_indptr, m.kv_indptr, m.kv_indices, m.last_page_len, m.seq_lens))
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if m.decode_only:
            if self.graph_batch_size is not None:
                indices = self.staging.indices_on(m.kv_indices, self.workspace.device)
            self.decode.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, m.page_size,
                             seq_lens=seq_lens, **common)
            self._active = self.decode
        elif self.prefill is None:
            raise RuntimeError("a CUDA-graph attention backend runs decode batches only")
        else:
            self.prefill.plan(qo_indptr, indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim,
                              m.page_size, causal=True, **common)
            self._active = self.prefill
        self.staging.copied()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, kv, metadata.slot_mapping)
        return self._run(q.contiguous(), kv)

    def forward_rope(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     kv: torch.Tensor, metadata: AttentionMetadata, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """`forward` of a fused QKV projection not yet rotated: one kernel normalises (where q_norm and k_norm are
        given) and rotates q and k and writes k and v."""
        triton = self.triton
        if (getattr(triton, "fuses_rope", False) and triton.head_dim == cos_sin.shape[-1]
                and num_heads == triton.num_heads and rope_kernel_takes(qkv, cos_sin, num_heads, kv, q_norm, k_norm)):
            return triton.run_rope(qkv, positions, cos_sin, kv, metadata.slot_mapping, q_norm, k_norm, eps)
        q = rope_write_kv(qkv, positions, cos_sin, num_heads, kv, metadata.slot_mapping, q_norm, k_norm, eps)
        return self._run(q, kv)

    def attend_rotated(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """Paged attention of q already rotated (its K/V already written) for the prepared batch, into `out`."""
        self._active.run(q, (kv[0], kv[1]), out=out)

    def _run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:  # such an instance runs nothing but its decode batches (prepare checks)
            return self.triton.run(q, kv[0], kv[1])
        return self._active.run(q, (kv[0], kv[1]))
