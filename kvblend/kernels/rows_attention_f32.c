/* One layer's attention for a sorted set of query rows, exact causal by absolute position, float32 on
 * AVX2 + FMA: the twin of rows_attention.c (bf16, AMX) for CPUs without native bf16, where the engine
 * runs float32 (e.g. AMD Zen 3). Same contract, same entry points, float32 tensors.
 *
 * Query row r sits at absolute position pos[r] (ascending) and attends keys 0..pos[r]. Work is split
 * into tiles of ROWS query rows of one KV head (GQA: a position's `rep` query heads are adjacent rows);
 * a tile reads keys up to its last row's position only and masks just the steps after its first row's,
 * so scattered rows (CacheBlend's recomputed tokens) cost what their own scores cost.
 *
 * One call does, on num_threads threads:
 *   1. prepare: rotate every key (RoPE, fp32 half tables indexed by position) into k_rot (the attention
 *      cache, kept for decoding) and pack it transposed per 8 keys, so one load gives 8 keys' lane d;
 *   2. attend: per tile, rotate its queries (pre-scaled to log2 units), then per step of 128 keys:
 *      S = Q K^T (register-blocked ROWS x 16 FMA kernel), an online softmax in base 2 in one pass
 *      against each row's reference max (rescaled only when the max grows by more than 2^RESCALE_LOG2,
 *      as in rows_attention.c: still exact), O += P V (ROWS x 16-column blocks of O in registers). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rows_common.h"

#define ROWS 6      /* query rows per tile: 6 x 2 accumulators + 2 loads + 1 broadcast fit 16 ymm */
#define KB 16       /* keys per S micro-kernel call (two 8-key packed blocks) */
#define STEP 128    /* keys per softmax step */
#define RESCALE_LOG2 8.0f
#ifndef KVB_HEAD_DIM /* built once per head size: -DKVB_HEAD_DIM=128 for 7B-class models */
#define KVB_HEAD_DIM 64
#endif
#define HEAD_DIM KVB_HEAD_DIM
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "KVB_HEAD_DIM must be 64 or 128"
#endif
#define HALF (HEAD_DIM / 2)

typedef struct {
    const float *q;       /* q[r, hq, :] at q + r * q_row_stride + hq * HEAD_DIM (pre-RoPE) */
    long q_row_stride;
    const float *k, *v;   /* k[h, t, :] at k + h * k_head_stride + t * HEAD_DIM (pre-RoPE); v likewise */
    long k_head_stride, v_head_stride;
    float *k_rot;         /* rotated keys, same layout, k_rot_head_stride; NULL: not kept */
    long k_rot_head_stride;
    const float *cos_t, *sin_t; /* [position, HALF]; NULL: q and k are already rotated */
    const int64_t *pos;   /* [num_rows] ascending */
    long num_rows, num_keys;
    int num_kv_heads, rep;
    float scale;
    float *out;           /* out[r, hq, :] at out + r * out_row_stride + hq * HEAD_DIM */
    long out_row_stride;
    int num_threads;
    float *kt;            /* [h][8-key block][HEAD_DIM][8] rotated keys, transposed per block */
    long num_blocks;      /* 16-key blocks per head (keys past num_keys pack as zeros) */
    long tiles_per_head;
} job_t;

/* dst[0:HEAD_DIM] = RoPE(src[0:HEAD_DIM]) * mul with x1' = x1 c - x2 s, x2' = x2 c + x1 s (HF rotate_half). */
static inline void rotate_row(const float *src, const float *c, const float *s, float mul, float *dst) {
    const __m256 m = _mm256_set1_ps(mul);
    if (!c) {
        for (int i = 0; i < HEAD_DIM; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), m));
        return;
    }
    for (int i = 0; i < HALF; i += 8) {
        __m256 x1 = _mm256_loadu_ps(src + i), x2 = _mm256_loadu_ps(src + HALF + i);
        __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_loadu_ps(s + i);
        __m256 y1 = _mm256_sub_ps(_mm256_mul_ps(x1, cc), _mm256_mul_ps(x2, ss));
        __m256 y2 = _mm256_add_ps(_mm256_mul_ps(x2, cc), _mm256_mul_ps(x1, ss));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(y1, m));
        _mm256_storeu_ps(dst + HALF + i, _mm256_mul_ps(y2, m));
    }
}

