/* A row table's rows in one pass each, for the server's hot requests: a row_sparse pull's rows gathered into its
   reply (gather_rows), a round's new rows made in the table (ensure_rows).

   Owns: probing a RowIndex's buckets (the hash of store/kernels.h home(), here home_bucket) and copying or making
   rows. Each function gives exactly what the Python reference gives (store/rows.py RowIndex and RowTable.ensure)
   or returns None, with nothing changed, and the caller takes its general path. Does not own: which rows exist or
   how absent rows are made (server/keys.py), the table's growth (store/rows.py). */
#include "_fast.h"
#include "_fast_uniform.h"

/* ---------------------------------------------------------------------------------------------------------------
   gather_rows(keys, table, slot_ids, shift, weights, row_offset, local_rows, row_bytes[, fill[, slots_out]])
       -> (payload, lens, missing, missing_ids) or None

   A row_sparse pull answered from the rows in memory: `keys` is the request's keys frame (uint64 little-endian:
   the master key, then one key per row), `table`/`slot_ids`/`shift` a RowIndex's buckets (int32 or int64, -1
   empty), slot -> row id array and home-bucket shift, `weights` the weight arena (row `slot` at slot * row_bytes).
   The row keys must be strictly increasing from the master key on with local ids below `local_rows` (what a worker
   sends); otherwise None, and the general path decides (and names what is wrong). `payload` is the rows in request
   order, `lens` the reply's int32 lens: 0 for the master key, then the row size in elements (row_bytes / 4: the
   caller serves float32 keys only). If every row is in the table, payload is bytes and missing/missing_ids None;
   else payload is a bytearray with zeros where rows are missing, `missing` their positions among the request's rows
   and `missing_ids` their local ids (int64 bytes each), for the caller to fill in from server/keys.py, which decides
   what a row not in memory is. With `fill` (key_state, span, low), which that caller hands over when a row not in
   memory is its initial value (RowSparseKey.absent_fill), such rows get uniform_rows' values of their row id
   (local id + row_offset) here instead: payload is bytes, `missing` their number and missing_ids None. With
   `slots_out` (a writable buffer of one int64 per row), each row's slot (-1: not in the table) is written there
   when the pull is answered, for a caller that reuses them (server/fastpath.py: the worker's push of the same rows). */

#define MULT 0xBF58476D1CE4E5B9ULL   /* RowIndex's hash (store/kernels.h home()): tests compare the two */

static inline uint64_t home_bucket(uint64_t row_id, unsigned long long shift) {
    return (((row_id >> 31) ^ row_id) * MULT) >> shift;
}

/* The rows a kernel touches lie at random places of tables larger than the caches, each a miss; they overlap when a
   loop asks for them ahead, in stages (store/kernels.h PREFETCH): row i + 3 * AHEAD's home bucket, then the row id
   of the slot in row i + 2 * AHEAD's bucket (the bucket is in the cache by then), then row i + AHEAD is probed (both
   are) and its weight row asked for, and row i is copied (it is there). Every stage asks into L2 (locality 2:
   store/kernels.h PREFETCH_ROW says why), 16 rows apart (8 into L1 before: 35 -> 31 ns a row of D=32 gathered from
   a 1M-row table on this machine). A prefetch changes no result. */
#define AHEAD 16

static inline int64_t bucket_at(const void *table, int wide, uint64_t pos) {
    return wide ? ((const int64_t *)table)[pos] : ((const int32_t *)table)[pos];
}

/* Every cache line of a row of `row_bytes` at p, at most 4 (the hardware prefetcher follows a longer row), into L2
   (locality 2: store/kernels.h PREFETCH_ROW says why). */
static inline void prefetch_row(const char *p, Py_ssize_t row_bytes) {
    __builtin_prefetch(p, 0, 2);
    for (Py_ssize_t at = 64; at < row_bytes && at < 256; at += 64) __builtin_prefetch(p + at, 0, 2);
}

/* A row's bytes: the common row sizes as fixed-size copies the compiler inlines, not a library call per row. */
static inline void copy_row(char *dst, const char *src, Py_ssize_t row_bytes) {
    switch (row_bytes) {
    case 64: memcpy(dst, src, 64); break;
    case 128: memcpy(dst, src, 128); break;
    case 256: memcpy(dst, src, 256); break;
    default: memcpy(dst, src, (size_t)row_bytes);
    }
}

