/* What both builds of the rows-attention contract share (rows_attention.c: bf16 on AMX,
 * rows_attention_f32.c: fp32 on AVX2): the argument check and a small thread pool that hands out work
 * items (key blocks to prepare, query tiles to attend) from one atomic counter. */
#ifndef KVB_ROWS_COMMON_H
#define KVB_ROWS_COMMON_H

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

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

/* Threads kept between calls. Starting threads for every call cost ~80 us a call on a 2-core Sapphire
 * Rapids, against 0.1-1 ms for a whole call at a blend's row counts. Idle workers spin briefly
 * (pool_spin_ns), then sleep on a condition variable: they must not spin for long, because PyTorch's
 * threads share the cores between calls. One call at a time uses the pool. A call that finds it busy
 * (another Python thread) starts its own threads, as every call did before. A forked child starts with an
 * empty pool. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    pthread_mutex_t busy;   /* held by the call using the pool */
    long generation;        /* bumped per call: wakes the workers */
    long spawn_generation;  /* the generation before the call that started the newest workers */
    work_t *work;
    int num_workers;        /* started so far */
    int num_wanted;         /* workers taking part in this call */
    int pending;            /* of those, not finished yet */
} pool_t;

static pool_t pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
                      PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, 0, 0, 0};

/* Waking a sleeping thread took ~75 us on this 2-vCPU VM (the idle vCPU halts), so a worker that has
 * just finished spins for up to pool_spin_ns first. The layer loop calls the kernels back to back
 * (attention prepares its keys, then attends), with a few PyTorch ops in between. */
static long pool_spin_ns = 200000L;

/* Sets how long (ns) an idle worker spins before it sleeps (0: at once); returns the previous value. */
long kvb_set_pool_spin_ns(long ns) {
    long old = pool_spin_ns;
    pool_spin_ns = ns < 0 ? 0 : ns;
    return old;
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void spin_while_generation(long seen) {
    long deadline = now_ns() + pool_spin_ns;
    while (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
        for (int i = 0; i < 32; i++) _mm_pause();
        if (now_ns() > deadline) return;
    }
}

static void *pool_worker(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mu);
    /* started under pool.mu by a call that then bumped the generation: that call is this worker's first */
    long seen = pool.spawn_generation;
    for (;;) {
        if (pool.generation == seen) { /* spin a little first: the next call often follows at once */
            pthread_mutex_unlock(&pool.mu);
            spin_while_generation(seen);
            pthread_mutex_lock(&pool.mu);
        }
        while (pool.generation == seen)
            pthread_cond_wait(&pool.start, &pool.mu);
        seen = pool.generation;
        if (index >= pool.num_wanted)
            continue;
        work_t *w = pool.work;
        pthread_mutex_unlock(&pool.mu);
        work_thread(w);
        pthread_mutex_lock(&pool.mu);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_RELEASE) == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void pool_after_fork(void) {
    /* the child has none of the parent's threads; its locks are re-initialised as unlocked */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.num_workers = pool.num_wanted = pool.pending = 0;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Fallback when the pool is busy: threads started for this call only. */
static void run_spawned(work_t *w, int num_threads) {
    pthread_t threads[MAX_THREADS];
    int spawned = 0;
    for (int i = 1; i < num_threads && spawned < MAX_THREADS; i++)
        if (pthread_create(&threads[spawned], NULL, work_thread, w) == 0) spawned++;
    work_thread(w);
    for (int i = 0; i < spawned; i++) pthread_join(threads[i], NULL);
}

/* run_item(job, 0 .. num_items - 1) on num_threads threads (this one included); a thread that fails to
 * start only means fewer hands. */
static void run_parallel(void *job, void (*run_item)(void *, long), long num_items, int num_threads,
                         void (*thread_begin)(void), void (*thread_end)(void)) {
    work_t w = {.job = job, .run_item = run_item, .num_items = num_items, .thread_begin = thread_begin,
                .thread_end = thread_end};
    atomic_store(&w.next_item, 0);
    int helpers = (num_threads < MAX_THREADS ? num_threads : MAX_THREADS) - 1;
    if (helpers > num_items - 1) helpers = num_items > 0 ? (int)(num_items - 1) : 0;
    if (helpers <= 0) {
        work_thread(&w);
        return;
    }
    pthread_once(&pool_once, pool_init);
    if (pthread_mutex_trylock(&pool.busy) != 0) {
        run_spawned(&w, helpers + 1);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    pool.spawn_generation = pool.generation;
    while (pool.num_workers < helpers) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)pool.num_workers) != 0) break;
        pthread_detach(t);
        pool.num_workers++;
    }
    pool.num_wanted = helpers < pool.num_workers ? helpers : pool.num_workers;
    pool.pending = pool.num_wanted;
    pool.work = &w;
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.mu);
    work_thread(&w);
    /* the helpers usually finish within microseconds of this thread: spin rather than sleep on it */
    long deadline = now_ns() + pool_spin_ns;
    while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0 && now_ns() < deadline)
        for (int i = 0; i < 32; i++) _mm_pause();
    pthread_mutex_lock(&pool.mu);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.done, &pool.mu);
    pool.work = NULL;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
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