/* 2^x for x <= 0 (clamped at -126: the caller zeroes masked lanes): round to the nearest integer n, a
 * degree-6 Taylor polynomial for 2^f on [-0.5, 0.5] (relative error < 2e-7, about fp32's ulp), times
 * 2^n built in the exponent bits. */
static inline __m256 exp2_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381610e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Keys [16b, 16b + 16) of head h: rotate into k_rot and pack transposed (kt[blk8][d][j] = K[8 blk8 + j][d]). */
static void prepare_block(job_t *job, int h, long b) {
    float rows[KB * HEAD_DIM] __attribute__((aligned(32)));
    const float *k = job->k + h * job->k_head_stride;
    long n = job->num_keys - b * KB < KB ? job->num_keys - b * KB : KB;
    for (int j = 0; j < KB; j++) {
        long t = b * KB + j;
        if (j >= n) {
            memset(rows + j * HEAD_DIM, 0, HEAD_DIM * 4);
            continue;
        }
        const float *c = job->cos_t ? job->cos_t + t * HALF : NULL;
        const float *s = job->sin_t ? job->sin_t + t * HALF : NULL;
        rotate_row(k + t * HEAD_DIM, c, s, 1.0f, rows + j * HEAD_DIM);
    }
    if (job->k_rot)
        memcpy(job->k_rot + h * job->k_rot_head_stride + b * KB * HEAD_DIM, rows, n * HEAD_DIM * 4);
    float *dst = job->kt + ((long)h * job->num_blocks + b) * KB * HEAD_DIM;
    for (int half = 0; half < 2; half++)
        for (int d = 0; d < HEAD_DIM; d++)
            for (int j = 0; j < 8; j++)
                dst[(half * HEAD_DIM + d) * 8 + j] = rows[(half * 8 + j) * HEAD_DIM + d];
}

typedef struct {
    float q[ROWS * HEAD_DIM] __attribute__((aligned(32)));
    float s[ROWS * STEP] __attribute__((aligned(32)));  /* scores of one step, log2 units */
    float p[ROWS * STEP] __attribute__((aligned(32)));  /* their probabilities */
    float o[ROWS * HEAD_DIM] __attribute__((aligned(32)));
    float row_max[ROWS], row_sum[ROWS];
    int32_t pos[ROWS];
} tile_state;

/* s[:, 0:16] = Q K^T for the 16 keys packed at kb (two transposed 8-key blocks). The accumulators are
 * ROWS x 2 registers: loops over r are fully unrolled, so the arrays never touch memory. */
static inline void scores16(const float *q, const float *kb, float *s) {
    __m256 a[ROWS], b[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (int d = 0; d < HEAD_DIM; d++) {
        __m256 k0 = _mm256_load_ps(kb + d * 8), k1 = _mm256_load_ps(kb + (HEAD_DIM + d) * 8);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            __m256 x = _mm256_broadcast_ss(q + r * HEAD_DIM + d);
            a[r] = _mm256_fmadd_ps(x, k0, a[r]);
            b[r] = _mm256_fmadd_ps(x, k1, b[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        _mm256_store_ps(s + r * STEP, a[r]);
        _mm256_store_ps(s + r * STEP + 8, b[r]);
    }
}

/* o[:, c0:c0+16] += P[:, 0:n] V[0:n, c0:c0+16] with P = st->p, V rows at v. */
static inline void accumulate16(tile_state *st, const float *v, int n, int c0) {
    float *o = st->o + c0;
    const float *p = st->p;
    __m256 a[ROWS], b[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        a[r] = _mm256_load_ps(o + r * HEAD_DIM);
        b[r] = _mm256_load_ps(o + r * HEAD_DIM + 8);
    }
    for (int j = 0; j < n; j++) {
        __m256 v0 = _mm256_loadu_ps(v + j * HEAD_DIM + c0), v1 = _mm256_loadu_ps(v + j * HEAD_DIM + c0 + 8);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            __m256 x = _mm256_broadcast_ss(p + r * STEP + j);
            a[r] = _mm256_fmadd_ps(x, v0, a[r]);
            b[r] = _mm256_fmadd_ps(x, v1, b[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
        _mm256_store_ps(o + r * HEAD_DIM, a[r]);
        _mm256_store_ps(o + r * HEAD_DIM + 8, b[r]);
    }
}

/* Row m of st->s [16 * num_sub keys from key0] -> st->p = 2^(s - ref), exactly 0 for keys after the
 * row's position; returns the row's sum and, in *max_out, its max of s over allowed keys. */
static inline float exp_row(tile_state *st, int m, long key0, int width, int masked, float ref, float *max_out) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i p = _mm256_set1_epi32(st->pos[m]);
    const __m256 rv = _mm256_set1_ps(ref);
    const float *s = st->s + m * STEP;
    float *pr = st->p + m * STEP;
    __m256 sum = _mm256_setzero_ps(), mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < width; j += 8) {
        __m256 x = _mm256_load_ps(s + j);
        __m256 e = exp2_ps(_mm256_sub_ps(x, rv));
        if (masked) {  /* key > pos: weight 0, and the max ignores it */
            __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32((int)(key0 + j)));
            __m256 late = _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, p));
            e = _mm256_andnot_ps(late, e);
            x = _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), late);
        }
        mx = _mm256_max_ps(mx, x);
        sum = _mm256_add_ps(sum, e);
        _mm256_store_ps(pr + j, e);
    }
    *max_out = hmax8(mx);
    return hsum8(sum);
}

