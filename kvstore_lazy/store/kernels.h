/* What every unit of the kernels library (_kernels.so) shares: the headers, the row store's hash, and the prefetch
 * distance.
 *
 * Owns: nothing that is called; macros and static inline helpers only, so no call crosses a unit.
 * Does not own: any kernel (kernels.c lists the units). Every unit includes this header first, so each is compiled
 * with the same feature macros and headers the library had as one file.
 */
#ifndef KVSTORE_LAZY_KERNELS_H
#define KVSTORE_LAZY_KERNELS_H

#define _POSIX_C_SOURCE 200809L  /* pread under -std=c99 */
#define _DEFAULT_SOURCE          /* syscall, MAP_POPULATE (the io_uring reads) */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* RowIndex's hash of a row id to its home bucket (protocol/_fast_rows.c home_bucket is the same: tests compare) */
#define MULT 0xBF58476D1CE4E5B9ULL

static inline int64_t home(uint64_t id, unsigned shift) { return (int64_t)((((id >> 31) ^ id) * MULT) >> shift); }

/* The rows and buckets a kernel touches lie at random places of tables larger than the caches, each a miss: a
 * kernel asks for the ones PREFETCH iterations ahead, so the misses overlap instead of following one another. A row
 * is asked for whole, up to PREFETCH_BYTES (the hardware prefetcher follows a longer row): its second line is a
 * miss of its own otherwise (D=32 float32 rows are two lines), which the update then waits for. The update kernels
 * ask for rows ROW_PREFETCH ahead, into L2, not L1 (locality 2: prefetcht1): the L1's few miss buffers, full of
 * the 2..6 lines of each of 8 rows ahead, stalled the loop at its next prefetch; the L2 keeps more misses in flight,
 * and the row's loads then hit it (this machine's EPYC, sgd_mom_rows on 8,192 random rows of two 1M x 32 tables:
 * 55 -> 36 ns a row, 27 with the tables in huge pages, store/arena.py). A prefetch changes no result. */
#define PREFETCH 8
#define ROW_PREFETCH 16
#define PREFETCH_BYTES 256
#define PREFETCH_ROW(base, slots, i, n, cols)                                                                   \
    do {                                                                                                        \
        if ((i) + ROW_PREFETCH < (n)) {                                                                         \
            const char *row_ = (const char *)((base) + (slots)[(i) + ROW_PREFETCH] * (cols));                   \
            int64_t bytes_ = (int64_t)(cols) * (int64_t)sizeof(*(base));                                        \
            for (int64_t at_ = 0; at_ < bytes_ && at_ < PREFETCH_BYTES; at_ += 64) __builtin_prefetch(row_ + at_, 1, 2); \
        }                                                                                                       \
    } while (0)

#endif
