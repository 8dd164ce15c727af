/* Projections of a few rows (a decoding step: one row per live sequence; a prefill's last row) on
 * AVX512-BF16, reading the weight in place: y = x W^T (+ bias), fp32 accumulation rounded once to bf16,
 * then (+ residual), rounded again, as PyTorch's F.linear followed by a separate add rounds. Included by
 * rows_attention.c in both bf16 builds.
 *
 * Why: with one row a projection is a pass over its weight, so its speed is the memory bandwidth it
 * reaches. PyTorch's bf16 matmul for one row read a 1.5B model's weights at well under what this CPU
 * streams (docs/benchmarks.md has the measurement); here each thread walks whole weight rows, four at a
 * time, with one vdpbf16ps per 32 inputs, and the rows of x are re-read from L1.
 *
 * No packing: W is the module's own [N, K] row-major bf16 tensor (rows may be strided), so nothing is
 * copied beside the model. Work items are blocks of GEMV_BLOCK output columns. */
#ifndef KVB_GEMV_H
#define KVB_GEMV_H

#define GEMV_BLOCK 64 /* output columns (weight rows) per work item */
#define GEMV_MAX_ROWS 16

typedef struct {
    const bf16 *x;        /* [M, K], row stride ldx */
    const bf16 *w;        /* [N, K], row stride ldw */
    const bf16 *bias;     /* [N] or NULL */
    const bf16 *residual; /* [M, N], stride ldr, or NULL */
    bf16 *out;            /* [M, N], stride ldo */
    long ldx, ldw, ldr, ldo, rows, num_in, num_out;
} gemv_job;

/* Lanes of a 32-element bf16 step that lie inside the row: the K tail (K need not be a multiple of 32). */
static inline __mmask32 gemv_lanes(long left) {
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
}

static inline __m512bh gemv_load(const bf16 *p, __mmask32 lanes) {
    return (__m512bh)_mm512_maskz_loadu_epi16(lanes, p);
}

/* y[m, n] for m < rows and the `count` (1-4) weight rows from n: fp32 sums. */
static void gemv_dots(const gemv_job *jb, long n, int count, float sums[GEMV_MAX_ROWS][4]) {
    const bf16 *w[4];
    for (int i = 0; i < 4; i++)
        w[i] = jb->w + (n + (i < count ? i : 0)) * jb->ldw; /* unused lanes repeat the first row */
    for (long m = 0; m < jb->rows; m++) {
        const bf16 *x = jb->x + m * jb->ldx;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        for (long k = 0; k < jb->num_in; k += 32) {
            const __mmask32 lanes = gemv_lanes(jb->num_in - k);
            const __m512bh xv = gemv_load(x + k, lanes);
            acc0 = _mm512_dpbf16_ps(acc0, gemv_load(w[0] + k, lanes), xv);
            acc1 = _mm512_dpbf16_ps(acc1, gemv_load(w[1] + k, lanes), xv);
            acc2 = _mm512_dpbf16_ps(acc2, gemv_load(w[2] + k, lanes), xv);
            acc3 = _mm512_dpbf16_ps(acc3, gemv_load(w[3] + k, lanes), xv);
        }
        sums[m][0] = _mm512_reduce_add_ps(acc0);
        sums[m][1] = _mm512_reduce_add_ps(acc1);
        sums[m][2] = _mm512_reduce_add_ps(acc2);
        sums[m][3] = _mm512_reduce_add_ps(acc3);
    }
}

static inline float bf16_to_f32(bf16 v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* fp32 -> bf16, round to nearest even (finite values; NaN stays NaN) */
static inline bf16 f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u)
        return (bf16)((c.u >> 16) | 0x40);
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static void gemv_item(void *job, long item) {
    const gemv_job *jb = (const gemv_job *)job;
    const long end = (item + 1) * GEMV_BLOCK < jb->num_out ? (item + 1) * GEMV_BLOCK : jb->num_out;
    float sums[GEMV_MAX_ROWS][4];
    for (long n = item * GEMV_BLOCK; n < end; n += 4) {
        const int count = end - n < 4 ? (int)(end - n) : 4;
        gemv_dots(jb, n, count, sums);
        for (long m = 0; m < jb->rows; m++)
            for (int i = 0; i < count; i++) {
                float y = sums[m][i] + (jb->bias ? bf16_to_f32(jb->bias[n + i]) : 0.0f);
                bf16 rounded = f32_to_bf16(y);
                if (jb->residual)
                    rounded = f32_to_bf16(bf16_to_f32(rounded) + bf16_to_f32(jb->residual[m * jb->ldr + n + i]));
                jb->out[m * jb->ldo + n + i] = rounded;
            }
    }
}

/* out [M, N] = x [M, K] W[N, K]^T (+ bias [N]) (+ residual [M, N]), for 1 <= M <= GEMV_MAX_ROWS.
 * Returns 0, or -1 for sizes it does not take. */
int kvb_gemv(const bf16 *x, long ldx, long rows, long num_in, const bf16 *w, long ldw, long num_out,
             const bf16 *bias, const bf16 *residual, long ldr, bf16 *out, long ldo, int num_threads) {
    if (rows <= 0 || rows > GEMV_MAX_ROWS || num_in <= 0 || num_out <= 0 || ldw < num_in || num_threads <= 0)
        return -1;
    gemv_job jb = {.x = x, .w = w, .bias = bias, .residual = residual, .out = out, .ldx = ldx, .ldw = ldw,
                   .ldr = ldr, .ldo = ldo, .rows = rows, .num_in = num_in, .num_out = num_out};
    run_parallel(&jb, gemv_item, (num_out + GEMV_BLOCK - 1) / GEMV_BLOCK, num_threads, NULL, NULL);
    return 0;
}

/* The largest M kvb_gemv takes. */
long kvb_gemv_max_rows(void) { return GEMV_MAX_ROWS; }

#endif