/* Max of row m of st->s over the keys the row may see (its first step has no reference max yet). */
static inline float row_max_of(const tile_state *st, int m, long key0, int width, int masked) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i p = _mm256_set1_epi32(st->pos[m]);
    const float *s = st->s + m * STEP;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < width; j += 8) {
        __m256 x = _mm256_load_ps(s + j);
        if (masked) {
            __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32((int)(key0 + j)));
            x = _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, p)));
        }
        mx = _mm256_max_ps(mx, x);
    }
    return hmax8(mx);
}

/* Online softmax of st->s [ROWS][16 * num_sub] (keys key0 ...) into st->p, one pass per row against the
 * row's reference max. Only when a row's max grows by more than RESCALE_LOG2 (in log2 units) is that row
 * redone against its new max, with O and its sum rescaled; in between, probabilities stay below
 * 2^RESCALE_LOG2, far inside fp32's range, and O / sum is unchanged (exact). masked: some key of the
 * step may lie after some row's position. */
static void softmax_step(tile_state *st, long key0, int num_sub, int masked) {
    const int width = num_sub * KB;
    for (int m = 0; m < ROWS; m++) {
        if (st->row_max[m] == -INFINITY)  /* first step: every row sees key 0, so this max is finite */
            st->row_max[m] = row_max_of(st, m, key0, width, masked);
        float step_max;
        float sum = exp_row(st, m, key0, width, masked, st->row_max[m], &step_max);
        if (step_max > st->row_max[m] + RESCALE_LOG2) {
            float alpha = exp2f(st->row_max[m] - step_max);
            st->row_sum[m] *= alpha;
            __m256 al = _mm256_set1_ps(alpha);
            for (int c = 0; c < HEAD_DIM; c += 8)
                _mm256_store_ps(st->o + m * HEAD_DIM + c, _mm256_mul_ps(_mm256_load_ps(st->o + m * HEAD_DIM + c), al));
            st->row_max[m] = step_max;
            sum = exp_row(st, m, key0, width, masked, step_max, &step_max);
        }
        st->row_sum[m] += sum;
    }
}

