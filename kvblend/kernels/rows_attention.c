/* One layer's attention for a sorted set of query rows, exact causal by absolute position, bf16 on
 * Intel AMX (or AVX512-BF16, below): CacheBlend's recomputed rows (scattered through the prompt) and
 * full prefill (every row).
 *
 * Query row r sits at absolute position pos[r] (ascending) and attends keys 0..pos[r]. Work is split
 * into tiles of 16 query rows of one KV head (GQA: a position's `rep` query heads are adjacent rows), so
 * a tile reads keys up to its last row's position only and masks just the keys after its first row's:
 * scattered rows cost what their scores cost, not a dense mask's.
 *
 * One call does, on num_threads threads:
 *   1. prepare: rotate every key (RoPE, from fp32 half tables indexed by position) into k_rot (the
 *      attention cache, kept for decoding) and pack K and V into AMX's pair-interleaved layouts;
 *   2. attend: per tile, rotate its queries, then per step of 128 keys: S = Q K^T on AMX (fp32), an
 *      online softmax on AVX-512, O += P V on AMX with O held in tile registers for the whole tile.
 *      A row's O and sum are rescaled only when its running max grows by more than 2^RESCALE_LOG2; in
 *      between, probabilities are taken against the older, smaller max (still exact: they stay
 *      below 2^RESCALE_LOG2, far inside fp32 and bf16 range).
 *   3. only with key_mass (kvb_rows_attention_mass): the attention each key receives, summed over rows
 *      and heads (lookahead's ranking), from the tiles' kept queries and final softmax terms.
 *
 * Built with -DKVB_NO_AMX, the same file is the avx512bf16 kernel for CPUs with AVX512-BF16 but no AMX
 * (AMD Zen 4): the same packed layouts, with S = Q K^T and O += P V on vdpbf16ps registers instead of
 * tiles (see the KVB_NO_AMX block).
 *
 * Built at first use by kvblend/kernels/__init__.py (gcc -O3 -mamx-tile -mamx-bf16 -mavx512bf16 ...), and
 * loaded only where /proc/cpuinfo lists those features. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rows_common.h"

typedef uint16_t bf16;

#include "rows_elementwise.h" /* RMSNorm and SiLU * up: the same bf16 builds */
#include "gemv.h"            /* a few rows' projections (decoding): the same bf16 builds */

#define ROWS 16   /* query rows per tile (AMX tile height) */
#define KB 32     /* keys per P tile (the bf16 dot product depth) */
#define STEP 128  /* keys per softmax step: 4 P tiles */
/* Built once per head size (-DKVB_HEAD_DIM=128 for Llama-3 / Mistral / Qwen2.5-1.5B and up). At 64, O lives in
 * 4 tiles of 16 fp32 columns for a whole tile of rows; at 128 it would need 8 (every tile there is), so it
 * lives in memory and is loaded into tiles 4..7 one half at a time per step of keys. */
#ifndef KVB_HEAD_DIM
#define KVB_HEAD_DIM 64
#endif
#define HEAD_DIM KVB_HEAD_DIM
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "KVB_HEAD_DIM must be 64 or 128"
#endif
#define O_IN_TILES (HEAD_DIM == 64)
#define HALF (HEAD_DIM / 2)
#define PAIRS (HEAD_DIM / 2)
#define RESCALE_LOG2 8.0f
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#ifndef KVB_NO_AMX
/* gcc 12's AMX intrinsics hide from the optimiser which memory they read: _tile_loadd declares none and
 * _tile_loadconfig 8 bytes. At -O3 it then dropped the tile config's colsb/rows stores (ldtilecfg faulted:
 * SIGSEGV), and it may sink stores to q/p buffers past the loads that read them. These declare it. */
#define tile_loadd(t, base, stride)                                                                   \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}"          \
                     : : "r"((const void *)(base)), "r"((long)(stride)) : "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Linux hands AMX state only to processes that ask for it (the caller checked the CPU flags).
 * Returns 0 when AMX is usable. */
int kvb_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

static void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = ROWS;
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); /* not _tile_loadconfig: see tile_loadd */
}
#endif

