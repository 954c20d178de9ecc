/* The disk index's sorted runs (store/disk/runfile.py, store/disk/runs.py): their bloom filters, the probe of a
 * batch of ids in a group of runs, the search in the blocks read for it, and the merge of sorted entries; and the
 * live bits kept beside the runs (store/disk/index.py LiveBits).
 *
 * Owns: the bits of the split-block bloom filter (the same as runfile._bloom_where's numpy reference, so a file
 * written by either is read by both), finding the run and the block that may hold each id of a batch (id range,
 * filter, fences), the binary search of each id in its block, the k-way merge of sorted (id, location) chunks
 * newest first, and setting, clearing and testing the live bits of a batch of locations. Does not own: the run
 * file's format, its reads or its block checks (runfile.py, kernels_io.c, kernels_records.c), or which runs exist
 * and in what order (runs.py).
 */
#include "kernels.h"

#include <stdlib.h>
#include <unistd.h>

#define RUNS_EMPTY 0xFFFFFFFFu      /* runs.EMPTY: not found */
#define RUNS_TOMBSTONE 0xFFFFFFFEu  /* runfile.TOMBSTONE: a removed id */

/* Parquet's split-block bloom filter salts: an id sets one bit in each of the eight 32-bit words of one 32-byte
 * block, bit (low 32 bits of its hash * SALT[k]) >> 27 of word k. */
static const uint32_t SALT[8] = {0x47B6137Bu, 0x44974D91u, 0x8824AD5Bu, 0xA2B7289Du,
                                 0x705495C7u, 0x2DF1424Bu, 0x9EFC4947u, 0x5C6BFB31u};

/* splitmix64's finalizer (runfile.mix64) */
static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

/* The filter block of a hash: its high 32 bits scaled to [0, nblocks) (Lemire's fast range) */
static inline const uint32_t *bloom_block(const uint32_t *bloom, uint64_t nblocks, uint64_t h) {
    return bloom + 8 * (((h >> 32) * nblocks) >> 32);
}

static inline int bloom_has(const uint32_t *bloom, uint64_t nblocks, uint64_t h) {
    const uint32_t *w = bloom_block(bloom, nblocks, h);
    uint32_t lo = (uint32_t)h, missing = 0;
    for (int k = 0; k < 8; k++) missing |= ~w[k] & (1u << ((lo * SALT[k]) >> 27));
    return missing == 0;
}

/* Set the bits of n ids in a filter of nblocks 32-byte blocks. */
void runs_bloom_add(uint32_t *bloom, int64_t nblocks, uint64_t seed, const uint64_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) __builtin_prefetch(bloom_block(bloom, (uint64_t)nblocks, mix64(ids[i + PREFETCH] ^ seed)), 1);
        uint64_t h = mix64(ids[i] ^ seed);
        uint32_t *w = (uint32_t *)bloom_block(bloom, (uint64_t)nblocks, h);
        uint32_t lo = (uint32_t)h;
        for (int k = 0; k < 8; k++) w[k] |= 1u << ((lo * SALT[k]) >> 27);
    }
}

/* out[i] = 1 if the filter may hold ids[i] (never 0 for an id added), else 0. */
void runs_bloom_test(const uint32_t *bloom, int64_t nblocks, uint64_t seed, const uint64_t *ids, int64_t n,
                     uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) __builtin_prefetch(bloom_block(bloom, (uint64_t)nblocks, mix64(ids[i + PREFETCH] ^ seed)), 0);
        out[i] = (uint8_t)bloom_has(bloom, (uint64_t)nblocks, mix64(ids[i] ^ seed));
    }
}

/* The probe of a batch in a group of nruns runs whose id ranges are disjoint and ascending (first[t] <= last[t] <
 * first[t + 1]; a group of one run is any run). Run t's fences (the first id of each of its nfences[t] blocks) are
 * at fences_at[t], its filter (nbloom[t] blocks) at bloom_at[t] with seeds[t]. ids: n ids, ascending. With
 * has_after the group answers only ids above `after` (a merge has taken the ones at or below it).
 *
 * The candidates are the ids inside a run's range that its filter does not refuse: for the c-th, cand[c] is its
 * position in ids and row[c] the index of its block among the distinct blocks (utable[u], ublock[u]), which come
 * ascending (the ids do). Returns the number of candidates; *nunique the distinct blocks, *negatives the ids in a
 * run's range its filter refused. Every output array has room for n. */
