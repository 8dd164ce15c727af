/* y = x W^T (+ bias) in bf16 on Intel AMX with our own two-level split over threads: the projections of
 * CacheBlend's recomputed rows. Included by rows_attention.c in its AMX build only (it needs that file's
 * tile_loadd and load_tile_config, all 8 tiles 16 rows x 64 bytes).
 *
 * Why not oneDNN: on a 2-core Sapphire Rapids it ran SmolLM2's projections at 700-1,300 rows no faster on
 * two threads than on one (o_proj 960 x 576 x 576: 0.48 ms either way; down_proj 960 x 1536 x 576: 1.5 ms on
 * two threads, 1.3 on one), and a blend's recomputed set is ~1,000 rows. Full prefill's blocks of
 * 3,000-4,000 rows parallelise well there.
 *
 * Weights are packed once (kvb_linear_pack) into AMX's pair-interleaved B layout, per 32 output columns
 * and 32 inputs: two 16 x 16 x 2 tiles. A work item is a block of 32 rows x 32 columns: C tiles 0..3
 * (rows 0-15 / 16-31 x columns 0-15 / 16-31), A tiles 4 and 5, B tiles 6 and 7. Accumulation is fp32,
 * the bias is added in fp32 and the result rounded once to bf16 (round to nearest even), as oneDNN does. */
#ifndef KVB_AMX_LINEAR_H
#define KVB_AMX_LINEAR_H

#define LIN_BLOCK 32 /* rows and columns of a work item; also the K step (one bf16 tile's depth) */

typedef struct {
    const bf16 *x;    /* [m, k], row stride ldx */
    long ldx, m, k, n;
    const bf16 *wp;   /* packed [n / 32][k / 32][2 tiles][16 pairs][16 columns][2] */
    const float *bias; /* [n] or NULL */
    const bf16 *residual; /* [m, n], row stride ldr, added after the product is rounded; or NULL */
    long ldr;
    bf16 *y;          /* [m, n], row stride ldy */
    long ldy;
    long num_row_blocks, num_col_blocks;
    const bf16 *tail; /* the last partial 16-row block's x rows, zero padded to 16 rows [16, k]; or NULL */
    long tail_row;    /* first row of that block */
} linear_job;

/* Column block nb of the packed weight, K step ks, tile t (columns 16t .. 16t + 15 of the block). */
static inline const bf16 *packed_tile(const linear_job *jb, long nb, long ks, int t) {
    return jb->wp + ((nb * (jb->k / LIN_BLOCK) + ks) * 2 + t) * 512;
}