typedef struct {
    const bf16 *q;        /* q[r, hq, :] at q + r * q_row_stride + hq * HEAD_DIM (pre-RoPE) */
    long q_row_stride;
    const bf16 *k, *v;    /* k[h, t, :] at k + h * k_head_stride + t * HEAD_DIM (pre-RoPE); v likewise */
    long k_head_stride, v_head_stride;
    bf16 *k_rot;          /* rotated keys, same layout, k_rot_head_stride; NULL: not kept */
    long k_rot_head_stride;
    const float *cos_t, *sin_t; /* [position, HALF]; NULL: q and k are already rotated */
    const int64_t *pos;   /* [num_rows] ascending */
    long num_rows, num_keys; /* keys [0, num_keys) are prepared; num_keys > pos[num_rows - 1] */
    int num_kv_heads, rep;
    float scale;
    bf16 *out;            /* out[r, hq, :] at out + r * out_row_stride + hq * HEAD_DIM */
    long out_row_stride;
    int num_threads;
    uint32_t *kp;         /* [h][16-key block][PAIRS][16] : dword (2i, 2i+1) of each key */
    bf16 *vp;             /* [h][32-key block][16 key pairs][HEAD_DIM][2] */
    long num_blocks;      /* 32-key blocks per head */
    long tiles_per_head;
    float *key_mass;      /* [num_keys] += the attention each key receives, summed over rows and heads; or NULL */
    struct tile_kept *kept; /* [num_kv_heads * tiles_per_head] when key_mass: what the mass pass needs of a tile */
} job_t;

/* A tile's rotated queries and final softmax terms, kept by attend_tile for the key-mass pass. */
typedef struct tile_kept {
    bf16 q[ROWS * HEAD_DIM] __attribute__((aligned(64)));
    float ref[ROWS], inv_sum[ROWS]; /* probability of key j: 2^(S c - ref) * inv_sum */
    int32_t pos[ROWS];
    int valid; /* rows past it are padding */
} tile_kept;

/* dst[0:HEAD_DIM] = RoPE(src[0:HEAD_DIM]) with x1' = x1 c - x2 s, x2' = x2 c + x1 s (HF rotate_half convention),
 * in fp32, rounded once to bf16. c, s: NULL copies. */
static inline void rotate_row(const bf16 *src, const float *c, const float *s, bf16 *dst) {
    if (!c) {
        memcpy(dst, src, HEAD_DIM * 2);
        return;
    }
    for (int i = 0; i < HALF; i += 16) {
        __m512 x1 = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(src + i)));
        __m512 x2 = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(src + HALF + i)));
        __m512 cc = _mm512_loadu_ps(c + i), ss = _mm512_loadu_ps(s + i);
        __m512 y1 = _mm512_fmsub_ps(x1, cc, _mm512_mul_ps(x2, ss));
        __m512 y2 = _mm512_fmadd_ps(x2, cc, _mm512_mul_ps(x1, ss));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(y1));
        _mm256_storeu_si256((__m256i *)(dst + HALF + i), (__m256i)_mm512_cvtneps_pbh(y2));
    }
}