PyObject *gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 8 || nargs > 10) {
        PyErr_SetString(PyExc_TypeError, "gather_rows takes 8 to 10 arguments");
        return NULL;
    }
    unsigned long long shift = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long row_offset = PyLong_AsUnsignedLongLong(args[5]);
    long long local_rows = PyLong_AsLongLong(args[6]);
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[7]);
    int fill = nargs >= 9 && args[8] != Py_None, keep = nargs == 10 && args[9] != Py_None;
    unsigned long long fill_state = 0;
    double fill_span = 0, fill_low = 0;
    if (fill) {
        if (!PyTuple_Check(args[8]) || PyTuple_Size(args[8]) != 3) {
            PyErr_SetString(PyExc_TypeError, "gather_rows: fill is (key_state, span, low) or None");
            return NULL;
        }
        fill_state = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[8], 0));
        fill_span = PyFloat_AsDouble(PyTuple_GetItem(args[8], 1));
        fill_low = PyFloat_AsDouble(PyTuple_GetItem(args[8], 2));
    }
    if (PyErr_Occurred()) return NULL;
    if (shift < 1 || shift > 63 || row_bytes <= 0 || row_bytes % 4) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: bad shift or row size");
        return NULL;
    }
    Py_buffer keys, table, ids, weights, kept;
    PyObject *result = NULL, *payload = NULL, *lens = NULL, *missing = NULL, *missing_ids = NULL;
    int64_t *slots = NULL;
    int got = 0;
    if (keep && PyObject_GetBuffer(args[9], &kept, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0) {
        if (keep) PyBuffer_Release(&kept);
        return NULL;
    }
    got = 1;
    if (PyObject_GetBuffer(args[1], &table, PyBUF_SIMPLE) < 0) goto release;
    got = 2;
    if (PyObject_GetBuffer(args[2], &ids, PyBUF_SIMPLE) < 0) goto release;
    got = 3;
    if (PyObject_GetBuffer(args[4], &weights, PyBUF_SIMPLE) < 0) goto release;
    got = 4;
    Py_ssize_t nkeys = keys.len / 8, nbuckets = table.len / (table.itemsize == 8 ? 8 : 4);
    Py_ssize_t nslots = ids.len / 8;
    if (keys.len % 8 || nkeys < 2 || (table.itemsize != 4 && table.itemsize != 8) || (nbuckets & (nbuckets - 1))
            || nbuckets < 2 || (64 - shift) != (unsigned)__builtin_ctzll((unsigned long long)nbuckets))
        goto fallback;
    const unsigned char *kb = keys.buf;
    uint64_t master, previous = 0;
    memcpy(&master, kb, 8);
    Py_ssize_t nrows = nkeys - 1, absent = 0;
    if (keep && kept.len != nrows * 8) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: slots_out is not one int64 per row");
        goto release;
    }
    slots = PyMem_Malloc((size_t)nrows * sizeof(int64_t));
    payload = PyBytes_FromStringAndSize(NULL, nrows * row_bytes);
    if (slots == NULL || payload == NULL) { if (slots == NULL) PyErr_NoMemory(); goto release; }
    char *dst = PyBytes_AsString(payload);
    const char *rows = weights.buf;
    const uint64_t *slot_ids = ids.buf;
    const void *buckets = table.buf;
    int wide = table.itemsize == 8;
    uint64_t mask = (uint64_t)nbuckets - 1;
    /* One pass, in the stages above: row c = i + AHEAD is checked (the row keys strictly increasing from the master
       key on, local ids below local_rows: else the general path decides) and probed, row i copied (or, absent, given
       its initial value with `fill`, else zeros for the caller to fill in). The keys of rows further ahead are only
       hashed for a prefetch, which reads nothing that could be out of bounds. */
    for (Py_ssize_t i = -3 * AHEAD; i < nrows; i++) {
        Py_ssize_t a = i + 3 * AHEAD, b = i + 2 * AHEAD, c = i + AHEAD;
        uint64_t key;
        if (a >= 0 && a < nrows) {
            memcpy(&key, kb + 8 * (a + 1), 8);
            __builtin_prefetch((const char *)buckets + home_bucket(key - master + row_offset, shift) * table.itemsize, 0, 2);
        }
        if (b >= 0 && b < nrows) {
            memcpy(&key, kb + 8 * (b + 1), 8);
            int64_t ahead = bucket_at(buckets, wide, home_bucket(key - master + row_offset, shift));
            if (ahead >= 0 && ahead < nslots) __builtin_prefetch(slot_ids + ahead, 0, 2);
        }
        if (c >= 0 && c < nrows) {
            memcpy(&key, kb + 8 * (c + 1), 8);
            if (key < master || (c && key <= previous) || key - master >= (uint64_t)local_rows) goto fallback;
            previous = key;
            uint64_t row_id = key - master + row_offset;
            uint64_t pos = home_bucket(row_id, shift);
            int64_t slot;
            for (;;) {
                slot = bucket_at(buckets, wide, pos);
                if (slot < 0) break;
                if (slot < nslots && slot_ids[slot] == row_id) break;
                pos = (pos + 1) & mask;
            }
            if (slot >= 0 && (slot + 1) * row_bytes > weights.len) goto fallback;
            slots[c] = slot < 0 ? -1 : slot;
            if (slot >= 0) prefetch_row(rows + slot * row_bytes, row_bytes);
        }
        if (i < 0) continue;
        if (slots[i] >= 0) {
            copy_row(dst + i * row_bytes, rows + slots[i] * row_bytes, row_bytes);
        } else {
            absent++;
            if (fill) {
                memcpy(&key, kb + 8 * (i + 1), 8);
                uniform_row(dst + i * row_bytes, row_bytes / 4, 4, key - master + row_offset, fill_state, fill_span,
                            fill_low);
            } else {
                memset(dst + i * row_bytes, 0, (size_t)row_bytes);
            }
        }
    }
    if (absent && !fill) {
        /* rows the caller fills in: the payload as a bytearray it can write (a copy: the rare path), with the
           rows' positions and local ids */
        PyObject *writable = PyByteArray_FromStringAndSize(dst, nrows * row_bytes);
        missing = PyBytes_FromStringAndSize(NULL, absent * 8);
        missing_ids = PyBytes_FromStringAndSize(NULL, absent * 8);
        Py_DECREF(payload);
        payload = writable;
        if (payload == NULL || missing == NULL || missing_ids == NULL) goto release;
        int64_t *positions = (int64_t *)PyBytes_AsString(missing);
        int64_t *local_ids = (int64_t *)PyBytes_AsString(missing_ids);
        for (Py_ssize_t i = 0; i < nrows; i++) {
            if (slots[i] >= 0) continue;
            uint64_t key;
            memcpy(&key, kb + 8 * (i + 1), 8);
            *positions++ = i;
            *local_ids++ = (int64_t)(key - master);
        }
    }
    lens = PyBytes_FromStringAndSize(NULL, nkeys * 4);
    if (lens == NULL) goto release;
    if (keep) memcpy(kept.buf, slots, (size_t)nrows * sizeof(int64_t));
    int32_t *len_out = (int32_t *)PyBytes_AsString(lens), elems = (int32_t)(row_bytes / 4);
    len_out[0] = 0;
    for (Py_ssize_t i = 1; i < nkeys; i++) memcpy(len_out + i, &elems, 4);
    if (!absent || fill) {
        missing = absent ? PyLong_FromSsize_t(absent) : Py_NewRef(Py_None);
        missing_ids = Py_NewRef(Py_None);
        if (missing == NULL) goto release;
    }
    result = PyTuple_New(4);
    if (result == NULL) goto release;
    PyTuple_SetItem(result, 0, payload);
    PyTuple_SetItem(result, 1, lens);
    PyTuple_SetItem(result, 2, missing);
    PyTuple_SetItem(result, 3, missing_ids);
    payload = lens = missing = missing_ids = NULL;
    goto release;
