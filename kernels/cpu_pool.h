/* kvfleet CPU kernels: the fused decoder's thread pool (included by cpu_decoder.c only; it
 * defines kv_pool_start, exported by the library).
 *
 * Threads: a pool of its own (pthreads), not OpenMP. Each parallel phase is a set of tasks
 * (a run of output channels, or one split of one sequence's KV head) that the calling thread and the helpers claim
 * with one atomic counter, so the caller never waits for a helper that is asleep or
 * descheduled: it does the tasks itself, and waits only for a task a helper has claimed. A
 * helper spins `spin_us` after its last task (a decode step's phases come microseconds apart),
 * then sleeps on a futex; the caller wakes it when it publishes a phase. A forked child has no
 * helpers and runs every task on its calling thread.
 *
 * P also holds the step's scratch (grown by kv_decode under P.lock: one step at a time).
 */
#ifndef KVFLEET_CPU_POOL_H
#define KVFLEET_CPU_POOL_H

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KV_MAX_THREADS 64

typedef void (*kv_task_fn)(const void *ctx, int64_t task);
typedef struct { kv_task_fn fn; const void *ctx; int64_t total; } kv_phase;

static struct {
    int helpers;
    _Atomic uint64_t counter;   /* phase sequence << 32 | next unclaimed task */
    _Atomic int64_t done;       /* tasks of the current phase finished */
    kv_phase phase[2];          /* by sequence parity */
    _Atomic uint32_t wake;      /* futex word */
    _Atomic int sleepers;
    int64_t spin_ns;
    pthread_mutex_t lock;       /* one kv_decode at a time (the pool and scratch are global) */
    float *scratch;
    int64_t scratch_floats;
    int64_t *group;             /* kv_step's group [M], leads [M] and attention's tasks */
    int64_t group_ints;         /* int64s allocated at group */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = 200000};

/* *buf holds at least `need` elements of `size` bytes (grown, never shrunk; *have counts them).
 * Returns 0, or -1 when out of memory (*buf is then NULL and *have 0). The step's scratch buffers
 * (P.lock held). */
static inline int kv_grow(void **buf, int64_t *have, int64_t need, size_t size) {
    if (*have >= need) return 0;
    free(*buf);
    *buf = malloc((size_t)need * size);
    *have = *buf ? need : 0;
    return *buf ? 0 : -1;
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline uint32_t seq_of(uint64_t c) { return (uint32_t)(c >> 32); }

/* Claim and run tasks of phase `seq` until none is left or the phase has moved on. The phase's
 * description is read before the claim; a successful claim proves it was still current (it is
 * rewritten only after all its tasks are done), so a stale read is never acted on. */
static void run_tasks(uint32_t seq) {
    const kv_phase *ph = &P.phase[seq & 1];
    kv_task_fn fn = __atomic_load_n(&ph->fn, __ATOMIC_RELAXED);
    const void *ctx = __atomic_load_n(&ph->ctx, __ATOMIC_RELAXED);
    int64_t total = __atomic_load_n(&ph->total, __ATOMIC_RELAXED);
    uint64_t c = atomic_load(&P.counter);
    for (;;) {
        if (seq_of(c) != seq || (int64_t)(uint32_t)c >= total) return;
        if (atomic_compare_exchange_weak(&P.counter, &c, c + 1)) {
            fn(ctx, (int64_t)(uint32_t)c);
            atomic_fetch_add(&P.done, 1);
            c = atomic_load(&P.counter);
        }
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = seq_of(atomic_load(&P.counter));
    for (;;) {
        uint32_t seq = seq_of(atomic_load(&P.counter));
        if (seq != seen) {
            seen = seq;
            run_tasks(seq);
            continue;
        }
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while (seq_of(atomic_load(&P.counter)) == seen) {
            _mm_pause();
            if ((++spins & 63) == 0 && now_ns() - t0 > P.spin_ns) {
                uint32_t w = atomic_load(&P.wake);
                atomic_fetch_add(&P.sleepers, 1);
                if (seq_of(atomic_load(&P.counter)) == seen)
                    syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = now_ns();
            }
        }
    }
    return NULL;
}

/* Start helpers up to `threads` - 1 (never fewer than already run); spin_us as described above.
 * Returns the number of helpers running. */
int64_t kv_pool_start(int64_t threads, int64_t spin_us) {
    pthread_mutex_lock(&P.lock);
    P.spin_ns = spin_us * 1000;
    while (P.helpers < threads - 1 && P.helpers < KV_MAX_THREADS - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
        pthread_detach(t);
        P.helpers++;
    }
    int64_t n = P.helpers;
    pthread_mutex_unlock(&P.lock);
    return n;
}

static void kv_parallel(kv_task_fn fn, const void *ctx, int64_t total) {
    if (P.helpers == 0 || total <= 1) {
        for (int64_t i = 0; i < total; i++) fn(ctx, i);
        return;
    }
    uint32_t seq = seq_of(atomic_load(&P.counter)) + 1;
    kv_phase *ph = &P.phase[seq & 1];
    __atomic_store_n(&ph->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&ph->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&ph->total, total, __ATOMIC_RELAXED);
    atomic_store(&P.done, 0);
    atomic_store(&P.counter, (uint64_t)seq << 32);
    if (atomic_load(&P.sleepers) > 0) {
        atomic_fetch_add(&P.wake, 1);
        syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    run_tasks(seq);
    while (atomic_load(&P.done) < total) _mm_pause();
}

#endif