/* 2^x for finite x (scores are finite; x far below -126 gives 0 under FTZ, as probabilities that small
 * should): f = x - floor(x) in [0, 1) in one vreduceps, a degree-3 minimax polynomial for 2^f (relative
 * error < 7.5e-5, far below bf16's 2^-9, the rounding P gets before P V), then scalef, which multiplies by
 * 2^floor(x) itself. Six uops a vector, the softmax's main cost. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(7.802452147e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.260671705e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335042e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251962e-1f));
    return _mm512_scalef_ps(p, x);
}

/* The first n lanes of a 16-lane vector (all for n >= 16, none for n <= 0): a row's or block's tail. */
static inline __mmask16 first_lanes(long n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

#include "decode_attention.h" /* one query row per sequence while decoding: both bf16 builds */

/* Keys [32b, 32b + 32) of head h: rotate into k_rot, pack K (dword transpose per 16 keys) and V
 * (pairs of keys interleaved). Keys past num_keys pack as zeros. */
static void prepare_block(job_t *job, int h, long b) {
    bf16 rows[KB * HEAD_DIM] __attribute__((aligned(64)));
    const bf16 *k = job->k + h * job->k_head_stride;
    const bf16 *v = job->v + h * job->v_head_stride;
    for (int j = 0; j < KB; j++) {
        long t = b * KB + j;
        if (t >= job->num_keys) {
            memset(rows + j * HEAD_DIM, 0, HEAD_DIM * 2);
            continue;
        }
        const float *c = job->cos_t ? job->cos_t + t * HALF : NULL;
        const float *s = job->sin_t ? job->sin_t + t * HALF : NULL;
        rotate_row(k + t * HEAD_DIM, c, s, rows + j * HEAD_DIM);
    }
    if (job->k_rot) {
        long n = job->num_keys - b * KB < KB ? job->num_keys - b * KB : KB;
        memcpy(job->k_rot + h * job->k_rot_head_stride + b * KB * HEAD_DIM, rows, n * HEAD_DIM * 2);
    }
    /* kp[blk16][i][j] = dword i of key j: a gather per pair i */
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(PAIRS));
    for (int half = 0; half < 2; half++) {
        uint32_t *dst = job->kp + ((long)h * job->num_blocks * 2 + 2 * b + half) * PAIRS * 16;
        const int *src = (const int *)(rows + half * 16 * HEAD_DIM);
        for (int i = 0; i < PAIRS; i++)
            _mm512_store_si512(dst + i * 16, _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(i)), src, 4));
    }
    /* vp[blk][i][c][t] = V[32b + 2i + t][c] */
    bf16 *dst = job->vp + ((long)h * job->num_blocks + b) * KB * HEAD_DIM;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < KB / 2; i++) {
        long t0 = b * KB + 2 * i, t1 = t0 + 1;
        for (int c = 0; c < HEAD_DIM; c += 32) {
            __m512i a = t0 < job->num_keys ? _mm512_loadu_si512(v + t0 * HEAD_DIM + c) : _mm512_setzero_si512();
            __m512i z = t1 < job->num_keys ? _mm512_loadu_si512(v + t1 * HEAD_DIM + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (i * HEAD_DIM + c) * 2, _mm512_permutex2var_epi16(a, lo, z));
            _mm512_storeu_si512(dst + (i * HEAD_DIM + c) * 2 + 32, _mm512_permutex2var_epi16(a, hi, z));
        }
    }
}

typedef struct {
    bf16 q[ROWS * HEAD_DIM] __attribute__((aligned(64)));
    float s[ROWS * STEP] __attribute__((aligned(64)));
    bf16 p[ROWS * STEP] __attribute__((aligned(64)));
    float o[ROWS * HEAD_DIM] __attribute__((aligned(64)));
    float row_max[ROWS], row_sum[ROWS], alpha[ROWS];
    int32_t pos[ROWS];
} tile_state;

/* o [ROWS][HEAD_DIM] row m *= alpha[m] (the rows whose running max grew). */
static void scale_rows(float *o, const float *alpha) {
    for (int m = 0; m < ROWS; m++)
        for (int c = 0; c < HEAD_DIM; c += 16)
            _mm512_store_ps(o + m * HEAD_DIM + c, _mm512_mul_ps(_mm512_load_ps(o + m * HEAD_DIM + c),
                                                                _mm512_set1_ps(alpha[m])));
}

#ifndef KVB_NO_AMX
/* O accumulator tiles 4..7 (16 fp32 columns each) <-> obuf [16][HEAD_DIM] columns 0..63; tile numbers must
 * be constants. */
static inline void store_o(float *obuf) {
    _tile_stored(4, obuf, HEAD_DIM * 4);
    _tile_stored(5, obuf + 16, HEAD_DIM * 4);
    _tile_stored(6, obuf + 32, HEAD_DIM * 4);
    _tile_stored(7, obuf + 48, HEAD_DIM * 4);
}

static inline void load_o(const float *obuf) {
    tile_loadd(4, obuf, HEAD_DIM * 4);
    tile_loadd(5, obuf + 16, HEAD_DIM * 4);
    tile_loadd(6, obuf + 32, HEAD_DIM * 4);
    tile_loadd(7, obuf + 48, HEAD_DIM * 4);
}

#if O_IN_TILES
/* O lives in tiles 4..7 for the whole tile of rows: zeroed at its start, stored to st->o at its end. */
static inline void o_begin(tile_state *st) {
    (void)st;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
}