/* Query rows [m0, m0 + ROWS) of KV head h; row m is query row m / rep, query head h * rep + m % rep. */
static void attend_tile(job_t *job, int h, long m0) {
    tile_state st __attribute__((aligned(32)));
    const int rep = job->rep;
    const long num_q = job->num_rows * rep;
    const float c = job->scale * 1.4426950408889634f; /* scores in log2 units: softmax in base 2 */
    int valid = 0;
    for (int m = 0; m < ROWS; m++) {
        long qi = m0 + m;
        if (qi < num_q) {
            long r = qi / rep, t = job->pos[r];
            const float *cs = job->cos_t ? job->cos_t + t * HALF : NULL;
            const float *sn = job->sin_t ? job->sin_t + t * HALF : NULL;
            rotate_row(job->q + r * job->q_row_stride + (long)(h * rep + qi % rep) * HEAD_DIM, cs, sn, c,
                       st.q + m * HEAD_DIM);
            st.pos[m] = (int32_t)t;
            valid = m + 1;
        } else { /* padding rows: zeros at the last row's position, computed and dropped */
            memset(st.q + m * HEAD_DIM, 0, HEAD_DIM * 4);
            st.pos[m] = st.pos[valid - 1];
        }
        st.row_sum[m] = 0.0f;
        st.row_max[m] = -INFINITY;
    }
    memset(st.o, 0, sizeof st.o);
    const long first = st.pos[0], num_keys = (long)st.pos[ROWS - 1] + 1;
    const float *kt = job->kt + (long)h * job->num_blocks * KB * HEAD_DIM;
    const float *v = job->v + h * job->v_head_stride;
    for (long key0 = 0; key0 < num_keys; key0 += STEP) {
        const long left = num_keys - key0;
        const int n = left < STEP ? (int)left : STEP;  /* real keys of this step */
        const int num_sub = (n + KB - 1) / KB;
        for (int sb = 0; sb < num_sub; sb++)
            scores16(st.q, kt + (key0 / KB + sb) * KB * HEAD_DIM, st.s + sb * KB);
        softmax_step(&st, key0, num_sub, key0 + num_sub * KB - 1 > first);
        for (int c0 = 0; c0 < HEAD_DIM; c0 += 16)
            accumulate16(&st, v + key0 * HEAD_DIM, n, c0);
    }
    for (int m = 0; m < valid; m++) {
        long qi = m0 + m, r = qi / rep;
        float *dst = job->out + r * job->out_row_stride + (long)(h * rep + qi % rep) * HEAD_DIM;
        __m256 inv = _mm256_set1_ps(1.0f / st.row_sum[m]);
        for (int cc = 0; cc < HEAD_DIM; cc += 8)
            _mm256_storeu_ps(dst + cc, _mm256_mul_ps(_mm256_load_ps(st.o + m * HEAD_DIM + cc), inv));
    }
}

static void prepare_item(void *job, long item) {
    job_t *jb = (job_t *)job;
    prepare_block(jb, (int)(item / jb->num_blocks), item % jb->num_blocks);
}

static void attend_item(void *job, long item) {
    job_t *jb = (job_t *)job;
    int h;
    long m0;
    tile_of_item(item, jb->tiles_per_head, ROWS, &h, &m0);
    attend_tile(jb, h, m0);
}

/* Bytes of scratch a call with these sizes needs (transposed rotated K), 32-byte aligned. */
long kvb_rows_attention_scratch_bytes(long num_keys, int num_kv_heads) {
    return (long)num_kv_heads * ((num_keys + KB - 1) / KB) * KB * HEAD_DIM * 4;
}

/* Returns 0; -1 for arguments this kernel does not handle (the caller falls back). scratch: at least
 * kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads), 32-byte aligned, reused across calls. */
int kvb_rows_attention(const float *q, long q_row_stride, const float *k, long k_head_stride, const float *v,
                       long v_head_stride, float *k_rot, long k_rot_head_stride, const float *cos_t,
                       const float *sin_t, const int64_t *pos, long num_rows, long num_keys, int num_kv_heads,
                       int rep, int head_dim, float scale, float *out, long out_row_stride, void *scratch,
                       long scratch_bytes, int num_threads) {
    if (!rows_args_ok(head_dim, HEAD_DIM, num_rows, rep, num_kv_heads, num_threads, cos_t, sin_t, pos, num_keys,
                      scratch, 32, scratch_bytes, kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads)))
        return -1;
    job_t job = {.q = q, .q_row_stride = q_row_stride, .k = k, .v = v, .k_head_stride = k_head_stride,
                 .v_head_stride = v_head_stride, .k_rot = k_rot, .k_rot_head_stride = k_rot_head_stride,
                 .cos_t = cos_t, .sin_t = sin_t, .pos = pos, .num_rows = num_rows, .num_keys = num_keys,
                 .num_kv_heads = num_kv_heads, .rep = rep, .scale = scale, .out = out,
                 .out_row_stride = out_row_stride,
                 .num_threads = num_threads > MAX_THREADS ? MAX_THREADS : num_threads};
    job.num_blocks = (num_keys + KB - 1) / KB;
    job.tiles_per_head = (num_rows * rep + ROWS - 1) / ROWS;
    job.kt = (float *)scratch;
    run_parallel(&job, prepare_item, (long)num_kv_heads * job.num_blocks, job.num_threads, NULL, NULL);
    run_parallel(&job, attend_item, job.tiles_per_head * num_kv_heads, job.num_threads, NULL, NULL);
    return 0;
}
