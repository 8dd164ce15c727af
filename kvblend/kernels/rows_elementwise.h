/* A layer's row-wise bf16 ops, one pass each over AVX-512 registers: RMSNorm (optionally after the
 * residual add that precedes it) and the MLP's SiLU(gate) * up. Included by rows_attention.c in both
 * bf16 builds (amx, avx512bf16).
 *
 * Why: PyTorch runs these as 4-5 separate passes (fp32 copy, norm, two multiplies; silu, then mul), and
 * on a 2-core Sapphire Rapids they took about as long per row as the matmuls around them in full prefill.
 *
 * Rounding follows the HF modules in bf16 step by step: RMSNorm computes x * rsqrt(mean(x^2) + eps) in
 * fp32, rounds to bf16, multiplies by the weight and rounds again; the residual sum is rounded before it
 * is normed; SiLU is rounded to bf16 before the multiply (PyTorch's silu on a bf16 tensor), exp to ~1e-8
 * relative. Sums of squares add in another order than PyTorch's, so a result can differ by one bf16 ulp. */
#ifndef KVB_ROWS_ELEMENTWISE_H
#define KVB_ROWS_ELEMENTWISE_H

#define EW_ROWS 16 /* rows per work item */

static inline __m512 load_bf16(const bf16 *p) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p));
}

static inline void store_bf16(bf16 *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x)); }

/* bf16 rounding of an fp32 vector, back in fp32 */
static inline __m512 round_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

typedef struct {
    const bf16 *x;     /* [rows, dim], row stride ldx */
    const bf16 *delta; /* NULL, or added to x first: [rows, dim], stride ldd */
    bf16 *sum;         /* with delta: receives bf16(x + delta), stride lds */
    const bf16 *weight;
    bf16 *out;         /* [rows, dim], stride ldo */
    long ldx, ldd, lds, ldo, rows, dim;
    float eps;
} norm_job;

static void norm_item(void *job, long item) {
    const norm_job *jb = (const norm_job *)job;
    long end = (item + 1) * EW_ROWS < jb->rows ? (item + 1) * EW_ROWS : jb->rows;
    for (long r = item * EW_ROWS; r < end; r++) {
        const bf16 *x = jb->x + r * jb->ldx;
        __m512 acc = _mm512_setzero_ps();
        if (jb->delta) { /* the residual sum is what the model carries on: rounded, stored, then normed */
            bf16 *s = jb->sum + r * jb->lds;
            const bf16 *d = jb->delta + r * jb->ldd;
            for (long c = 0; c < jb->dim; c += 16) {
                __m512 v = round_bf16(_mm512_add_ps(load_bf16(x + c), load_bf16(d + c)));
                store_bf16(s + c, v);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            x = s;
        } else {
            for (long c = 0; c < jb->dim; c += 16) {
                __m512 v = load_bf16(x + c);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)jb->dim + jb->eps));
        bf16 *o = jb->out + r * jb->ldo;
        for (long c = 0; c < jb->dim; c += 16) {
            __m512 y = round_bf16(_mm512_mul_ps(load_bf16(x + c), scale));
            store_bf16(o + c, _mm512_mul_ps(y, load_bf16(jb->weight + c)));
        }
    }
}

/* out = RMSNorm(x) * weight, or with delta: sum = bf16(x + delta), out = RMSNorm(sum) * weight.
 * dim a multiple of 16. Returns 0, or -1 for arguments it does not take (the caller falls back). */
int kvb_rms_norm(const bf16 *x, long ldx, const bf16 *delta, long ldd, bf16 *sum, long lds, const bf16 *weight,
                 float eps, bf16 *out, long ldo, long rows, long dim, int num_threads) {
    if (rows <= 0 || dim <= 0 || dim % 16 || num_threads <= 0 || (delta != NULL) != (sum != NULL))
        return -1;
    norm_job jb = {.x = x, .delta = delta, .sum = sum, .weight = weight, .out = out, .ldx = ldx, .ldd = ldd,
                   .lds = lds, .ldo = ldo, .rows = rows, .dim = dim, .eps = eps};
    run_parallel(&jb, norm_item, (rows + EW_ROWS - 1) / EW_ROWS, num_threads, NULL, NULL);
    return 0;
}

/* e^x in fp32 to ~1e-8 relative: 2^n * e^g with n = round(x log2 e), g = (x log2 e - n) ln 2 in
 * [-0.35, 0.35] and a degree-7 Taylor polynomial of e^g. Inputs below ~-87 give (flushed) 0, above
 * ~88.7 +inf, as expf. */
static inline __m512 exp_ps(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.4426950408889634f));
    t = _mm512_min_ps(t, _mm512_set1_ps(128.0f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f)); /* e^f = 2^(t - n) */
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const bf16 *gate_up; /* [rows, 2 * inter]: gate columns, then up columns; row stride ld */
    bf16 *out;           /* [rows, inter], row stride ldo */
    long ld, ldo, rows, inter;
} silu_job;

static void silu_item(void *job, long item) {
    const silu_job *jb = (const silu_job *)job;
    long end = (item + 1) * EW_ROWS < jb->rows ? (item + 1) * EW_ROWS : jb->rows;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (long r = item * EW_ROWS; r < end; r++) {
        const bf16 *g = jb->gate_up + r * jb->ld, *u = g + jb->inter;
        bf16 *o = jb->out + r * jb->ldo;
        for (long c = 0; c < jb->inter; c += 16) {
            __m512 x = load_bf16(g + c);
            __m512 silu = round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
            store_bf16(o + c, _mm512_mul_ps(silu, load_bf16(u + c)));
        }
    }
}

/* out = SiLU(gate) * up for gate_up rows [gate | up]. inter a multiple of 16. Returns 0 or -1. */
int kvb_silu_mul(const bf16 *gate_up, long ld, bf16 *out, long ldo, long rows, long inter, int num_threads) {
    if (rows <= 0 || inter <= 0 || inter % 16 || num_threads <= 0)
        return -1;
    silu_job jb = {.gate_up = gate_up, .out = out, .ld = ld, .ldo = ldo, .rows = rows, .inter = inter};
    run_parallel(&jb, silu_item, (rows + EW_ROWS - 1) / EW_ROWS, num_threads, NULL, NULL);
    return 0;
}

/* dst[h, rows[i], :] = src[h, i, :] for every head h: one layer's fresh K or V rows into the prompt's
 * [heads, T, width] buffer. src rows may be strided (q/k/v come out of one fused projection). One thread:
 * ~1,000 rows x 3 heads x 128 bytes is a few hundred KB. Returns 0, or -1 for a row out of [0, num_dst). */
int kvb_scatter_rows(const bf16 *src, long src_head_stride, long src_row_stride, const int64_t *rows, long num_rows,
                     int num_heads, long width, bf16 *dst, long dst_head_stride, long num_dst) {
    for (long i = 0; i < num_rows; i++)
        if (rows[i] < 0 || rows[i] >= num_dst)
            return -1;
    for (int h = 0; h < num_heads; h++)
        for (long i = 0; i < num_rows; i++)
            memcpy(dst + h * dst_head_stride + rows[i] * width, src + h * src_head_stride + i * src_row_stride,
                   (size_t)width * sizeof(bf16));
    return 0;
}

#endif