static inline void o_end(tile_state *st) { store_o(st->o); }

static void o_rescale(tile_state *st) {
    store_o(st->o);
    scale_rows(st->o, st->alpha);
    load_o(st->o);
}
#else
/* O lives in st->o; accumulate_pv loads and stores one 64-column half at a time. */
static inline void o_begin(tile_state *st) { memset(st->o, 0, sizeof st->o); }

static inline void o_end(tile_state *st) { (void)st; }

static void o_rescale(tile_state *st) { scale_rows(st->o, st->alpha); }
#endif

/* S[:, 0 : 32 * num_sub] = Q K^T for the 32-key blocks blk0 .. blk0 + num_sub - 1. */
static inline void scores(const tile_state *st, const uint32_t *kp, long blk0, int num_sub, float *s) {
    for (int sb = 0; sb < num_sub; sb++) {
        const uint32_t *kb = kp + (2 * (blk0 + sb)) * PAIRS * 16;
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < HEAD_DIM / 32; c++) { /* 32 dims (16 pairs) of Q and of each 16-key block */
            tile_loadd(0, st->q + 32 * c, HEAD_DIM * 2);
            tile_loadd(1, kb + c * 16 * 16, 64);
            _tile_dpbf16ps(2, 0, 1);
            tile_loadd(1, kb + PAIRS * 16 + c * 16 * 16, 64);
            _tile_dpbf16ps(3, 0, 1);
        }
        _tile_stored(2, s + sb * KB, STEP * 4);
        _tile_stored(3, s + sb * KB + 16, STEP * 4);
    }
}

/* O += P V for the same blocks (P in st->p). */
static inline void accumulate_pv(tile_state *st, const bf16 *vp, long blk0, int num_sub) {
    for (int half = 0; half < HEAD_DIM / 64; half++) { /* 64 columns of O (4 tiles) at a time */
#if !O_IN_TILES
        load_o(st->o + 64 * half);
#endif
        for (int sb = 0; sb < num_sub; sb++) {
            const bf16 *vb = vp + (blk0 + sb) * KB * HEAD_DIM + 128 * half;
            tile_loadd(0, st->p + sb * KB, STEP * 2);
            tile_loadd(1, vb, HEAD_DIM * 4);
            _tile_dpbf16ps(4, 0, 1);
            tile_loadd(2, vb + 32, HEAD_DIM * 4);
            _tile_dpbf16ps(5, 0, 2);
            tile_loadd(3, vb + 64, HEAD_DIM * 4);
            _tile_dpbf16ps(6, 0, 3);
            tile_loadd(1, vb + 96, HEAD_DIM * 4);
            _tile_dpbf16ps(7, 0, 1);
        }
#if !O_IN_TILES
        store_o(st->o + 64 * half);
#endif
    }
}

#else /* KVB_NO_AMX */
/* The same layouts, dot products on AVX512-BF16 registers (vdpbf16ps: 16 fp32 lanes, each the dot
 * product of one bf16 pair), for CPUs with AVX512-BF16 but no AMX (AMD Zen 4). A broadcast dword of Q
 * (two adjacent dims of one row) against a kp row (that dim pair of 16 keys) gives 16 scores of one row;
 * a broadcast dword of P (two adjacent keys) against a vp row (those keys' 16 columns) gives 16 outputs. */
static inline void o_begin(tile_state *st) { memset(st->o, 0, sizeof st->o); }

static inline void o_end(tile_state *st) { (void)st; }

static void o_rescale(tile_state *st) { scale_rows(st->o, st->alpha); }

/* S[:, 0 : 32 * num_sub] = Q K^T, one 16-key block at a time: ROWS accumulators, one K load per dim pair. */
static inline void scores(const tile_state *st, const uint32_t *kp, long blk0, int num_sub, float *s) {
    const uint32_t *q = (const uint32_t *)st->q; /* row m's dim pair i: q[m * PAIRS + i] */
    for (int b = 0; b < 2 * num_sub; b++) {
        const uint32_t *kb = kp + (2 * blk0 + b) * PAIRS * 16;
        __m512 acc[ROWS];
#pragma GCC unroll 16
        for (int m = 0; m < ROWS; m++) acc[m] = _mm512_setzero_ps();
        for (int i = 0; i < PAIRS; i++) {
            const __m512bh k = (__m512bh)_mm512_load_si512(kb + i * 16);
#pragma GCC unroll 16
            for (int m = 0; m < ROWS; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32((int)q[m * PAIRS + i]), k);
        }
#pragma GCC unroll 16
        for (int m = 0; m < ROWS; m++) _mm512_store_ps(s + m * STEP + 16 * b, acc[m]);
    }
}