int64_t runs_probe(int64_t nruns, const uint64_t *first, const uint64_t *last, const uint64_t *fences_at,
                   const int64_t *nfences, const uint64_t *bloom_at, const int64_t *nbloom, const uint64_t *seeds,
                   int64_t has_after, uint64_t after, const uint64_t *ids, int64_t n, int64_t *cand, int64_t *row,
                   int64_t *utable, int64_t *ublock, int64_t *nunique, int64_t *negatives) {
    int64_t nc = 0, nu = 0, refused = 0, t = 0, floor_block = 0;
    /* pass 1: the run of each id (row[] as scratch: -1 for none), so the filter reads of pass 2 can be prefetched */
    for (int64_t i = 0; i < n; i++) {
        uint64_t id = ids[i];
        while (t < nruns && last[t] < id) t++;
        row[i] = (t < nruns && id >= first[t] && !(has_after && id <= after)) ? t : -1;
    }
    int64_t prev_t = -1;
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n && row[i + PREFETCH] >= 0) {
            int64_t r = row[i + PREFETCH];
            __builtin_prefetch(bloom_block((const uint32_t *)(uintptr_t)bloom_at[r], (uint64_t)nbloom[r],
                                           mix64(ids[i + PREFETCH] ^ seeds[r])), 0);
        }
        int64_t r = row[i];
        if (r < 0) continue;
        if (!bloom_has((const uint32_t *)(uintptr_t)bloom_at[r], (uint64_t)nbloom[r], mix64(ids[i] ^ seeds[r]))) {
            refused++;
            continue;
        }
        /* the last block whose first id is <= id: a binary search from the previous candidate's block (ascending) */
        const uint64_t *f = (const uint64_t *)(uintptr_t)fences_at[r];
        if (r != prev_t) floor_block = 0;
        int64_t lo = floor_block, hi = nfences[r];          /* f[lo] <= id; find the first f[k] > id in (lo, hi] */
        while (hi - lo > 1) {
            int64_t mid = lo + (hi - lo) / 2;
            if (f[mid] <= ids[i]) lo = mid; else hi = mid;
        }
        floor_block = lo;
        if (!(nu > 0 && utable[nu - 1] == r && ublock[nu - 1] == lo)) {
            utable[nu] = r;
            ublock[nu] = lo;
            nu++;
        }
        prev_t = r;
        cand[nc] = i;
        row[nc] = nu - 1;           /* (row[nc] with nc <= i: pass 1's entry of i is read above, before this) */
        nc++;
    }
    *nunique = nu;
    *negatives = refused;
    return nc;
}

/* The cache of recent lookups (runwork.Recent): a direct-mapped table of 2^(64 - shift) slots (ids, locations,
 * RUNS_EMPTY in an empty slot), an id's slot the top bits of its Fibonacci hash. */
static inline uint64_t cache_slot(uint64_t id, unsigned shift) { return (id * 0x9E3779B97F4A7C15ULL) >> shift; }

/* out[i] = the location cached for ids[i], RUNS_EMPTY if none; returns how many were. */
int64_t runs_cache_get(const uint64_t *cache_ids, const uint32_t *cache_locs, unsigned shift, const uint64_t *ids,
                       int64_t n, uint32_t *out) {
    int64_t hits = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) {
            uint64_t ahead = cache_slot(ids[i + PREFETCH], shift);
            __builtin_prefetch(cache_ids + ahead, 0);
            __builtin_prefetch(cache_locs + ahead, 0);
        }
        uint64_t s = cache_slot(ids[i], shift);
        uint32_t loc = cache_locs[s];
        out[i] = (loc != RUNS_EMPTY && cache_ids[s] == ids[i]) ? loc : RUNS_EMPTY;
        hits += out[i] != RUNS_EMPTY;
    }
    return hits;
}

/* The slots of ids[i] hold (ids[i], locs[i]) (the later of two ids of one slot stays). */
void runs_cache_put(uint64_t *cache_ids, uint32_t *cache_locs, unsigned shift, const uint64_t *ids,
                    const uint32_t *locs, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = cache_slot(ids[i], shift);
        cache_ids[s] = ids[i];
        cache_locs[s] = locs[i];
    }
}

/* The check of a block (runfile.Format): kernels_records.c's record check over its 32-bit words (word 0, the check
 * itself, weighted 0) with its salt (its run's number and its own mixed in) as the location: the same value, the
 * weights taken as the 32-bit numbers they are (runfile.Format.mult: below 2^32), so the compiler vectorizes the
 * products (pmuludq) where record_checks' 64-bit weights keep it scalar. */
