/* One decoding step's attention: a single query row per sequence over its cached keys, which are already
 * rotated (the prefill wrote them so), bf16 on AVX512-BF16. Included by rows_attention.c (both bf16 builds)
 * after exp2_ps and first_lanes.
 *
 * Why not the rows kernel: it packs every key into AMX layouts first, ~0.6 ms a layer for 6k keys, which a
 * single row never pays back. Why not PyTorch's SDPA: for one row over 6,254 keys of SmolLM2 it took ~1 ms a
 * layer on a 2-core Sapphire Rapids, most of a decoding step. Here the keys are read once, in place.
 *
 * Work items are (KV head, chunk of DEC_CHUNK keys); each leaves its query heads' softmax max, sum and
 * unnormalised output (fp32), and the calling thread merges the chunks (split-K, as flash-decoding does). */
#ifndef KVB_DECODE_ATTENTION_H
#define KVB_DECODE_ATTENTION_H

#define DEC_CHUNK 256
#define DEC_MAX_REP 16 /* query heads per KV head */
#define DEC_PART (2 + HEAD_DIM) /* a chunk's max, sum and output, per query head */
#define DEC_QV (HEAD_DIM / 32)  /* bf16 vectors of a row */
#define DEC_OV 4                /* fp32 vectors of output a pass over V keeps per query head */

typedef struct {
    const bf16 *q;         /* q[hq, :] at q + hq * q_head_stride, rotated */
    long q_head_stride;
    const bf16 *k, *v;     /* [Hkv][num_keys][HEAD_DIM], rows dense, heads at *_head_stride */
    long k_head_stride, v_head_stride;
    long num_keys, num_chunks;
    int rep;
    float scale_log2;      /* softmax scale times log2(e): probabilities by exp2 */
    float *part;           /* [Hkv][num_chunks][rep][DEC_PART] */
} decode_job;

/* Scores of keys [j0, j0 + n) for the item's query heads into s[r * DEC_CHUNK + j - j0], in log2 units. */
static void decode_scores(const decode_job *jb, int h, long j0, long n, float *s) {
    __m512bh qv[DEC_MAX_REP][DEC_QV];
    for (int r = 0; r < jb->rep; r++) {
        const bf16 *q = jb->q + (h * jb->rep + r) * jb->q_head_stride;
        for (int i = 0; i < DEC_QV; i++)
            qv[r][i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
    }
    const bf16 *k = jb->k + h * jb->k_head_stride + j0 * HEAD_DIM;
    for (long j = 0; j < n; j++, k += HEAD_DIM) {
        __m512bh kv[DEC_QV];
        for (int i = 0; i < DEC_QV; i++)
            kv[i] = (__m512bh)_mm512_loadu_si512(k + 32 * i);
        for (int r = 0; r < jb->rep; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int i = 0; i < DEC_QV; i++)
                acc = _mm512_dpbf16_ps(acc, kv[i], qv[r][i]);
            s[r * DEC_CHUNK + j] = _mm512_reduce_add_ps(acc) * jb->scale_log2;
        }
    }
}

/* s[0:n] -> 2^(s - max) in place; returns the sum, *max_out the max. */
static float decode_softmax(float *s, long n, float *max_out) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (long j = 0; j < n; j += 16) {
        const __mmask16 in = first_lanes(n - j);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, s + j));
    }
    const float mx = _mm512_reduce_max_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (long j = 0; j < n; j += 16) {
        const __mmask16 in = first_lanes(n - j);
        const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + j), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(s + j, in, p);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(in, p));
    }
    *max_out = mx;
    return _mm512_reduce_add_ps(sum);
}

