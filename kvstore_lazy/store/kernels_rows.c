/* Rows in memory, one pass each (callers: the server's dist_sync rounds, RowTable's removals, the budget's passes).
 *
 * Owns: the sorted union of two workers' row_sparse gradients (merge_rows_f32) and of a whole dist_sync round's
 * (merge_round_f32; merge_round_hashed_f32 in first-come order), moving whole rows within an array
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

/* Whether leaf a's next row comes before leaf b's: the smaller id, equal ids in push order (pushes with no rows
 * left come last: id INT64_MAX, order k + their index). Without branches: which comes first is unpredictable. */
static inline int64_t leaf_first(const int64_t *key, const int64_t *order, int64_t a, int64_t b) {
    return (key[a] < key[b]) | ((key[a] == key[b]) & (order[a] < order[b]));
}

/* The merged gradient of a dist_sync round of k pushes in one pass: push j has n[j] rows of sorted unique ids[j],
 * cols floats each at vals[j]. The sorted union of the ids; each row summed over the pushes that have it in push
 * order, exactly as merge_rows_f32 applied push after push gives it: a row of push 0 starts as its copy, a row first
 * pushed by push j > 0 as 0 + its row (-0.0 -> +0.0), and each later push's row is added to the sum, ((p0 + p1) +
 * p2) + ... . A k-way merge over a tournament tree of the pushes' next rows (its losers kept at the inner nodes: the
 * next row replays one leaf-to-root path, log2 k comparisons without branches): each pushed row is read once and each
 * merged row written once, O(total rows x (cols + log k)), where merging push after push re-reads the growing union
 * k - 1 times. ids[j] and vals[j] are the merge's cursors (each ends past its push's rows). scratch: room for 12k
 * int64. ids_out/out have room for the sum of n rows (whatever the ids); returns the number of rows written.
 * slots (NULL, or k cursors each NULL or one int64 per row of its push): the rows' slots in the table as the
 * pushing worker's pull found them (-1: not there then); slots_out gets each merged row's, the first push's that
 * knows it (server/fastpath.py: a round's rows then need no lookup). */
/* The merge's loop, for the D=32 specialisation (cols a literal: the row loops unrolled and vectorised) and any
 * other width. Each leaf's next rows are asked for as its cursor moves (its ids and slots 16 ahead, its rows
 * PREFETCH ahead): which leaf comes next is known only once its comparisons are done, and the pushes' rows came in
 * long before (a round's first push waits for its last), so without this every row's read waited for its miss:
 * measured 45 -> 28 ns a pushed row (8 pushes of 8,192 Zipf rows, D=32). */
static inline __attribute__((always_inline)) int64_t merge_round_loop(
        int64_t k, int64_t leaves, int64_t total, int64_t j, const int64_t **ids, const float **vals, int64_t cols,
        int64_t *ids_out, float *out, int64_t *left, int64_t *key, int64_t *order, int64_t *loser,
        const int64_t **slots, int64_t *slots_out) {
    int64_t rows = 0;
    size_t row = (size_t)cols * sizeof(float);
    for (int64_t done = 0; done < total; done++) {
        int64_t id = key[j];
        const float *v = vals[j];
        int64_t slot = slots && slots[j] ? *slots[j]++ : -1;
        if (rows == 0 || ids_out[rows - 1] != id) {      /* the row's first push */
            float *restrict o = out + rows * cols;
            if (slots_out) slots_out[rows] = slot;
            ids_out[rows++] = id;
            if (j == 0) {
                memcpy(o, v, row);
            } else {
                for (int64_t c = 0; c < cols; c++) o[c] = 0.0f + v[c];
            }
        } else {
            float *restrict o = out + (rows - 1) * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = o[c] + v[c];
            if (slots_out && slots_out[rows - 1] < 0) slots_out[rows - 1] = slot;
        }
        vals[j] = v + cols;
        const char *ahead = (const char *)(v + PREFETCH * cols);
        for (size_t at = 0; at < row && at < PREFETCH_BYTES; at += 64) __builtin_prefetch(ahead + at, 0);
        __builtin_prefetch(ids[j] + 16, 0);
        if (slots && slots[j]) __builtin_prefetch(slots[j] + 16, 0);
        if (--left[j] > 0) {
            key[j] = *++ids[j];
        } else {
            key[j] = INT64_MAX;
            order[j] = k + j;
        }
        for (int64_t node = (leaves + j) / 2; node >= 1; node /= 2) {   /* leaf j's path replayed */
            int64_t other = loser[node], swap = leaf_first(key, order, other, j);
            loser[node] = swap ? j : other;
            j = swap ? other : j;
        }
    }
    return rows;
}