/* O += P V for the same blocks, 16 columns of O at a time held in ROWS registers. */
static inline void accumulate_pv(tile_state *st, const bf16 *vp, long blk0, int num_sub) {
    const uint32_t *p = (const uint32_t *)st->p; /* row m's key pair j of the step: p[m * STEP / 2 + j] */
    for (int c0 = 0; c0 < HEAD_DIM; c0 += 16) {
        __m512 acc[ROWS];
#pragma GCC unroll 16
        for (int m = 0; m < ROWS; m++) acc[m] = _mm512_load_ps(st->o + m * HEAD_DIM + c0);
        for (int j = 0; j < num_sub * KB / 2; j++) {
            /* vp[blk][i][c][t] = V[32 blk + 2 i + t][c]: pair j of the step is pair j % 16 of block j / 16 */
            const bf16 *vb = vp + (blk0 + j / (KB / 2)) * KB * HEAD_DIM + ((j % (KB / 2)) * HEAD_DIM + c0) * 2;
            const __m512bh v = (__m512bh)_mm512_load_si512(vb);
#pragma GCC unroll 16
            for (int m = 0; m < ROWS; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32((int)p[m * (STEP / 2) + j]), v);
        }
#pragma GCC unroll 16
        for (int m = 0; m < ROWS; m++) _mm512_store_ps(st->o + m * HEAD_DIM + c0, acc[m]);
    }
}

#endif

/* Row maxima (scaled to log2 units) of st->s [16][32 * num_sub]; keys after a row's position excluded. */
static void row_maxima(const tile_state *st, const float *sbuf, long key0, int num_sub, int masked, float c,
                       float *out) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int m = 0; m < ROWS; m++) {
        const float *s = sbuf + m * STEP;
        const __m512i p = _mm512_set1_epi32(st->pos[m]);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < 2 * num_sub; j++) {
            __mmask16 ok = masked ? _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * j))), p)
                                  : 0xFFFF;
            mx = _mm512_mask_max_ps(mx, ok, mx, _mm512_load_ps(s + 16 * j));
        }
        out[m] = _mm512_reduce_max_ps(mx) * c;
    }
}

/* P row m = 2^(S c - ref) (exactly 0 after the row's position) into st->p; returns the row's sum and,
 * in *max_out, the row's max of S c over allowed keys. */
static inline float exp_row(tile_state *st, const float *sbuf, int m, long key0, int num_sub, int masked, float c,
                            float ref, float *max_out) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const float *s = sbuf + m * STEP;
    bf16 *pr = st->p + m * STEP;
    const __m512 cv = _mm512_set1_ps(c), rv = _mm512_set1_ps(ref);
    const __m512i p = _mm512_set1_epi32(st->pos[m]);
    __m512 sum = _mm512_setzero_ps(), mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < 2 * num_sub; j += 2) {
        __m512 x0 = _mm512_load_ps(s + 16 * j), x1 = _mm512_load_ps(s + 16 * j + 16);
        __m512 e0 = exp2_ps(_mm512_fmsub_ps(x0, cv, rv)), e1 = exp2_ps(_mm512_fmsub_ps(x1, cv, rv));
        __mmask16 ok0 = 0xFFFF, ok1 = 0xFFFF;
        if (masked) {
            __m512i k0 = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * j)));
            ok0 = _mm512_cmple_epi32_mask(k0, p);
            ok1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(k0, _mm512_set1_epi32(16)), p);
            e0 = _mm512_maskz_mov_ps(ok0, e0);
            e1 = _mm512_maskz_mov_ps(ok1, e1);
        }
        mx = _mm512_mask_max_ps(mx, ok0, mx, x0);
        mx = _mm512_mask_max_ps(mx, ok1, mx, x1);
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_store_si512(pr + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    *max_out = _mm512_reduce_max_ps(mx) * c;
    return _mm512_reduce_add_ps(sum);
}