static void decode_item(void *job, long item) {
    const decode_job *jb = (const decode_job *)job;
    const int h = (int)(item / jb->num_chunks);
    const long c = item % jb->num_chunks, j0 = c * DEC_CHUNK;
    const long n = jb->num_keys - j0 < DEC_CHUNK ? jb->num_keys - j0 : DEC_CHUNK;
    float s[DEC_MAX_REP * DEC_CHUNK] __attribute__((aligned(64)));
    float *part = jb->part + ((long)h * jb->num_chunks + c) * jb->rep * DEC_PART;
    decode_scores(jb, h, j0, n, s);
    for (int r = 0; r < jb->rep; r++)
        part[r * DEC_PART + 1] = decode_softmax(s + r * DEC_CHUNK, n, part + r * DEC_PART);
    /* O += P V, 64 columns at a time: rep x 4 accumulators stay in registers (all 128 columns of 8 query
     * heads would not) */
    for (int c0 = 0; c0 < HEAD_DIM; c0 += 16 * DEC_OV) {
        __m512 acc[DEC_MAX_REP][DEC_OV];
        for (int r = 0; r < jb->rep; r++)
            for (int i = 0; i < DEC_OV; i++)
                acc[r][i] = _mm512_setzero_ps();
        const bf16 *v = jb->v + h * jb->v_head_stride + j0 * HEAD_DIM + c0;
        for (long j = 0; j < n; j++, v += HEAD_DIM) {
            __m512 vf[DEC_OV];
            for (int i = 0; i < DEC_OV; i++)
                vf[i] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(v + 16 * i)));
            for (int r = 0; r < jb->rep; r++) {
                const __m512 p = _mm512_set1_ps(s[r * DEC_CHUNK + j]);
                for (int i = 0; i < DEC_OV; i++)
                    acc[r][i] = _mm512_fmadd_ps(p, vf[i], acc[r][i]);
            }
        }
        for (int r = 0; r < jb->rep; r++)
            for (int i = 0; i < DEC_OV; i++)
                _mm512_storeu_ps(part + r * DEC_PART + 2 + c0 + 16 * i, acc[r][i]);
    }
}

/* Chunks' (max, sum, output) of one query head -> its normalised output, rounded once to bf16. */
static void decode_merge(const float *part, long num_chunks, long chunk_stride, bf16 *out) {
    float mx = -INFINITY;
    for (long c = 0; c < num_chunks; c++)
        mx = part[c * chunk_stride] > mx ? part[c * chunk_stride] : mx;
    __m512 o[HEAD_DIM / 16];
    for (int i = 0; i < HEAD_DIM / 16; i++)
        o[i] = _mm512_setzero_ps();
    float total = 0.0f;
    for (long c = 0; c < num_chunks; c++) {
        const float *p = part + c * chunk_stride;
        const float w = exp2f(p[0] - mx);
        total += w * p[1];
        for (int i = 0; i < HEAD_DIM / 16; i++)
            o[i] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(p + 2 + 16 * i), o[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int i = 0; i < HEAD_DIM / 16; i += 2)
        _mm512_storeu_si512(out + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(o[i + 1], inv),
                                                                        _mm512_mul_ps(o[i], inv)));
}

/* out[hq * HEAD_DIM + c] (bf16, Hq = num_kv_heads * rep) = one query row's attention over keys [0, num_keys)
 * of k and v ([Hkv][num_keys][HEAD_DIM] with dense rows; q and k rotated). Returns 0, or -1 for arguments it
 * does not take (the caller falls back to PyTorch). */
int kvb_decode_attention(const bf16 *q, long q_head_stride, const bf16 *k, long k_head_stride, const bf16 *v,
                         long v_head_stride, long num_keys, int num_kv_heads, int rep, int head_dim, float scale,
                         bf16 *out, int num_threads) {
    if (head_dim != HEAD_DIM || num_keys <= 0 || num_kv_heads <= 0 || rep <= 0 || rep > DEC_MAX_REP ||
        num_threads <= 0)
        return -1;
    decode_job jb = {.q = q, .q_head_stride = q_head_stride, .k = k, .v = v, .k_head_stride = k_head_stride,
                     .v_head_stride = v_head_stride, .num_keys = num_keys,
                     .num_chunks = (num_keys + DEC_CHUNK - 1) / DEC_CHUNK, .rep = rep,
                     .scale_log2 = scale * 1.4426950408889634f};
    jb.part = (float *)malloc(sizeof(float) * num_kv_heads * jb.num_chunks * rep * DEC_PART);
    if (!jb.part)
        return -1;
    run_parallel(&jb, decode_item, num_kv_heads * jb.num_chunks, num_threads > MAX_THREADS ? MAX_THREADS : num_threads,
                 NULL, NULL);
    for (int h = 0; h < num_kv_heads; h++)
        for (int r = 0; r < rep; r++)
            decode_merge(jb.part + ((long)h * jb.num_chunks * rep + r) * DEC_PART, jb.num_chunks, (long)rep * DEC_PART,
                         out + (h * rep + r) * HEAD_DIM);
    free(jb.part);
    return 0;
}

#endif
