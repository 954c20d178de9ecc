/* The row store's hash index (store/rows.py RowIndex), called through ctypes: lookups, placing new ids, removals.
 *
 * Owns: probing and changing a linear-probing table of slots (int32 or int64 buckets, -1 empty) whose keys[] hold
 * each slot's row id. Does not own: the table's size, growth or rebuild (rows.py), the row values.
 */
#include "kernels.h"

/* Linear-probing hash index: table[bucket] is a slot or -1, keys[slot] the row id; len(table) = mask + 1. A lookup
 * asks for the home bucket of the id 2 PREFETCH ahead, and for the row id of the slot in the home bucket of the one
 * PREFETCH ahead (by then that bucket is in the cache). */
#define INDEX_KERNELS(T, SUFFIX)                                                                                  \
    void index_lookup_##SUFFIX(const T *table, int64_t mask, const uint64_t *keys, const uint64_t *ids,        \
                               int64_t n, unsigned shift, int64_t *out) {                                      \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            if (i + 2 * PREFETCH < n) __builtin_prefetch(table + home(ids[i + 2 * PREFETCH], shift), 0);      \
            if (i + PREFETCH < n) {                                                                            \
                T ahead = table[home(ids[i + PREFETCH], shift)];                                               \
                if (ahead >= 0) __builtin_prefetch(keys + ahead, 0);                                           \
            }                                                                                                  \
            uint64_t id = ids[i];                                                                              \
            int64_t pos = home(id, shift);                                                                     \
            for (;;) {                                                                                         \
                T slot = table[pos];                                                                           \
                if (slot < 0) { out[i] = -1; break; }                                                          \
                if (keys[slot] == id) { out[i] = slot; break; }                                                \
                pos = (pos + 1) & mask;                                                                        \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    void index_place_##SUFFIX(T *table, int64_t mask, const uint64_t *ids, int64_t n, int64_t first_slot,      \
                              unsigned shift) {                                                                \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            if (i + PREFETCH < n) __builtin_prefetch(table + home(ids[i + PREFETCH], shift), 1);               \
            int64_t pos = home(ids[i], shift);                                                                 \
            while (table[pos] >= 0) pos = (pos + 1) & mask;                                                    \
            table[pos] = (T)(first_slot + i);                                                                  \
        }                                                                                                      \
    }

INDEX_KERNELS(int32_t, i32)
INDEX_KERNELS(int64_t, i64)

/* Removing rows from the index, slots kept dense (swap-with-last). del[0..k) are the slots removed (unique), holes[i]
 * and movers[i] (m pairs) say that the live row at slot movers[i] (>= n - k) moves to slot holes[i] (a removed slot
 * < n - k). First every removed slot's bucket is emptied by backward-shift deletion (the entries after it in its probe
 * run move back when their home bucket allows, so no run is broken and no tombstone is needed; keys[] of removed slots
 * are still intact while this runs), then each mover's bucket and keys[] entry follow it to its hole. */
#define INDEX_REMOVE(T, SUFFIX)                                                                                   \
    static int64_t bucket_of_##SUFFIX(const T *table, int64_t mask, const uint64_t *keys, int64_t slot,         \
                                      unsigned shift) {                                                        \
        int64_t pos = home(keys[slot], shift);                                                                 \
        while (table[pos] != (T)slot) pos = (pos + 1) & mask;                                                  \
        return pos;                                                                                            \
    }                                                                                                          \
    void index_remove_##SUFFIX(T *table, int64_t mask, uint64_t *keys, const int64_t *del, int64_t k,         \
                               const int64_t *holes, const int64_t *movers, int64_t m, unsigned shift) {       \
        for (int64_t i = 0; i < k; i++) {                                                                      \
            if (i + 2 * PREFETCH < k) __builtin_prefetch(keys + del[i + 2 * PREFETCH], 0);                      \
            if (i + PREFETCH < k) __builtin_prefetch(table + home(keys[del[i + PREFETCH]], shift), 1);          \
            int64_t hole = bucket_of_##SUFFIX(table, mask, keys, del[i], shift), j = hole;                     \
            for (;;) {                                                                                         \
                j = (j + 1) & mask;                                                                            \
                T slot = table[j];                                                                             \
                if (slot < 0) break;                                                                           \
                int64_t h = home(keys[slot], shift);                                                           \
                /* the entry at j stays unless its home lies outside the cyclic range (hole, j] */             \
                int stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);                           \
                if (!stays) { table[hole] = slot; hole = j; }                                                  \
            }                                                                                                  \
            table[hole] = -1;                                                                                  \
        }                                                                                                      \
        for (int64_t i = 0; i < m; i++) {                                                                      \
            if (i + PREFETCH < m) {                                                                            \
                __builtin_prefetch(table + home(keys[movers[i + PREFETCH]], shift), 1);                        \
                __builtin_prefetch(keys + holes[i + PREFETCH], 1);                                             \
            }                                                                                                  \
            table[bucket_of_##SUFFIX(table, mask, keys, movers[i], shift)] = (T)holes[i];                      \
            keys[holes[i]] = keys[movers[i]];                                                                  \
        }                                                                                                      \
    }

INDEX_REMOVE(int32_t, i32)
INDEX_REMOVE(int64_t, i64)