/* fp32 rows (stride 32) + bias -> bf16 y rows [row0, row0 + num_rows), columns [col0, col0 + 32). */
static void linear_store(const linear_job *jb, const float *acc, long row0, int num_rows, long col0) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (jb->bias) {
        b0 = _mm512_loadu_ps(jb->bias + col0);
        b1 = _mm512_loadu_ps(jb->bias + col0 + 16);
    }
    for (int r = 0; r < num_rows; r++) {
        __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + r * 32), b0);
        __m512 hi = _mm512_add_ps(_mm512_load_ps(acc + r * 32 + 16), b1);
        if (jb->residual) { /* as PyTorch's residual + linear(x): the product rounded, then the sum */
            const bf16 *res = jb->residual + (row0 + r) * jb->ldr + col0;
            lo = _mm512_add_ps(round_bf16(lo), load_bf16(res));
            hi = _mm512_add_ps(round_bf16(hi), load_bf16(res + 16));
        }
        _mm512_storeu_si512(jb->y + (row0 + r) * jb->ldy + col0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Rows [row0, row0 + 32) (two A tiles) x columns of block nb; x0/x1: the two 16-row halves' first rows. */
static void linear_block32(const linear_job *jb, const bf16 *x0, const bf16 *x1, long ldx, long nb, long row0,
                           int num_rows) {
    float acc[32 * 32] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long ks = 0; ks < jb->k / LIN_BLOCK; ks++) {
        tile_loadd(4, x0 + ks * LIN_BLOCK, ldx * 2);
        tile_loadd(5, x1 + ks * LIN_BLOCK, ldx * 2);
        tile_loadd(6, packed_tile(jb, nb, ks, 0), 64);
        tile_loadd(7, packed_tile(jb, nb, ks, 1), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
    linear_store(jb, acc, row0, num_rows, nb * LIN_BLOCK);
}

/* One 16-row block (the last one of an m that is not a multiple of 32) x columns of block nb. */
static void linear_block16(const linear_job *jb, const bf16 *x0, long ldx, long nb, long row0, int num_rows) {
    float acc[16 * 32] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    for (long ks = 0; ks < jb->k / LIN_BLOCK; ks++) {
        tile_loadd(4, x0 + ks * LIN_BLOCK, ldx * 2);
        tile_loadd(6, packed_tile(jb, nb, ks, 0), 64);
        tile_loadd(7, packed_tile(jb, nb, ks, 1), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    linear_store(jb, acc, row0, num_rows, nb * LIN_BLOCK);
}

/* Column blocks per work item: the item's 32 input rows stay in L1 across them. Measured (2-core Sapphire
 * Rapids, 960 rows) against one block an item: o_proj 0.37 against 0.43 ms, down_proj 0.84 against 1.07,
 * gate_up 1.92 against 2.68 (oneDNN: 1.61). */
#define LIN_GROUP 4

/* Rows [32 rb, 32 rb + 32) x columns of block nb (a partial last row block through the padded tail). */
static void linear_block(const linear_job *jb, long nb, long rb) {
    long row0 = rb * LIN_BLOCK;
    long rows = jb->m - row0 < LIN_BLOCK ? jb->m - row0 : LIN_BLOCK;
    const bf16 *x0 = jb->x + row0 * jb->ldx;
    if (rows == LIN_BLOCK) {
        linear_block32(jb, x0, x0 + 16 * jb->ldx, jb->ldx, nb, row0, LIN_BLOCK);
        return;
    }
    long full16 = rows >= 16 ? 16 : 0; /* a whole first half, then the padded tail */
    if (full16)
        linear_block16(jb, x0, jb->ldx, nb, row0, 16);
    if (rows > full16)
        linear_block16(jb, jb->tail, jb->k, nb, jb->tail_row, (int)(rows - full16));
}

/* Item -> (group of LIN_GROUP column blocks, row block), groups outermost so the threads share a group's
 * packed weight panels while they walk the rows. */
static void linear_item(void *job, long item) {
    const linear_job *jb = (const linear_job *)job;
    long group = item / jb->num_row_blocks, rb = item % jb->num_row_blocks;
    for (long nb = group * LIN_GROUP; nb < (group + 1) * LIN_GROUP && nb < jb->num_col_blocks; nb++)
        linear_block(jb, nb, rb);
}

/* Pack w [n, k] (row-major bf16) for kvb_linear. Returns -1 unless n and k are multiples of 32. */
int kvb_linear_pack(const bf16 *w, long n, long k, bf16 *packed) {
    if (n <= 0 || k <= 0 || n % LIN_BLOCK || k % LIN_BLOCK)
        return -1;
    long ksteps = k / LIN_BLOCK;
    for (long nb = 0; nb < n / LIN_BLOCK; nb++)
        for (long ks = 0; ks < ksteps; ks++)
            for (int t = 0; t < 2; t++) {
                bf16 *dst = packed + ((nb * ksteps + ks) * 2 + t) * 512;
                for (int pr = 0; pr < 16; pr++)
                    for (int c = 0; c < 16; c++)
                        for (int p = 0; p < 2; p++)
                            dst[pr * 32 + c * 2 + p] = w[(nb * LIN_BLOCK + t * 16 + c) * k + ks * LIN_BLOCK + 2 * pr + p];
            }
    return 0;
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias (+ residual), W packed by
 * kvb_linear_pack. bias: fp32 [n] or NULL; residual: [m, n] (row stride ldr) or NULL, added to the
 * rounded product and rounded again (two roundings, as a separate add would). Returns 0; -1 for shapes it
 * does not take (the caller falls back). */
int kvb_linear(const bf16 *x, long ldx, long m, long k, const bf16 *packed, long n, const float *bias,
               const bf16 *residual, long ldr, bf16 *y, long ldy, int num_threads) {
    if (m <= 0 || n <= 0 || k <= 0 || n % LIN_BLOCK || k % LIN_BLOCK || ldx < k || ldy < n || num_threads <= 0 ||
        (residual && ldr < n))
        return -1;
    linear_job jb = {.x = x, .ldx = ldx, .m = m, .k = k, .n = n, .wp = packed, .bias = bias, .residual = residual,
                     .ldr = ldr, .y = y, .ldy = ldy,
                     .num_row_blocks = (m + LIN_BLOCK - 1) / LIN_BLOCK, .num_col_blocks = n / LIN_BLOCK};
    bf16 *tail = NULL;
    long part = m % 16;
    if (part) { /* rows past the last whole 16 go through a zero-padded copy: tiles load 16 rows */
        tail = (bf16 *)aligned_alloc(64, (size_t)((16 * k * 2 + 63) / 64 * 64));
        if (!tail)
            return -1;
        memset(tail, 0, (size_t)(16 * k * 2));
        jb.tail_row = m - part;
        for (long r = 0; r < part; r++)
            memcpy(tail + r * k, x + (jb.tail_row + r) * ldx, (size_t)(k * 2));
        jb.tail = tail;
    }
    run_parallel(&jb, linear_item, jb.num_row_blocks * ((jb.num_col_blocks + LIN_GROUP - 1) / LIN_GROUP),
                 num_threads > MAX_THREADS ? MAX_THREADS : num_threads, load_tile_config, tile_release);
    free(tail);
    return 0;
}

#endif
