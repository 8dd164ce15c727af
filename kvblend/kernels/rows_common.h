/* What both builds of the rows-attention contract share (rows_attention.c: bf16 on AMX,
 * rows_attention_f32.c: fp32 on AVX2): the argument check and a small thread pool that hands out work
 * items (key blocks to prepare, query tiles to attend) from one atomic counter. */
#ifndef KVB_ROWS_COMMON_H
#define KVB_ROWS_COMMON_H

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_THREADS 64

typedef struct {
    void *job;
    void (*run_item)(void *job, long item);
    long num_items;
    void (*thread_begin)(void); /* per-thread CPU state (AMX tile config), or NULL */
    void (*thread_end)(void);
    atomic_long next_item;
} work_t;

static void *work_thread(void *arg) {
    work_t *w = (work_t *)arg;
    /* flush denormals: probabilities far below a row's max must not take microcode assists */
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
    if (w->thread_begin) w->thread_begin();
    for (long it; (it = atomic_fetch_add(&w->next_item, 1)) < w->num_items;)
        w->run_item(w->job, it);
    if (w->thread_end) w->thread_end();
    _mm_setcsr(csr);
    return NULL;
}

/* run_item(job, 0 .. num_items - 1) on num_threads threads (this one included); a thread that fails to
 * start only means fewer hands. */
static void run_parallel(void *job, void (*run_item)(void *, long), long num_items, int num_threads,
                         void (*thread_begin)(void), void (*thread_end)(void)) {
    work_t w = {.job = job, .run_item = run_item, .num_items = num_items, .thread_begin = thread_begin,
                .thread_end = thread_end};
    atomic_store(&w.next_item, 0);
    pthread_t threads[MAX_THREADS];
    int spawned = 0;
    for (int i = 1; i < num_threads && spawned < MAX_THREADS; i++)
        if (pthread_create(&threads[spawned], NULL, work_thread, &w) == 0) spawned++;
    work_thread(&w);
    for (int i = 0; i < spawned; i++) pthread_join(threads[i], NULL);
}

/* Tile `item` of the attend phase -> (head, first query row): head by head, so a thread's K/V stay in
 * its cache, and the most expensive (last) tiles of a head first. */
static inline void tile_of_item(long item, long tiles_per_head, int rows_per_tile, int *head, long *m0) {
    *head = (int)(item / tiles_per_head);
    *m0 = (tiles_per_head - 1 - item % tiles_per_head) * rows_per_tile;
}

/* The arguments both builds reject (the caller falls back to PyTorch): 1 when acceptable. */
static inline int rows_args_ok(int head_dim, int expected_head_dim, long num_rows, int rep, int num_kv_heads,
                               int num_threads, const void *cos_t, const void *sin_t, const int64_t *pos,
                               long num_keys, const void *scratch, uintptr_t align, long scratch_bytes,
                               long needed_bytes) {
    return head_dim == expected_head_dim && num_rows > 0 && rep > 0 && num_kv_heads > 0 && num_threads > 0 &&
           (cos_t == NULL) == (sin_t == NULL) && num_keys > pos[num_rows - 1] && pos[num_rows - 1] < INT32_MAX &&
           ((uintptr_t)scratch & (align - 1)) == 0 && scratch_bytes >= needed_bytes;
}

#endif