/* Online softmax over sbuf [16][32 * num_sub] (keys key0 ...) into st->p; masked: some key may lie
 * after some row's position. One pass against each row's reference max; the rare row whose max grew
 * by more than RESCALE_LOG2 is redone against its new max, and O and its sum are rescaled. */
static void softmax_step(tile_state *st, const float *sbuf, long key0, int num_sub, int masked, float c,
                         int first_step) {
    if (first_step) /* no reference yet: the block's own maxima */
        row_maxima(st, sbuf, key0, num_sub, masked, c, st->row_max);
    float step_sum[ROWS], step_max[ROWS];
    int redo = 0;
    for (int m = 0; m < ROWS; m++) {
        step_sum[m] = exp_row(st, sbuf, m, key0, num_sub, masked, c, st->row_max[m], &step_max[m]);
        redo |= step_max[m] > st->row_max[m] + RESCALE_LOG2;
    }
    if (redo) {
        for (int m = 0; m < ROWS; m++) {
            st->alpha[m] = 1.0f;
            if (step_max[m] > st->row_max[m] + RESCALE_LOG2) {
                float unused;
                st->alpha[m] = exp2f(st->row_max[m] - step_max[m]);
                st->row_max[m] = step_max[m];
                step_sum[m] = exp_row(st, sbuf, m, key0, num_sub, masked, c, step_max[m], &unused);
            }
            st->row_sum[m] *= st->alpha[m];
        }
        o_rescale(st);
    }
    for (int m = 0; m < ROWS; m++) st->row_sum[m] += step_sum[m];
}

/* 32-key blocks of the step starting at key0 (the last step may be partial). */
static inline int sub_blocks(long num_keys, long key0) {
    long left = num_keys - key0;
    return left >= STEP ? STEP / KB : (int)((left + KB - 1) / KB);
}

/* Query rows [m0, m0 + 16) of KV head h; row m is query row m / rep, query head h * rep + m % rep. */
static void attend_tile(job_t *job, int h, long m0) {
    tile_state st __attribute__((aligned(64)));
    const int rep = job->rep;
    const long num_q = job->num_rows * rep;
    int valid = 0;
    for (int m = 0; m < ROWS; m++) {
        long qi = m0 + m;
        if (qi < num_q) {
            long r = qi / rep, t = job->pos[r];
            const float *c = job->cos_t ? job->cos_t + t * HALF : NULL;
            const float *s = job->sin_t ? job->sin_t + t * HALF : NULL;
            rotate_row(job->q + r * job->q_row_stride + (long)(h * rep + qi % rep) * HEAD_DIM, c, s, st.q + m * HEAD_DIM);
            st.pos[m] = (int32_t)t;
            valid = m + 1;
        } else { /* padding rows: zeros at the last row's position, computed and dropped */
            memset(st.q + m * HEAD_DIM, 0, HEAD_DIM * 2);
            st.pos[m] = st.pos[valid - 1];
        }
        st.row_sum[m] = 0.0f;
        st.row_max[m] = -INFINITY;
    }
    const long first = st.pos[0], num_keys = (long)st.pos[ROWS - 1] + 1;
    const float c = job->scale * 1.4426950408889634f; /* softmax in base 2 */
    const uint32_t *kp = job->kp + (long)h * job->num_blocks * 2 * PAIRS * 16;
    const bf16 *vp = job->vp + (long)h * job->num_blocks * KB * HEAD_DIM;
    o_begin(&st);
    for (long key0 = 0; key0 < num_keys; key0 += STEP) {
        const int num_sub = sub_blocks(num_keys, key0);
        const int masked = key0 + num_sub * KB - 1 > first;
        scores(&st, kp, key0 / KB, num_sub, st.s);
        softmax_step(&st, st.s, key0, num_sub, masked, c, key0 == 0);
        accumulate_pv(&st, vp, key0 / KB, num_sub);
    }
    o_end(&st);
    for (int m = 0; m < valid; m++) {
        long qi = m0 + m, r = qi / rep;
        bf16 *dst = job->out + r * job->out_row_stride + (long)(h * rep + qi % rep) * HEAD_DIM;
        __m512 inv = _mm512_set1_ps(1.0f / st.row_sum[m]);
        for (int cc = 0; cc < HEAD_DIM; cc += 32) {
            __m512 a = _mm512_mul_ps(_mm512_load_ps(st.o + m * HEAD_DIM + cc), inv);
            __m512 z = _mm512_mul_ps(_mm512_load_ps(st.o + m * HEAD_DIM + cc + 16), inv);
            _mm512_storeu_si512(dst + cc, (__m512i)_mm512_cvtne2ps_pbh(z, a));
        }
    }
    if (job->kept) {
        tile_kept *kt = job->kept + h * job->tiles_per_head + m0 / ROWS;
        memcpy(kt->q, st.q, sizeof kt->q);
        memcpy(kt->pos, st.pos, sizeof kt->pos);
        for (int m = 0; m < ROWS; m++) {
            kt->ref[m] = st.row_max[m];
            kt->inv_sum[m] = 1.0f / st.row_sum[m];
        }
        kt->valid = valid;
    }
}

