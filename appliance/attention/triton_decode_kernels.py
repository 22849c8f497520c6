"""The Triton kernels of muxd's split-KV decode and of its balanced form for larger batches
(attention/triton_decode.py owns the layouts and the launches); imported on first use, so that the package imports
without Triton."""
import triton
import triton.language as tl


@triton.jit
def _span(seq_len, PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr):
    """(pages of the row, pages per split, splits in use)."""
    npages = (seq_len + PAGE - 1) // PAGE
    per = tl.maximum((npages + SPLITS - 1) // SPLITS, PPB)
    return npages, per, (npages + per - 1) // per


@triton.jit
def _attend(q, k_ptr, v_ptr, indices_ptr, first, seq_len, p0, p1, h, scale_log2, stride_kp, stride_kt, stride_kh,
            GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr, EMPTY_OK: tl.constexpr = False):
    """The online softmax of the query tile q [GP, D] over one KV head's pages [p0, p1) of a row (PPB pages a
    step), its tokens before `seq_len`: its running max m, sum l and unnormalised output acc. EMPTY_OK: a step may
    hold no token of the row even when it is the split's first (m stays -inf, l 0)."""
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, PPB * PAGE)
    # each step's page numbers are read one step ahead, so that the K/V reads wait for no index read
    ahead = p0 + n // PAGE
    page_ahead = tl.load(indices_ptr + first + ahead, mask=ahead < p1, other=0)
    for p in range(p0, p1, PPB):  # empty for a split past the row's end
        page_local = p + n // PAGE
        in_split = page_local < p1
        page = page_ahead.to(tl.int64)
        ahead = page_local + PPB
        page_ahead = tl.load(indices_ptr + first + ahead, mask=ahead < p1, other=0)
        tok = page_local * PAGE + n % PAGE
        valid = in_split & (tok < seq_len)
        off = page * stride_kp + (n % PAGE) * stride_kt + h * stride_kh
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale_log2
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        if EMPTY_OK:  # exponents against a finite max: no -inf - -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l = l * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def _split(seqlen_ptr, indptr_ptr, b, s, PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr):
    """Split s of row b: (the row's tokens, its first page's index, splits in use, the split's pages [p0, p1))."""
    seq_len = tl.load(seqlen_ptr + b)
    first = tl.load(indptr_ptr + b)
    npages, per, used = _span(seq_len, PAGE, PPB, SPLITS)
    p0 = s * per
    return seq_len, first, used, p0, tl.minimum(p0 + per, npages)


@triton.jit
def _store_partial(po_ptr, plse_ptr, m, l, acc, row, s, used, qmask, d, SPLITS: tl.constexpr, D: tl.constexpr):
    """A split's normalised partial output and log-sum-exp for the merge (splits past the row's end store none)."""
    keep = qmask & (s + row * 0 < used)  # (a vector: the interpreter takes no scalar in a mask)
    safe = tl.where(l == 0.0, 1.0, l)
    tl.store(po_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], acc / safe[:, None], mask=keep[:, None])
    tl.store(plse_ptr + row * SPLITS + s, m + tl.log2(safe), mask=keep)


