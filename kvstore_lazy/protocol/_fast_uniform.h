/* One row of the counter-based uniform initial values (numerics/initializers.py UniformRows), inline in each unit
   that makes rows (_fast_uniform.c uniform_rows, _fast_rows.c gather_rows and ensure_rows): no call per row.

   Owns: the generator's arithmetic (mix64 of a row's and a column's counters, then float64 operations in
   initializers.py's order; -ffp-contract=off: no fused multiply-add). Does not own: which rows, seeds or bounds. */
#ifndef KVSTORE_LAZY_FAST_UNIFORM_H
#define KVSTORE_LAZY_FAST_UNIFORM_H

#include "_fast.h"

/* One row of initializers.UniformRows' values (the formula: _fast_uniform.c uniform_rows): row r's `ncols` values,
   float32 (itemsize 4) or float64 (8), at out. */
#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline void uniform_row(char *out, Py_ssize_t ncols, Py_ssize_t itemsize, uint64_t r, uint64_t key_state,
                               double span, double low) {
    uint64_t state = mix64((r ^ key_state) + GAMMA);
    for (Py_ssize_t c = 0; c < ncols; c++) {
        uint64_t bits = mix64(state + (uint64_t)(c + 1) * GAMMA);
        double u = (double)(int64_t)(bits >> 11) * 0x1p-53;
        u = u * span;
        u = u + low;
        if (itemsize == 4) ((float *)out)[c] = (float)u;
        else ((double *)out)[c] = u;
    }
}

#endif