/* Key-mass pass, one step of STEP keys: every kept tile's probabilities over these keys (scores again,
 * against the tile's final max and sum), summed over its rows into key_mass. Steps own disjoint keys, so
 * threads never add to the same entry. */
static void mass_item(void *jobp, long step) {
    job_t *job = (job_t *)jobp;
    tile_state st __attribute__((aligned(64)));
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const long key0 = step * STEP;
    const int num_sub = sub_blocks(job->num_keys, key0);
    const float c = job->scale * 1.4426950408889634f;
    __m512 acc[STEP / 16];
    for (int j = 0; j < 2 * num_sub; j++) acc[j] = _mm512_setzero_ps();
    for (int h = 0; h < job->num_kv_heads; h++) {
        const uint32_t *kp = job->kp + (long)h * job->num_blocks * 2 * PAIRS * 16;
        for (long t = 0; t < job->tiles_per_head; t++) {
            const tile_kept *kt = job->kept + h * job->tiles_per_head + t;
            if (kt->pos[kt->valid - 1] < key0) continue; /* every row of the tile precedes these keys */
            memcpy(st.q, kt->q, sizeof st.q);
            scores(&st, kp, key0 / KB, num_sub, st.s);
            for (int m = 0; m < kt->valid; m++) {
                const __m512 cv = _mm512_set1_ps(c), rv = _mm512_set1_ps(kt->ref[m]), inv = _mm512_set1_ps(kt->inv_sum[m]);
                const __m512i p = _mm512_set1_epi32(kt->pos[m]);
                for (int j = 0; j < 2 * num_sub; j++) {
                    __mmask16 ok = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * j))), p);
                    __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(st.s + m * STEP + 16 * j), cv, rv));
                    acc[j] = _mm512_mask3_fmadd_ps(e, inv, acc[j], ok);
                }
            }
        }
    }
    for (int j = 0; j < 2 * num_sub; j++) {
        long k = key0 + 16 * j, left = job->num_keys - k;
        __mmask16 in = first_lanes(left); /* the last block's tail */
        _mm512_mask_storeu_ps(job->key_mass + k, in, _mm512_add_ps(_mm512_maskz_loadu_ps(in, job->key_mass + k), acc[j]));
    }
}

/* One item is a block of keys in every head: the block's RoPE tables (8 KB) are read from memory once, not
 * once a head. Preparing 6,254 keys of 3 heads (a 1-row call) took 0.59 ms against 0.66 ms by head and block. */
static void prepare_item(void *job, long item) {
    job_t *jb = (job_t *)job;
    for (int h = 0; h < jb->num_kv_heads; h++)
        prepare_block(jb, h, item);
}

static void attend_item(void *job, long item) {
    job_t *jb = (job_t *)job;
    int h;
    long m0;
    tile_of_item(item, jb->tiles_per_head, ROWS, &h, &m0);
    attend_tile(jb, h, m0);
}