fallback:
    result = Py_None;
    Py_INCREF(result);
release:
    PyMem_Free(slots);
    Py_XDECREF(payload);
    Py_XDECREF(lens);
    Py_XDECREF(missing);
    Py_XDECREF(missing_ids);
    if (got >= 4) PyBuffer_Release(&weights);
    if (got >= 3) PyBuffer_Release(&ids);
    if (got >= 2) PyBuffer_Release(&table);
    PyBuffer_Release(&keys);
    if (keep) PyBuffer_Release(&kept);
    return result;
}

/* ---------------------------------------------------------------------------------------------------------------
   ensure_rows(row_bytes, fill, ids, table, slot_ids, shift, n, limit, weights, slots) -> made or None: RowTable.ensure
   for a float32 table whose new rows are uniform_rows' values (`fill` = (key_state, span, low)), in one call: the
   slot of every row id of `ids` (uint64, unique) into `slots` (int64), the absent ones added as slots n, n+1, ... in
   their order (slot_ids[s] = id, placed in the first empty bucket of their probe run: RowIndex.insert's
   index_place) with their initial values written into their weight rows (states and columns of rows past n are zero
   already: RowTable's invariant). `made`: how many were added. None, with the table unchanged, when they do not
   fit as they are: more than `limit` rows in all (RowIndex.insert would rebuild the table larger) or than the
   capacity of slot_ids or weights (RowTable._reserve would grow the arenas); the caller takes the general path.
   row_bytes and fill come first: a key binds them once (functools.partial) and hands RowTable.ensure the rest. */

