/* The records of the disk tier (store/segments.py, store/tier.py): their checks, and rows packed into and out of
 * them.
 *
 * Owns: the check word of a record (the same arithmetic as segments._checks_numpy) and the copies between row
 * arrays and records (demote and promote). Does not own: the record layout (tier.py names every field's offset;
 * kernels.py checks them against the arrays first) or their I/O (kernels_io.c).
 */
#include "kernels.h"

/* The check of each of n records of `nwords` 32-bit words (segments.py): a position-weighted sum of the words
 * (mult[k] per word, mod 2^64), the record's location mixed in, folded to 32 bits. Same arithmetic as
 * segments._checks_numpy. */
void record_checks(const uint32_t *words, int64_t n, int64_t nwords, const uint64_t *mult, const uint32_t *locs,
                   uint32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *w = words + i * nwords;
        uint64_t t = 0;
        for (int64_t k = 0; k < nwords; k++) t += (uint64_t)w[k] * mult[k];
        t ^= ((uint64_t)locs[i] + 1) * 0x9E3779B97F4A7C15ULL;
        t ^= t >> 29;
        t *= 0xBF58476D1CE4E5B9ULL;
        t ^= t >> 32;
        out[i] = (uint32_t)t;
    }
}

/* The same check written into each record's own check word (word `at`): sealing records before they are written. */
void record_seal(uint32_t *words, int64_t n, int64_t nwords, const uint64_t *mult, const uint32_t *locs, int64_t at) {
    for (int64_t i = 0; i < n; i++) record_checks(words + i * nwords, 1, nwords, mult, locs + i, words + i * nwords + at);
}

/* Moving whole rows between row arrays and fixed-size records (the disk tier's demote and promote, tier.py): field
 * f of a record is bytes [off[f], off[f] + bytes[f]) of it, and the row at slot s of array f is bytes[f] bytes at
 * arrays[f] + s * bytes[f]. kernels.py checks every slot against every array's length and every field against the
 * record's size first. */

/* Every cache line of the row at `slot` of each of the nf arrays (rows of a few cache lines: a record's fields). */
static inline void prefetch_fields(int64_t slot, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                                   int write) {
    for (int64_t f = 0; f < nf; f++) {
        const char *row = (const char *)(uintptr_t)arrays[f] + slot * bytes[f];
        for (int64_t b = 0; b < bytes[f]; b += 64) {
            if (write) __builtin_prefetch(row + b, 1);
            else __builtin_prefetch(row + b, 0);
        }
    }
}

/* Record i = the fields of the rows at slots[i], everything else in it (check word, padding) zero. */
void gather_fields(const int64_t *slots, int64_t n, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                   const int64_t *off, char *records, int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_fields(slots[i + PREFETCH], nf, arrays, bytes, 0);
        char *rec = records + i * stride;
        memset(rec, 0, (size_t)stride);
        for (int64_t f = 0; f < nf; f++)
            memcpy(rec + off[f], (const char *)(uintptr_t)arrays[f] + slots[i] * bytes[f], (size_t)bytes[f]);
    }
}

/* The rows at slots[i] = the fields of record i. */
void scatter_fields(const int64_t *slots, int64_t n, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                    const int64_t *off, const char *records, int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_fields(slots[i + PREFETCH], nf, arrays, bytes, 1);
        const char *rec = records + i * stride;
        for (int64_t f = 0; f < nf; f++)
            memcpy((char *)(uintptr_t)arrays[f] + slots[i] * bytes[f], rec + off[f], (size_t)bytes[f]);
    }
}
