/* Rows in memory, one pass each (callers: the server's dist_sync rounds, RowTable's removals, the budget's passes).
 *
 * Owns: the sorted union of two workers' row_sparse gradients (merge_rows_f32), moving whole rows within an array
 * (move_rows) and the histogram of int32 scores (count_values_i32). Does not own: which rows, slots or scores
 * (kernels.py checks every slot and shape first).
 */
#include "kernels.h"

/* Union of two sorted unique id lists with their rows (cols floats each); rows in both are summed as a + b. As the
 * numpy merge did (zeros, a assigned, b added): rows only in a are copied, rows only in b are 0 + b (-0.0 -> +0.0).
 * ids/vals have room for na + nb rows; returns the number written. */
int64_t merge_rows_f32(const int64_t *ids_a, const float *a, int64_t na, const int64_t *ids_b, const float *b,
                       int64_t nb, int64_t cols, int64_t *ids, float *vals) {
    int64_t i = 0, j = 0, k = 0;
    size_t row = (size_t)cols * sizeof(float);
    while (i < na || j < nb) {
        if (j == nb || (i < na && ids_a[i] < ids_b[j])) {
            ids[k] = ids_a[i];
            memcpy(vals + k * cols, a + i * cols, row);
            i++;
        } else if (i == na || ids_b[j] < ids_a[i]) {
            ids[k] = ids_b[j];
            for (int64_t c = 0; c < cols; c++) vals[k * cols + c] = 0.0f + b[j * cols + c];
            j++;
        } else {
            ids[k] = ids_a[i];
            for (int64_t c = 0; c < cols; c++) vals[k * cols + c] = a[i * cols + c] + b[j * cols + c];
            i++;
            j++;
        }
        k++;
    }
    return k;
}

/* Row dst[i] of an array of rows of `row_bytes` = row src[i] (a table's removal refilling its holes; no row is both
 * a source and a destination). */
void move_rows(char *base, int64_t row_bytes, const int64_t *dst, const int64_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) {
            for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(base + src[i + PREFETCH] * row_bytes + b, 0);
                __builtin_prefetch(base + dst[i + PREFETCH] * row_bytes + b, 1);
            }
        }
        memcpy(base + dst[i] * row_bytes, base + src[i] * row_bytes, (size_t)row_bytes);
    }
}

/* counts[v - low] += 1 for each of the n values: the histogram of a budget pass's eviction scores (LRU's rounds), in
 * one pass and no temporary. Four partial histograms (counts has 4 * span entries, summed by the caller), so that
 * runs of equal values (rows touched in the same round) do not wait on one counter's last increment. Returns the
 * number of values outside [low, low + span) (counted nowhere). */
int64_t count_values_i32(const int32_t *values, int64_t n, int32_t low, int64_t span, int64_t *counts) {
    int64_t outside = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t at = (uint64_t)((int64_t)values[i] - low);
        if (at >= (uint64_t)span) { outside++; continue; }
        counts[(i & 3) * span + (int64_t)at]++;
    }
    return outside;
}