static inline uint32_t block_check(const uint32_t *w, int64_t nwords, const uint32_t *mult, uint32_t salt) {
    uint64_t t = 0;
    for (int64_t k = 0; k < nwords; k++) t += (uint64_t)w[k] * (uint64_t)mult[k];
    t ^= ((uint64_t)salt + 1) * 0x9E3779B97F4A7C15ULL;
    t ^= t >> 29;
    t *= 0xBF58476D1CE4E5B9ULL;
    t ^= t >> 32;
    return (uint32_t)t;
}

/* Checks the n blocks of buf (block_bytes each), block i being block blocks[i] of the run numbered numbers[i], of
 * entries[i] entries: its check word, and its count (per_block, or what is left in the run's last block). Returns
 * the index of the first block that fails, or -1. */
int64_t runs_verify(const uint8_t *buf, int64_t n, int64_t block_bytes, int64_t per_block, const uint32_t *mult,
                    const uint64_t *numbers, const int64_t *blocks, const int64_t *entries) {
    int64_t nwords = block_bytes / 4;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *w = (const uint32_t *)(buf + i * block_bytes);
        uint64_t run = ((uint64_t)numbers[i] * 0x85EBCA77ULL) & 0xFFFFFFFFULL;
        uint32_t salt = (uint32_t)(((uint64_t)blocks[i] * 0x9E3779B1ULL + run) & 0xFFFFFFFFULL);
        int64_t left = entries[i] - blocks[i] * per_block;
        if (block_check(w, nwords, mult, salt) != w[0] || (int64_t)w[1] != (left < per_block ? left : per_block))
            return i;
    }
    return -1;
}

/* The location of id in the block at b (count u32 at byte 4, ids u64[per_block] at 8, locations u32[per_block]
 * after them), RUNS_EMPTY if it does not hold it: a binary search among its count ids. */
static inline uint32_t block_find(const uint8_t *b, int64_t per_block, uint64_t id) {
    uint32_t count;
    memcpy(&count, b + 4, 4);
    const uint64_t *bid = (const uint64_t *)(b + 8);
    const uint32_t *bloc = (const uint32_t *)(b + 8 + 8 * per_block);
    int64_t n = count < (uint64_t)per_block ? (int64_t)count : per_block, lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (bid[mid] < id) lo = mid + 1; else hi = mid;
    }
    return (lo < n && bid[lo] == id) ? bloc[lo] : RUNS_EMPTY;
}

/* A probe's reads (runfile.Probe): for each distinct block u in [u0, u1) (block ublock[u] of run utable[u]: its
 * file descriptor fds[t], its number numbers[t], its entries[t]), the block is read with pread into scratch (one
 * block_bytes buffer, so it is checked and searched while in cache), checked (block_check and its count), and
 * each candidate c whose row[c] is u (the candidates come in the order of their rows) gets the location of ids[c]
 * in it (RUNS_EMPTY if it does not hold it). Returns 0; or, for the first block that fails, 1 with failed[0] = u
 * and failed[1] = errno (-1: the file ends early), or 2 with failed[0] = u (damaged: its check or count is
 * wrong). */
