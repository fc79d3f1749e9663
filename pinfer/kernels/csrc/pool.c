/* pinfer's thread pool (pool.h). Workers are started on first need and live with the process.
 * Worker i (1, 2, ...) has a slot whose job number the caller raises to hand it a loop; it spins on
 * that number while a call holds the pool, and sleeps on its condition variable otherwise. The loop's
 * ranges (as many as threads, their bounds fixed by the count) are claimed one at a time by whoever
 * comes first, the caller included, which then waits for the ranges in progress to finish. A worker
 * that is not running when the loop starts (another process has its core) therefore costs the loop
 * nothing: the caller runs its range (with each worker bound to its own range, a second busy
 * process on a 2-core machine made 2-thread decode three times slower than 1 thread). A forked
 * child starts with no workers (pthread_atfork). */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

#define MAX_WORKERS 255
#define WAIT_SPINS (1 << 14)    /* the caller's spins on unfinished ranges before it yields its core */
/* A worker keeps spinning this long after a call leaves the pool before it sleeps: a decode step
   makes two kernel calls per layer a few microseconds apart, and a wake-up through the condition
   variable costs more than the work of a small call (without the wait, SmolLM2's attention calls
   ran slower on 2 threads than on 1). */
#define LINGER_NS 100000

typedef struct {
    _Alignas(64) _Atomic uint64_t job;  /* the job number this worker is to run (0: none yet) */
    pthread_cond_t wake;
    int sleeping;                       /* guarded by lock */
} slot_t;

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;       /* sleeping workers */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static _Alignas(64) _Atomic int hold;       /* a call holds the pool: idle workers spin */
static _Alignas(64) _Atomic int n_sleeping;
static _Alignas(64) _Atomic int remaining;  /* ranges of the current loop not yet done */
/* (job number << 32) | the next range of that job to claim: one word, so that a worker still on an
   earlier job can never claim a range of the next one with the earlier one's count */
static _Alignas(64) _Atomic uint64_t claim;
#define CLOSED UINT64_MAX           /* between loops: its range count is past any loop's */
static int started;                         /* workers running; guarded by call_lock */
static uint64_t last_job;                   /* guarded by call_lock */
static struct {
    pinfer_range_fn fn;
    void *ctx;
    int64_t n;
    _Atomic int parts;
} job;                                      /* written by the caller before it raises the job numbers */
static slot_t slots[MAX_WORKERS + 1];

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run ranges of job j until none is left (or the job has changed). */
static void run_ranges(uint64_t j) {
    uint64_t v = atomic_load(&claim);
    for (;;) {
        const int64_t k = (int64_t)(v & 0xffffffffu);
        if ((v >> 32) != (j & 0xffffffffu) || k >= job.parts) return;
        if (!atomic_compare_exchange_weak(&claim, &v, v + 1)) continue;      /* v reloaded */
        job.fn(job.ctx, job.n * k / job.parts, job.n * (k + 1) / job.parts);
        atomic_fetch_sub_explicit(&remaining, 1, memory_order_release);
        v = atomic_load(&claim);
    }
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    slot_t *s = &slots[id];
    uint64_t seen = 0;
    for (;;) {
        uint64_t j;
        int64_t idle_since = 0;
        unsigned spins = 0;
        while ((j = atomic_load_explicit(&s->job, memory_order_acquire)) == seen) {
            if (atomic_load_explicit(&hold, memory_order_relaxed)) {
                idle_since = 0;
                RELAX();
                continue;
            }
            if (++spins % 256) {     /* linger (LINGER_NS) before sleeping: the next call may be close */
                RELAX();
                continue;
            }
            if (!idle_since) idle_since = now_ns();
            if (now_ns() - idle_since < LINGER_NS) continue;
            idle_since = 0;
            pthread_mutex_lock(&lock);
            s->sleeping = 1;
            atomic_fetch_add(&n_sleeping, 1);   /* then the job number is read again (pinfer_parallel) */
            while (atomic_load(&s->job) == seen && !atomic_load(&hold)) pthread_cond_wait(&s->wake, &lock);
            atomic_fetch_sub(&n_sleeping, 1);
            s->sleeping = 0;
            pthread_mutex_unlock(&lock);
        }
        seen = j;
        run_ranges(j);
    }
    return NULL;
}

/* Wake workers 1 .. upto - 1 where they sleep. */
static void wake(int upto) {
    pthread_mutex_lock(&lock);
    for (int i = 1; i < upto; i++)
        if (slots[i].sleeping) pthread_cond_signal(&slots[i].wake);
    pthread_mutex_unlock(&lock);
}

static void before_fork(void) { pthread_mutex_lock(&call_lock); }
static void parent_after_fork(void) { pthread_mutex_unlock(&call_lock); }

/* The child has only the thread that forked: no workers, nobody sleeping, no call running. */
static void child_after_fork(void) {
    started = 0;
    atomic_store(&hold, 0);
    atomic_store(&n_sleeping, 0);
    pthread_mutex_init(&lock, NULL);
    for (int i = 0; i <= MAX_WORKERS; i++) {
        atomic_store(&slots[i].job, 0);
        slots[i].sleeping = 0;
        pthread_cond_init(&slots[i].wake, NULL);
    }
    pthread_mutex_init(&call_lock, NULL);
}

static void init(void) {
    for (int i = 0; i <= MAX_WORKERS; i++) pthread_cond_init(&slots[i].wake, NULL);
    pthread_atfork(before_fork, parent_after_fork, child_after_fork);
}

int pinfer_pool_enter(int threads) {
    if (threads <= 1) return 1;
    pthread_once(&once, init);
    pthread_mutex_lock(&call_lock);
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    while (started < threads - 1) {
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attr);
        if (rc) break;
        started++;
    }
    if (threads > started + 1) threads = started + 1;
    atomic_store(&hold, 1);
    if (atomic_load(&n_sleeping)) wake(threads);
    return threads;
}

void pinfer_pool_leave(int threads) {
    if (threads <= 1) return;
    atomic_store(&hold, 0);
    pthread_mutex_unlock(&call_lock);
}

void pinfer_parallel(int threads, int64_t n, pinfer_range_fn fn, void *ctx) {
    int parts = (int64_t)threads < n ? threads : (int)n;
    if (parts > started + 1) parts = started + 1;
    if (parts <= 1) {
        fn(ctx, 0, n);
        return;
    }
    atomic_store(&claim, CLOSED);     /* a worker still on the last loop claims nothing from here on */
    job.fn = fn;
    job.ctx = ctx;
    job.n = n;
    job.parts = parts;
    atomic_store_explicit(&remaining, parts, memory_order_relaxed);
    const uint64_t j = ++last_job;
    atomic_store(&claim, (j & 0xffffffffu) << 32);     /* after the fields: a claim sees them */
    for (int i = 1; i < parts; i++) atomic_store(&slots[i].job, j);
    if (atomic_load(&n_sleeping)) wake(parts);   /* a worker that missed j is counted in n_sleeping */
    run_ranges(j);
    for (int spins = 0; atomic_load_explicit(&remaining, memory_order_acquire) > 0; spins++) {
        if (spins < WAIT_SPINS) RELAX();
        else sched_yield();
    }
}