PyObject *ensure_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) { PyErr_SetString(PyExc_TypeError, "ensure_rows takes 10 arguments"); return NULL; }
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[0]);
    unsigned long long shift = PyLong_AsUnsignedLongLong(args[5]);
    Py_ssize_t n = PyLong_AsSsize_t(args[6]), limit = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(args[1]) || PyTuple_Size(args[1]) != 3) {
        PyErr_SetString(PyExc_TypeError, "ensure_rows: fill is (key_state, span, low)");
        return NULL;
    }
    unsigned long long fill_state = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[1], 0));
    double fill_span = PyFloat_AsDouble(PyTuple_GetItem(args[1], 1)), fill_low = PyFloat_AsDouble(PyTuple_GetItem(args[1], 2));
    if (PyErr_Occurred()) return NULL;
    if (shift < 1 || shift > 63 || row_bytes <= 0 || row_bytes % 4 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "ensure_rows: bad shift, row count or row size");
        return NULL;
    }
    Py_buffer ids, table, keys, weights, out;
    int got = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[2], &ids, PyBUF_SIMPLE) < 0) return NULL;
    got = 1;
    if (PyObject_GetBuffer(args[3], &table, PyBUF_WRITABLE) < 0) goto release;
    got = 2;
    if (PyObject_GetBuffer(args[4], &keys, PyBUF_WRITABLE) < 0) goto release;
    got = 3;
    if (PyObject_GetBuffer(args[8], &weights, PyBUF_WRITABLE) < 0) goto release;
    got = 4;
    if (PyObject_GetBuffer(args[9], &out, PyBUF_WRITABLE) < 0) goto release;
    got = 5;
    Py_ssize_t k = ids.len / 8, itemsize = table.itemsize == 8 ? 8 : 4, nbuckets = table.len / itemsize;
    Py_ssize_t capacity = keys.len / 8 < weights.len / row_bytes ? keys.len / 8 : weights.len / row_bytes;
    if (ids.len % 8 || out.len != k * 8 || (table.itemsize != 4 && table.itemsize != 8) || nbuckets < 2
            || (nbuckets & (nbuckets - 1)) || (64 - shift) != (unsigned)__builtin_ctzll((unsigned long long)nbuckets)
            || n > capacity) {
        PyErr_SetString(PyExc_ValueError, "ensure_rows: arrays of the wrong size or type");
        goto release;
    }
    const uint64_t *id = ids.buf;
    uint64_t *slot_ids = keys.buf, mask = (uint64_t)nbuckets - 1;
    int64_t *slots = out.buf;
    int wide = itemsize == 8;
    Py_ssize_t absent = 0;
    for (Py_ssize_t i = 0; i < k; i++) {   /* (the stages of gather_rows: buckets, then row ids, ahead) */
        if (i + 2 * AHEAD < k)
            __builtin_prefetch((const char *)table.buf + home_bucket(id[i + 2 * AHEAD], shift) * itemsize, 0, 2);
        if (i + AHEAD < k) {
            int64_t ahead = bucket_at(table.buf, wide, home_bucket(id[i + AHEAD], shift));
            if (ahead >= 0 && ahead < n) __builtin_prefetch(slot_ids + ahead, 0, 2);
        }
        uint64_t pos = home_bucket(id[i], shift);
        int64_t slot;
        for (;;) {
            slot = wide ? ((const int64_t *)table.buf)[pos] : ((const int32_t *)table.buf)[pos];
            if (slot < 0 || (slot < n && slot_ids[slot] == id[i])) break;
            pos = (pos + 1) & mask;
        }
        slots[i] = slot < 0 ? -1 : slot;
        absent += slot < 0;
    }
    if (absent && (n + absent > limit || n + absent > capacity)) {
        result = Py_NewRef(Py_None);
        goto release;
    }
    Py_ssize_t next = n;
    for (Py_ssize_t i = 0; i < k && next < n + absent; i++) {
        if (slots[i] >= 0) continue;
        uint64_t pos = home_bucket(id[i], shift);
        if (wide) {
            int64_t *t = table.buf;
            while (t[pos] >= 0) pos = (pos + 1) & mask;
            t[pos] = next;
        } else {
            int32_t *t = table.buf;
            while (t[pos] >= 0) pos = (pos + 1) & mask;
            t[pos] = (int32_t)next;
        }
        slot_ids[next] = id[i];
        uniform_row((char *)weights.buf + next * row_bytes, row_bytes / 4, 4, id[i], fill_state, fill_span, fill_low);
        slots[i] = next++;
    }
    result = PyLong_FromSsize_t(absent);
release:
    if (got >= 5) PyBuffer_Release(&out);
    if (got >= 4) PyBuffer_Release(&weights);
    if (got >= 3) PyBuffer_Release(&keys);
    if (got >= 2) PyBuffer_Release(&table);
    PyBuffer_Release(&ids);
    return result;
}