#ifndef KVB_NO_AMX
static void tile_release(void) { _tile_release(); }
#define THREAD_BEGIN load_tile_config /* each thread's tile shapes, and releasing its tile state */
#define THREAD_END tile_release
#include "amx_linear.h" /* the recomputed rows' projections share the build and the tile config */
#else
#define THREAD_BEGIN NULL
#define THREAD_END NULL
#endif

/* Bytes of scratch a call with these sizes needs (packed K and V), 64-byte aligned. */
long kvb_rows_attention_scratch_bytes(long num_keys, int num_kv_heads) {
    return 2L * num_kv_heads * ((num_keys + KB - 1) / KB) * KB * HEAD_DIM * 2;
}

/* Returns 0; -1 for arguments this kernel does not handle (the caller falls back). scratch: at least
 * kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads), 64-byte aligned, reused across calls so its
 * pages are not faulted in again every layer. key_mass: NULL, or [num_keys] fp32 to which each key's
 * attention probability, summed over every row and query head, is added (lookahead's ranking: a second
 * pass over the scores, against each row's final softmax max and sum). */
int kvb_rows_attention_mass(const bf16 *q, long q_row_stride, const bf16 *k, long k_head_stride, const bf16 *v,
                            long v_head_stride, bf16 *k_rot, long k_rot_head_stride, const float *cos_t,
                            const float *sin_t, const int64_t *pos, long num_rows, long num_keys, int num_kv_heads,
                            int rep, int head_dim, float scale, bf16 *out, long out_row_stride, void *scratch,
                            long scratch_bytes, int num_threads, float *key_mass) {
    if (!rows_args_ok(head_dim, HEAD_DIM, num_rows, rep, num_kv_heads, num_threads, cos_t, sin_t, pos, num_keys,
                      scratch, 64, scratch_bytes, kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads)))
        return -1;
    job_t job = {.q = q, .q_row_stride = q_row_stride, .k = k, .v = v, .k_head_stride = k_head_stride,
                 .v_head_stride = v_head_stride, .k_rot = k_rot, .k_rot_head_stride = k_rot_head_stride,
                 .cos_t = cos_t, .sin_t = sin_t, .pos = pos, .num_rows = num_rows, .num_keys = num_keys,
                 .num_kv_heads = num_kv_heads, .rep = rep, .scale = scale, .out = out,
                 .out_row_stride = out_row_stride,
                 .num_threads = num_threads > MAX_THREADS ? MAX_THREADS : num_threads, .key_mass = key_mass};
    job.num_blocks = (num_keys + KB - 1) / KB;
    job.tiles_per_head = (num_rows * rep + ROWS - 1) / ROWS;
    job.kp = (uint32_t *)scratch;
    job.vp = (bf16 *)((char *)scratch + kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads) / 2);
    if (key_mass && num_rows > 0) {
        job.kept = aligned_alloc(64, sizeof(tile_kept) * num_kv_heads * job.tiles_per_head);
        if (!job.kept) return -1;
    }
    run_parallel(&job, prepare_item, job.num_blocks, job.num_threads, NULL, NULL);
    run_parallel(&job, attend_item, job.tiles_per_head * num_kv_heads, job.num_threads, THREAD_BEGIN, THREAD_END);
    if (job.kept) {
        run_parallel(&job, mass_item, (num_keys + STEP - 1) / STEP, job.num_threads, THREAD_BEGIN, THREAD_END);
        free(job.kept);
    }
    return 0;
}

int kvb_rows_attention(const bf16 *q, long q_row_stride, const bf16 *k, long k_head_stride, const bf16 *v,
                       long v_head_stride, bf16 *k_rot, long k_rot_head_stride, const float *cos_t,
                       const float *sin_t, const int64_t *pos, long num_rows, long num_keys, int num_kv_heads,
                       int rep, int head_dim, float scale, bf16 *out, long out_row_stride, void *scratch,
                       long scratch_bytes, int num_threads) {
    return kvb_rows_attention_mass(q, q_row_stride, k, k_head_stride, v, v_head_stride, k_rot, k_rot_head_stride,
                                   cos_t, sin_t, pos, num_rows, num_keys, num_kv_heads, rep, head_dim, scale, out,
                                   out_row_stride, scratch, scratch_bytes, num_threads, NULL);
}