int64_t runs_read_search(const int32_t *fds, const uint64_t *numbers, const int64_t *entries, const int64_t *utable,
                         const int64_t *ublock, int64_t u0, int64_t u1, int64_t block_bytes, int64_t per_block,
                         const uint32_t *mult, const int64_t *row, const uint64_t *ids, int64_t ncand,
                         uint32_t *out, uint8_t *scratch, int64_t *failed) {
    int64_t c = 0;
    while (c < ncand && row[c] < u0) c++;
    for (int64_t u = u0; u < u1; u++) {
        int64_t t = utable[u];
        int64_t got = 0;
        while (got < block_bytes) {
            ssize_t r = pread(fds[t], scratch + got, (size_t)(block_bytes - got),
                              (off_t)(ublock[u] * block_bytes + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                failed[0] = u;
                failed[1] = r < 0 ? errno : -1;
                return 1;
            }
            got += r;
        }
        const uint32_t *w = (const uint32_t *)scratch;
        uint64_t run = ((uint64_t)numbers[t] * 0x85EBCA77ULL) & 0xFFFFFFFFULL;
        uint32_t salt = (uint32_t)(((uint64_t)ublock[u] * 0x9E3779B1ULL + run) & 0xFFFFFFFFULL);
        int64_t left = entries[t] - ublock[u] * per_block;
        if (block_check(w, block_bytes / 4, mult, salt) != w[0]
                || (int64_t)w[1] != (left < per_block ? left : per_block)) {
            failed[0] = u;
            return 2;
        }
        for (; c < ncand && row[c] == u; c++) out[c] = block_find(scratch, per_block, ids[c]);
    }
    return 0;
}

/* For each of n ids: its location in the block at row[c] of buf (blocks of block_bytes: check u32, count u32, ids
 * u64[per_block], locations u32[per_block]), found by binary search among the block's count ids; RUNS_EMPTY if
 * that block does not hold it. */
void runs_search(const uint8_t *buf, int64_t block_bytes, int64_t per_block, const int64_t *row, const uint64_t *ids,
                 int64_t n, uint32_t *out) {
    for (int64_t c = 0; c < n; c++) out[c] = block_find(buf + row[c] * block_bytes, per_block, ids[c]);
}

/* The k-way merge of k sorted chunks (source s: lens[s] ids at ids_at[s], ascending and unique, their locations at
 * locs_at[s]; a higher s is newer): every id once, with the location of the newest source holding it, ascending;
 * with drop_tombstones an id whose newest location is RUNS_TOMBSTONE is left out. Writes out_ids/out_locs (room
 * for the sum of lens) and returns how many. k is small (the groups of runs merged): the smallest head is found
 * by a scan of the k heads. */
int64_t runs_merge(int64_t k, const uint64_t *ids_at, const uint64_t *locs_at, const int64_t *lens,
                   int64_t drop_tombstones, uint64_t *out_ids, uint32_t *out_locs) {
    int64_t *pos = calloc((size_t)(k > 0 ? k : 1), sizeof(int64_t));
    if (pos == NULL) return -1;
    int64_t m = 0;
    for (;;) {
        int64_t best = -1;
        uint64_t min = 0;
        for (int64_t s = 0; s < k; s++) {
            if (pos[s] >= lens[s]) continue;
            uint64_t id = ((const uint64_t *)(uintptr_t)ids_at[s])[pos[s]];
            if (best < 0 || id <= min) {        /* (<=: among equal heads the newest, the highest s, wins) */
                best = s;
                min = id;
            }
        }
        if (best < 0) break;
        uint32_t loc = ((const uint32_t *)(uintptr_t)locs_at[best])[pos[best]];
        for (int64_t s = 0; s < k; s++)
            if (pos[s] < lens[s] && ((const uint64_t *)(uintptr_t)ids_at[s])[pos[s]] == min) pos[s]++;
        if (drop_tombstones && loc == RUNS_TOMBSTONE) continue;
        out_ids[m] = min;
        out_locs[m] = loc;
        m++;
    }
    free(pos);
    return m;
}

/* The live bits of a store's segments (store/disk/index.py LiveBits): segment slot s has lens[s] bytes of bits at
 * address bits[s] (bit b of byte j: record 8j + b, little-endian bit order). A location is slot << shift | record
 * (record = loc & offset_mask). live_bits_apply sets (on) or clears the bit of each of n locations, in any order,
 * repeats allowed; a clear past a segment's bytes has nothing to clear. It returns -1, or the first location a set
 * cannot take (its slot unknown, or its byte past the segment's bytes: the caller grows them and goes on from
 * there; the locations before it are done). live_bits_test: out[i] = 1 where the bit of locs[i] is set (0 past a
 * segment's bytes or past the slots known). */
int64_t live_bits_apply(const uint64_t *bits, const int64_t *lens, int64_t nslots, const uint32_t *locs,
                        int64_t n, unsigned shift, uint32_t offset_mask, int64_t on) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t slot = locs[i] >> shift;
        uint32_t record = locs[i] & offset_mask;
        int64_t byte = (int64_t)(record >> 3);
        if ((int64_t)slot >= nslots || byte >= lens[slot]) {
            if (on) return i;
            continue;
        }
        uint8_t *mine = (uint8_t *)(uintptr_t)bits[slot];
        uint8_t mask = (uint8_t)(1u << (record & 7));
        if (on) mine[byte] |= mask;
        else mine[byte] &= (uint8_t)~mask;
    }
    return -1;
}

void live_bits_test(const uint64_t *bits, const int64_t *lens, int64_t nslots, const uint32_t *locs, int64_t n,
                    unsigned shift, uint32_t offset_mask, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t slot = locs[i] >> shift;
        uint32_t record = locs[i] & offset_mask;
        int64_t byte = (int64_t)(record >> 3);
        out[i] = (int64_t)slot < nslots && byte < lens[slot]
                 && (((const uint8_t *)(uintptr_t)bits[slot])[byte] >> (record & 7)) & 1;
    }
}