@triton.jit
def decode_partial(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, seqlen_ptr, po_ptr, plse_ptr, scale_log2,
                   stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
                   SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (attention/pdl.py): wait for the kernel before
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_heads = tl.num_programs(1) * G
    seq_len, first, used, p0, p1 = _split(seqlen_ptr, indptr_ptr, b, s, PAGE, PPB, SPLITS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    qmask = g < G
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=qmask[:, None],
                other=0.0)
    m, l, acc = _attend(q, k_ptr, v_ptr, indices_ptr, first, seq_len, p0, p1, h, scale_log2, stride_kp, stride_kt,
                        stride_kh, GP, D, PAGE, PPB)
    if PDL:  # the next kernel may launch now: its programs wait in SM slots these programs no longer need
        tl.extra.cuda.gdc_launch_dependents()
    _store_partial(po_ptr, plse_ptr, m, l, acc, b * num_heads + h * G + g, s, used, qmask, d, SPLITS, D)


@triton.jit
def _rotated(src, w_ptr, heads, mask, d, cos, sin, eps, dtype: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """Heads `heads` [R] of one row's fused QKV projection at `src` as [R, D]: RMS-normalised by the weights at w_ptr
    where NORM, then rotated (rotate-half) by cos and sin [D], rounded as the rotary kernel rounds them
    (kv_write_kernels.rope_write_kv_kernel); fp32."""
    half = D // 2
    partner = (d + half) % D  # x2 against x1, x1 against x2
    x = tl.load(src + heads[:, None] * D + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    xp = tl.load(src + heads[:, None] * D + partner[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = ((x * r).to(dtype).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)[None, :]).to(dtype)
        xp = ((xp * r).to(dtype).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)[None, :]).to(dtype)
        x, xp = x.to(tl.float32), xp.to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    return x * cos[None, :] + (sign[None, :] * xp) * sin[None, :]


@triton.jit
def decode_partial_rope(qkv_ptr, pos_ptr, table_ptr, slot_ptr, qw_ptr, kw_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr,
                        seqlen_ptr, po_ptr, plse_ptr, scale_log2, eps, stride_qkv, positions, stride_kp, stride_kt,
                        stride_kh, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr,
                        NORM: tl.constexpr, PDL: tl.constexpr = False):
    # `decode_partial` of a fused QKV projection not yet rotated, the rotary kernel's work folded in: each program
    # normalises (NORM) and rotates its group's query heads itself; the split holding the row's newest token writes
    # that token's rotated K and its V to the cache, and adds it to its softmax from registers (its loop reads the
    # cache's older tokens only, so no program reads what another writes in this launch)
    if PDL:  # launched early (attention/pdl.py): wait for the kernel before
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    dtype = qkv_ptr.dtype.element_ty
    seq_len, first, used, p0, p1 = _split(seqlen_ptr, indptr_ptr, b, s, PAGE, PPB, SPLITS)
    pos = tl.minimum(tl.load(pos_ptr + b).to(tl.int64), positions - 1)
    d = tl.arange(0, D)
    cos = tl.load(table_ptr + pos * 2 * D + d).to(tl.float32)  # table [positions, 2, D], equal halves
    sin = tl.load(table_ptr + pos * 2 * D + D + d).to(tl.float32)
    src = qkv_ptr + b * stride_qkv
    g = tl.arange(0, GP)
    qmask = g < G
    q = _rotated(src, qw_ptr, h * G + g, qmask, d, cos, sin, eps, dtype, D, NORM).to(dtype)
    m, l, acc = _attend(q, k_ptr, v_ptr, indices_ptr, first, seq_len - 1, p0, p1, h, scale_log2, stride_kp, stride_kt,
                        stride_kh, GP, D, PAGE, PPB, True)
    if s == used - 1:  # the newest token's page is the last split's
        one = tl.arange(0, 1)
        k = _rotated(src, kw_ptr, HEADS + h + one, one == 0, d, cos, sin, eps, dtype, D, NORM).to(dtype)  # [1, D]
        v = tl.load(src + (HEADS + KV_HEADS + h) * D + d)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        at = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_kt + h * stride_kh
        tl.store(k_ptr + at + d[None, :], k.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + at + d, v.to(v_ptr.dtype.element_ty))
        sc = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * scale_log2
        m_new = tl.maximum(m, sc)
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(sc - m_new)
        l = l * alpha + pr
        acc = acc * alpha[:, None] + pr[:, None] * v.to(tl.float32)[None, :]
        m = m_new
    if PDL:  # the next kernel may launch now
        tl.extra.cuda.gdc_launch_dependents()
    _store_partial(po_ptr, plse_ptr, m, l, acc, b * HEADS + h * G + g, s, used, qmask, d, SPLITS, D)


@triton.jit
def decode_merge(po_ptr, plse_ptr, seqlen_ptr, o_ptr, stride_ob, stride_oh, D: tl.constexpr,
                 PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (attention/pdl.py): wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    hq = tl.program_id(1)
    row = b * tl.num_programs(1) + hq
    _, _, used = _span(tl.load(seqlen_ptr + b), PAGE, PPB, SPLITS)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    live = s < used
    lse = tl.load(plse_ptr + row * SPLITS + s, mask=live, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(live, tl.exp2(lse - tl.where(used > 0, mx, 0.0)), 0.0)
    o = tl.load(po_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def decode_balanced(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, seqlen_ptr, items_ptr, po_ptr, plse_ptr, count_ptr,
                    o_ptr, scale_log2, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_ob, stride_oh,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr):
    # one program per (KV head, work item); an item is a run of one row's pages [p0, p1), planned on the host so
    # that items carry about equal work. A row of one item writes its output; a row cut into n items leaves n
    # partial softmaxes, and the last of its programs to finish (a counter per row and KV head) merges them
    h = tl.program_id(0)
    it = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    b = tl.load(items_ptr + it * 5)
    if b >= 0:  # items past the plan's count are -1
        p0 = tl.load(items_ptr + it * 5 + 1)
        p1 = tl.load(items_ptr + it * 5 + 2)
        base = tl.load(items_ptr + it * 5 + 3)  # the row's first item
        n = tl.load(items_ptr + it * 5 + 4)     # the row's items
        seq_len = tl.load(seqlen_ptr + b)
        first = tl.load(indptr_ptr + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        qmask = g < G
        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=qmask[:, None],
                    other=0.0)
        m, l, acc = _attend(q, k_ptr, v_ptr, indices_ptr, first, seq_len, p0, p1, h, scale_log2, stride_kp,
                            stride_kt, stride_kh, GP, D, PAGE, PPB)
        safe = tl.where(l == 0.0, 1.0, l)
        if n <= 1:
            tl.store(o_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                     (acc / safe[:, None]).to(o_ptr.dtype.element_ty), mask=qmask[:, None])
        else:
            # partials [item, KV head, G, D] and their log-sum-exps [item, KV head, G]
            slot = it * num_kv_heads + h
            tl.store(po_ptr + (slot * G + g)[:, None] * D + d[None, :], acc / safe[:, None], mask=qmask[:, None])
            tl.store(plse_ptr + slot * G + g, m + tl.log2(safe), mask=qmask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            done = tl.atomic_add(count_ptr + b * num_kv_heads + h, 1, sem="acq_rel")
            if done == n - 1:  # the row's last item: the others' partials are visible
                tl.debug_barrier()
                m = tl.full([GP], float("-inf"), tl.float32)
                l = tl.zeros([GP], tl.float32)
                acc = tl.zeros([GP, D], tl.float32)
                for k in range(n):  # the row's partials, merged one at a time (a few registers, any count)
                    rows = ((base + k) * num_kv_heads + h) * G + g
                    lse = tl.load(plse_ptr + rows, mask=qmask, other=0.0, cache_modifier=".cg")
                    part = tl.load(po_ptr + rows[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0,
                                   cache_modifier=".cg")
                    m_new = tl.maximum(m, lse)
                    alpha = tl.exp2(m - m_new)
                    w = tl.exp2(lse - m_new)
                    l = l * alpha + w
                    acc = acc * alpha[:, None] + part * w[:, None]
                    m = m_new
                tl.store(o_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                         (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=qmask[:, None])
                tl.atomic_xchg(count_ptr + b * num_kv_heads + h, 0)