int64_t merge_round_f32(int64_t k, const int64_t **ids, const float **vals, const int64_t *n, int64_t cols,
                        int64_t *ids_out, float *out, int64_t *scratch, const int64_t **slots, int64_t *slots_out) {
    int64_t leaves = 1, total = 0;
    while (leaves < k) leaves *= 2;
    int64_t *left = scratch, *key = left + leaves, *order = key + leaves;    /* per leaf: rows left, next id, order */
    int64_t *loser = order + leaves, *win = loser + leaves;                    /* per node */
    for (int64_t j = 0; j < leaves; j++) {
        left[j] = j < k ? n[j] : 0;
        key[j] = left[j] > 0 ? ids[j][0] : INT64_MAX;
        order[j] = left[j] > 0 ? j : k + j;
        total += left[j];
        win[leaves + j] = j;
    }
    for (int64_t node = leaves - 1; node >= 1; node--) {      /* the first tournament */
        int64_t a = win[2 * node], b = win[2 * node + 1], first = leaf_first(key, order, a, b);
        win[node] = first ? a : b;
        loser[node] = first ? b : a;
    }
    if (cols == 32)
        return merge_round_loop(k, leaves, total, win[1], ids, vals, 32, ids_out, out, left, key, order, loser, slots,
                                slots_out);
    return merge_round_loop(k, leaves, total, win[1], ids, vals, cols, ids_out, out, left, key, order, loser, slots,
                            slots_out);
}

/* merge_round_f32's sums, in the order each row first comes instead of sorted by id: for a round whose update needs
 * no order (its rows' slots known: server/keys/row_sparse.py's merge_slots), a hash table of the ids (its `mask + 1`
 * entries: `table`, where empty is -1, and `where`, each id's merged row) replaces the tournament, whose dependent
 * comparisons were ~60% of the merge. The same bits: pushes are read in push order, so each row is still summed in
 * push order, ((p0 + p1) + p2) + ..., starting as push 0's row's copy or as 0 + the first push's row; each merged
 * row's slot is the first push's that knows it (-1 if none). mask + 1: a power of two, at least twice the sum of n
 * (the table then at most half full: a probe or two an id). Returns the rows written. */
static inline __attribute__((always_inline)) int64_t merge_hashed_loop(
        int64_t k, const int64_t **ids, const float **vals, const int64_t *n, int64_t cols, int64_t *ids_out,
        float *out, const int64_t **slots, int64_t *slots_out, int64_t *table, int32_t *where, int64_t mask,
        int shift) {
    int64_t rows = 0;
    size_t row = (size_t)cols * sizeof(float);
    for (int64_t j = 0; j < k; j++) {
        const int64_t *id_of = ids[j], *slot_of = slots ? slots[j] : NULL;
        const float *v = vals[j];
        for (int64_t i = 0; i < n[j]; i++, v += cols) {
            if (i + ROW_PREFETCH < n[j]) {        /* the table is ~1 MiB a round of 8 x 8,192 rows: past L2 */
                uint64_t ahead = ((uint64_t)id_of[i + ROW_PREFETCH] * 0x9E3779B97F4A7C15ull) >> shift;
                __builtin_prefetch(table + ahead, 0);
                __builtin_prefetch(where + ahead, 0);
            }
            if (i + PREFETCH < n[j]) {            /* and a row seen before: its sum, 8 rows ahead (~4 MiB of them) */
                int64_t next = id_of[i + PREFETCH];
                uint64_t at = ((uint64_t)next * 0x9E3779B97F4A7C15ull) >> shift;
                if (table[at] == next) {
                    const char *o = (const char *)(out + (int64_t)where[at] * cols);
                    for (size_t b = 0; b < row && b < PREFETCH_BYTES; b += 64) __builtin_prefetch(o + b, 1);
                }
            }
            int64_t id = id_of[i];
            uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> shift;
            while (table[h] != -1 && table[h] != id) h = (h + 1) & (uint64_t)mask;
            int64_t slot = slot_of ? slot_of[i] : -1;
            if (table[h] == -1) {                 /* the row's first push */
                table[h] = id;
                where[h] = (int32_t)rows;
                float *restrict o = out + rows * cols;
                if (slots_out) slots_out[rows] = slot;
                ids_out[rows++] = id;
                if (j == 0) {
                    memcpy(o, v, row);
                } else {
                    for (int64_t c = 0; c < cols; c++) o[c] = 0.0f + v[c];
                }
            } else {
                int64_t r = where[h];
                float *restrict o = out + r * cols;
                for (int64_t c = 0; c < cols; c++) o[c] = o[c] + v[c];
                if (slots_out && slots_out[r] < 0) slots_out[r] = slot;
            }
        }
    }
    return rows;
}

int64_t merge_round_hashed_f32(int64_t k, const int64_t **ids, const float **vals, const int64_t *n, int64_t cols,
                               int64_t *ids_out, float *out, const int64_t **slots, int64_t *slots_out,
                               int64_t *table, int32_t *where, int64_t mask) {
    int shift = 64;
    for (int64_t size = mask + 1; size > 1; size >>= 1) shift--;
    memset(table, 0xff, (size_t)(mask + 1) * sizeof(int64_t));
    if (cols == 32)
        return merge_hashed_loop(k, ids, vals, n, 32, ids_out, out, slots, slots_out, table, where, mask, shift);
    return merge_hashed_loop(k, ids, vals, n, cols, ids_out, out, slots, slots_out, table, where, mask, shift);
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
