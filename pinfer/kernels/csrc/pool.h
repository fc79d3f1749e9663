/* pinfer's own thread pool for the CPU kernels (pool.c): no OpenMP, so no process-wide settings
 * (OpenMP's wait policy can only be set through the environment) and no idle spinning against
 * ONNX Runtime's threads between kernel calls.
 *
 * An entry point brackets its work with pinfer_pool_enter / pinfer_pool_leave; inside, each
 * pinfer_parallel call splits [0, n) into contiguous ranges, one per thread, each run by whichever
 * thread claims it first (the caller too). Between the parallel loops of one call the workers spin (the next loop starts without a
 * wake-up); after pinfer_pool_leave they sleep until the next call wakes them. Which range a
 * thread runs never changes a result: the kernels give every output element to one range.
 */
#ifndef PINFER_POOL_H
#define PINFER_POOL_H

#include <stdint.h>

typedef void (*pinfer_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Take the pool for a call on `threads` threads (one call at a time: a second caller waits); wakes
   the workers it needs so that they spin while the caller prepares the first loop. Returns the
   threads the call may use (fewer only when the system refuses to start more). */
int pinfer_pool_enter(int threads);
void pinfer_pool_leave(int threads);

/* fn(ctx, begin, end) over [0, n) on `threads` threads (at most what pinfer_pool_enter returned);
   returns when every range is done. One thread, or n < 2: fn(ctx, 0, n) on the caller. */
void pinfer_parallel(int threads, int64_t n, pinfer_range_fn fn, void *ctx);

#endif
