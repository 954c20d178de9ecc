/* The server's per-message fast path in C: a CPython extension module (kvstore_lazy.protocol._fast).

Owns: decoding and encoding the common shape of a PBMeta (what ps-lite sends: one-byte keys, known fields, no
groups), gathering a row_sparse pull's rows straight from a row table into its reply, a round's new rows made in
the table in one pass (ensure_rows), the counter-based uniform values of new rows, a row_sparse push's checks in
one pass, optimizer updates and round merges in one call (store/kernels.c's own kernels, without ctypes' set-up),
optimizers.py's float parser, and receiving and sending a ZeroMQ message whole in one call (transport/zmq_van.py).
Each function either
gives exactly what the Python reference gives (protocol/pbmeta.py, protocol/kv.py, store/rows.py's RowIndex,
store/kernels.py, initializers.py, optimizers.py) or returns None (False), and the Python caller then takes its
general path, which decides every unusual case and names every error. Nothing here raises on a peer's bytes.
Does not own: what a request means, which rows exist or how absent rows are made (server/keys.py).

Built by setup.py beside store/_kernels.so with the limited API of CPython 3.11 (Py_LIMITED_API), so one build
loads in every CPython >= 3.11 (the server wheel runs on 3.13); arrays come in through the buffer protocol (no numpy
C API). The float flags of the kernels apply (-ffp-contract=off: no fused multiply-add), so the uniform values are
the float64 operations initializers.py does, in the same order. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>

#ifndef FAST_DIGEST
#error "build with -DFAST_DIGEST=\"<sha256 of this file>\" (setup.py does)"
#endif

#define EMPTY 2147483647  /* ps-lite's kEmpty */

/* ---------------------------------------------------------------------------------------------------------------
   PBMeta: field numbers 1..13 (meta.proto). Values of the scalar fields, in Meta's attribute names. */

enum { F_HEAD = 1, F_BODY = 2, F_CONTROL = 3, F_REQUEST = 4, F_PUSH = 5, F_SIMPLE_APP = 6, F_APP_ID = 7,
       F_TIMESTAMP = 8, F_DATA_TYPE = 9, F_CUSTOMER_ID = 10, F_DATA_SIZE = 11, F_PULL = 12, F_PRIORITY = 13 };

static PyObject *NAMES[14];          /* interned attribute names by field number (NULL: not a scalar field) */
static PyObject *S_CONTROL, *S_BODY, *S_DATA_TYPE, *S_CMD;

static int is_bool_field(int number) {
    return number == F_REQUEST || number == F_PUSH || number == F_SIMPLE_APP || number == F_PULL;
}

/* A varint at *pos (at most 10 bytes, bits past 64 dropped, as protobuf and pbmeta._read_varint); 0 if truncated or
   longer. */
static int read_varint(const unsigned char *buf, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*pos >= end) return 0;
        unsigned char byte = buf[(*pos)++];
        if (shift < 64) result |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) { *out = result; return 1; }
    }
    return 0;
}

static int32_t int32_of(uint64_t v) { return (int32_t)(uint32_t)(v & 0xFFFFFFFFu); }

/* decode_meta(buf) -> dict of Meta's fields ("control": None or the control bytes, all parts concatenated), or None
   when the bytes are not in the shape this decoder takes (malformed, groups): then pbmeta's Python decoders decide. */
static PyObject *decode_meta(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t end = view.len, pos = 0;
    int64_t scalar[14];
    int seen[14] = {0};
    Py_ssize_t body_at = -1, body_len = 0;
    Py_ssize_t control_at[8], control_len[8];
    int controls = 0;
    PyObject *data_type = PyList_New(0), *out = NULL, *control = NULL, *body = NULL;
    if (data_type == NULL) goto done;
    while (pos < end) {
        uint64_t key, value;
        if (!read_varint(buf, end, &pos, &key)) goto fallback;
        uint64_t number = key >> 3;
        int wire = (int)(key & 7);
        if (number == 0) goto fallback;
        if (wire == 0) {
            if (!read_varint(buf, end, &pos, &value)) goto fallback;
            if (number == F_DATA_TYPE) {
                PyObject *item = PyLong_FromLong(int32_of(value));
                if (item == NULL || PyList_Append(data_type, item) < 0) { Py_XDECREF(item); goto error; }
                Py_DECREF(item);
            } else if (number <= 13 && NAMES[number] != NULL) {
                scalar[number] = is_bool_field((int)number) ? (value != 0) : int32_of(value);
                seen[number] = 1;
            }
        } else if (wire == 2) {
            uint64_t size;
            if (!read_varint(buf, end, &pos, &size) || size > (uint64_t)(end - pos)) goto fallback;
            Py_ssize_t at = pos;
            pos += (Py_ssize_t)size;
            if (number == F_BODY) {
                body_at = at, body_len = (Py_ssize_t)size;
            } else if (number == F_CONTROL) {
                if (controls == 8) goto fallback;
                control_at[controls] = at, control_len[controls] = (Py_ssize_t)size, controls++;
            } else if (number == F_DATA_TYPE) {    /* packed */
                Py_ssize_t p = at;
                while (p < pos) {
                    if (!read_varint(buf, pos, &p, &value)) goto fallback;
                    PyObject *item = PyLong_FromLong(int32_of(value));
                    if (item == NULL || PyList_Append(data_type, item) < 0) { Py_XDECREF(item); goto error; }
                    Py_DECREF(item);
                }
            }
        } else if (wire == 1 || wire == 5) {       /* fixed64 / fixed32: no PBMeta field has them: skipped */
            Py_ssize_t size = wire == 1 ? 8 : 4;
            if (end - pos < size) goto fallback;
            pos += size;
        } else {
            goto fallback;                          /* groups (3, 4) and invalid wire types */
        }
    }
    out = PyDict_New();
    if (out == NULL) goto error;
    /* in Meta's field order (the dataclass's __dict__ order): head body control request push pull simple_app app_id
       timestamp data_type customer_id data_size priority */
    static const int order[] = {F_HEAD, F_BODY, F_CONTROL, F_REQUEST, F_PUSH, F_PULL, F_SIMPLE_APP, F_APP_ID,
                                F_TIMESTAMP, F_DATA_TYPE, F_CUSTOMER_ID, F_DATA_SIZE, F_PRIORITY};
    for (int i = 0; i < 13; i++) {
        int number = order[i];
        PyObject *value;
        if (number == F_BODY) {
            value = body = PyBytes_FromStringAndSize(body_at >= 0 ? (const char *)buf + body_at : "", body_len);
            if (value == NULL || PyDict_SetItem(out, S_BODY, value) < 0) goto error;
            continue;
        }
        if (number == F_CONTROL) {
            if (controls == 0) {
                if (PyDict_SetItem(out, S_CONTROL, Py_None) < 0) goto error;
                continue;
            }
            Py_ssize_t total = 0;
            for (int c = 0; c < controls; c++) total += control_len[c];
            control = PyBytes_FromStringAndSize(NULL, total);
            if (control == NULL) goto error;
            char *dst = PyBytes_AsString(control);
            for (int c = 0; c < controls; c++) {
                memcpy(dst, buf + control_at[c], (size_t)control_len[c]);
                dst += control_len[c];
            }
            if (PyDict_SetItem(out, S_CONTROL, control) < 0) goto error;
            continue;
        }
        if (number == F_DATA_TYPE) {
            if (PyDict_SetItem(out, S_DATA_TYPE, data_type) < 0) goto error;
            continue;
        }
        int64_t v = seen[number] ? scalar[number]
                  : (number == F_APP_ID || number == F_TIMESTAMP) ? EMPTY : 0;
        value = is_bool_field(number) ? PyBool_FromLong((long)v) : PyLong_FromLongLong(v);
        if (value == NULL) goto error;
        int failed = PyDict_SetItem(out, NAMES[number], value) < 0;
        Py_DECREF(value);
        if (failed) goto error;
    }
    goto done;
fallback:
    Py_XDECREF(out);
    out = Py_None;
    Py_INCREF(out);
    goto done;
error:
    Py_CLEAR(out);
done:
    Py_XDECREF(data_type);
    Py_XDECREF(control);
    Py_XDECREF(body);
    PyBuffer_Release(&view);
    return out;
}

/* ---- encoding */

typedef struct { unsigned char *p; } Writer;

static void put_varint(Writer *w, uint64_t v) {
    while (v >= 0x80) { *w->p++ = (unsigned char)(v | 0x80); v >>= 7; }
    *w->p++ = (unsigned char)v;
}

/* An int or bool attribute as int64 (proto2 writes a negative int32/int64 sign-extended to 64 bits); 0 if it is
   anything else or out of range (then the Python encoder decides). */
static int int_value(PyObject *v, int64_t *out) {
    if (v == NULL || !PyLong_Check(v)) return 0;    /* bool is a subclass of int */
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    *out = x;
    return 1;
}

static int field_value(PyObject *dict, int number, int64_t *out) {
    return int_value(PyDict_GetItemWithError(dict, NAMES[number]), out);
}

/* encode_meta(meta.__dict__) -> the bytes Van::PackMeta writes, or None for what the Python encoder handles (a body,
   a control command, values that are not plain ints). Fields as pbmeta._encode_meta_slow writes them. */
static PyObject *encode_meta(PyObject *self, PyObject *dict) {
    if (!PyDict_Check(dict)) { PyErr_SetString(PyExc_TypeError, "encode_meta takes a Meta's __dict__"); return NULL; }
    PyObject *body = PyDict_GetItemWithError(dict, S_BODY);
    if (body == NULL || !PyBytes_Check(body) || PyBytes_Size(body) != 0) goto fallback;
    PyObject *control = PyDict_GetItemWithError(dict, S_CONTROL);
    if (control == NULL) goto fallback;
    PyObject *cmd = PyObject_GetAttr(control, S_CMD);
    int64_t cmd_value;
    int plain = int_value(cmd, &cmd_value);
    Py_XDECREF(cmd);
    if (!plain || cmd_value != 0) { PyErr_Clear(); goto fallback; }
    PyObject *data_type = PyDict_GetItemWithError(dict, S_DATA_TYPE);
    if (data_type == NULL || !PyList_CheckExact(data_type) || PyList_Size(data_type) > 64) goto fallback;
    Py_ssize_t ntypes = PyList_Size(data_type);
    int64_t v[14];
    static const int scalars[] = {F_HEAD, F_REQUEST, F_PUSH, F_SIMPLE_APP, F_APP_ID, F_TIMESTAMP, F_CUSTOMER_ID,
                                  F_DATA_SIZE, F_PULL, F_PRIORITY};
    for (int i = 0; i < 10; i++)
        if (!field_value(dict, scalars[i], &v[scalars[i]])) goto fallback;
    unsigned char out[16 * 11 + 64 * 10 + 8];
    unsigned char packed[64 * 10];
    Writer w = {out}, pw = {packed};
    for (Py_ssize_t i = 0; i < ntypes; i++) {
        int64_t t;
        if (!int_value(PyList_GetItem(data_type, i), &t)) goto fallback;
        put_varint(&pw, (uint64_t)t);
    }
    *w.p++ = 0x08; put_varint(&w, (uint64_t)v[F_HEAD]);
    *w.p++ = 0x20; put_varint(&w, (uint64_t)v[F_REQUEST]);
    *w.p++ = 0x28; put_varint(&w, (uint64_t)v[F_PUSH]);
    *w.p++ = 0x30; put_varint(&w, (uint64_t)v[F_SIMPLE_APP]);
    if (v[F_APP_ID] != EMPTY) { *w.p++ = 0x38; put_varint(&w, (uint64_t)v[F_APP_ID]); }
    if (v[F_TIMESTAMP] != EMPTY) { *w.p++ = 0x40; put_varint(&w, (uint64_t)v[F_TIMESTAMP]); }
    if (ntypes) {
        *w.p++ = 0x4A;
        put_varint(&w, (uint64_t)(pw.p - packed));
        memcpy(w.p, packed, (size_t)(pw.p - packed));
        w.p += pw.p - packed;
    }
    *w.p++ = 0x50; put_varint(&w, (uint64_t)v[F_CUSTOMER_ID]);
    if (v[F_DATA_SIZE]) { *w.p++ = 0x58; put_varint(&w, (uint64_t)v[F_DATA_SIZE]); }
    *w.p++ = 0x60; put_varint(&w, (uint64_t)v[F_PULL]);
    *w.p++ = 0x68; put_varint(&w, (uint64_t)v[F_PRIORITY]);
    return PyBytes_FromStringAndSize((const char *)out, w.p - out);
fallback:
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------------------------
   gather_rows(keys, table, slot_ids, shift, weights, row_offset, local_rows, row_bytes[, fill])
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
   (local id + row_offset) here instead: payload is bytes, `missing` their number and missing_ids None. */

#define MULT 0xBF58476D1CE4E5B9ULL   /* RowIndex's hash (store/kernels.c home()): tests compare the two */

static inline uint64_t home_bucket(uint64_t row_id, unsigned long long shift) {
    return (((row_id >> 31) ^ row_id) * MULT) >> shift;
}

/* One row of initializers.UniformRows' values (see uniform_rows below): row r's `ncols` values, float32 (itemsize 4)
   or float64 (8), at out. */
#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void uniform_row(char *out, Py_ssize_t ncols, Py_ssize_t itemsize, uint64_t r, uint64_t key_state,
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

static PyObject *gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 && nargs != 9) { PyErr_SetString(PyExc_TypeError, "gather_rows takes 8 or 9 arguments"); return NULL; }
    unsigned long long shift = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long row_offset = PyLong_AsUnsignedLongLong(args[5]);
    long long local_rows = PyLong_AsLongLong(args[6]);
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[7]);
    int fill = nargs == 9 && args[8] != Py_None;
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
    Py_buffer keys, table, ids, weights;
    PyObject *result = NULL, *payload = NULL, *lens = NULL, *missing = NULL, *missing_ids = NULL;
    int64_t *slots = NULL;
    int got = 0;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0) return NULL;
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
    slots = PyMem_Malloc((size_t)nrows * sizeof(int64_t));
    if (slots == NULL) { PyErr_NoMemory(); goto release; }
    const uint64_t *slot_ids = ids.buf;
    int wide = table.itemsize == 8;
    uint64_t mask = (uint64_t)nbuckets - 1;
    for (Py_ssize_t i = 0; i < nrows; i++) {     /* check and probe every row before building anything */
        uint64_t key;
        if (i + 8 < nrows) {   /* the home bucket 8 rows ahead (store/kernels.c PREFETCH: the misses overlap) */
            memcpy(&key, kb + 8 * (i + 9), 8);
            uint64_t ahead = key - master + row_offset;
            __builtin_prefetch((const char *)table.buf + home_bucket(ahead, shift) * table.itemsize, 0);
        }
        memcpy(&key, kb + 8 * (i + 1), 8);
        if (key < master || (i && key <= previous) || key - master >= (uint64_t)local_rows) goto fallback;
        previous = key;
        uint64_t row_id = key - master + row_offset;
        uint64_t pos = home_bucket(row_id, shift);
        int64_t slot;
        for (;;) {
            slot = wide ? ((const int64_t *)table.buf)[pos] : ((const int32_t *)table.buf)[pos];
            if (slot < 0) break;
            if (slot < nslots && slot_ids[slot] == row_id) break;
            pos = (pos + 1) & mask;
        }
        if (slot >= 0 && (slot + 1) * row_bytes > weights.len) goto fallback;
        slots[i] = slot < 0 ? -1 : slot;
        absent += slot < 0;
    }
    char *dst;
    if (absent && !fill) {
        payload = PyByteArray_FromStringAndSize(NULL, nrows * row_bytes);
        missing = PyBytes_FromStringAndSize(NULL, absent * 8);
        missing_ids = PyBytes_FromStringAndSize(NULL, absent * 8);
        if (payload == NULL || missing == NULL || missing_ids == NULL) goto release;
        dst = PyByteArray_AsString(payload);
    } else {
        payload = PyBytes_FromStringAndSize(NULL, nrows * row_bytes);
        if (payload == NULL) goto release;
        dst = PyBytes_AsString(payload);
    }
    const char *rows = weights.buf;
    int64_t *positions = absent && !fill ? (int64_t *)PyBytes_AsString(missing) : NULL;
    int64_t *local_ids = absent && !fill ? (int64_t *)PyBytes_AsString(missing_ids) : NULL;
    for (Py_ssize_t i = 0; i < nrows; i++) {
        if (i + 8 < nrows && slots[i + 8] >= 0) __builtin_prefetch(rows + slots[i + 8] * row_bytes, 0);
        if (slots[i] >= 0) {
            memcpy(dst + i * row_bytes, rows + slots[i] * row_bytes, (size_t)row_bytes);
        } else {
            uint64_t key;
            memcpy(&key, kb + 8 * (i + 1), 8);
            if (fill) {
                uniform_row(dst + i * row_bytes, row_bytes / 4, 4, key - master + row_offset, fill_state, fill_span,
                            fill_low);
                continue;
            }
            memset(dst + i * row_bytes, 0, (size_t)row_bytes);
            *positions++ = i;
            *local_ids++ = (int64_t)(key - master);
        }
    }
    lens = PyBytes_FromStringAndSize(NULL, nkeys * 4);
    if (lens == NULL) goto release;
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

static PyObject *ensure_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
    for (Py_ssize_t i = 0; i < k; i++) {
        if (i + 8 < k) __builtin_prefetch((const char *)table.buf + home_bucket(id[i + 8], shift) * itemsize, 0);
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

/* ---------------------------------------------------------------------------------------------------------------
   uniform_rows(out, row_ids, key_state, span, low, itemsize): for every row r (uint64 row_ids) and column c of the
   (len(row_ids), ncols) float32 (itemsize 4) or float64 (8) `out`, in float64: u = (bits(r, c) >> 11) * 2**-53,
   then u * span, then + low, cast to out's type (initializers.UniformRows; uniform01 is span 1, low 0). key_state
   is absorb(absorb(0, seed), key), so state(r) = mix64((r ^ key_state) + GAMMA), bits = mix64(state + (c+1) GAMMA). */

static PyObject *uniform_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "uniform_rows takes 6 arguments"); return NULL; }
    uint64_t key_state = PyLong_AsUnsignedLongLong(args[2]);
    double span = PyFloat_AsDouble(args[3]), low = PyFloat_AsDouble(args[4]);
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "uniform_rows writes float32 or float64");
        return NULL;
    }
    Py_buffer out, ids;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &ids, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&out); return NULL; }
    Py_ssize_t nrows = ids.len / 8;
    if (ids.len % 8 || (nrows == 0 ? out.len != 0 : out.len % (nrows * itemsize))) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "uniform_rows: out is not len(row_ids) rows of whole values");
        return NULL;
    }
    Py_ssize_t ncols = nrows ? out.len / (nrows * itemsize) : 0;
    const unsigned char *idb = ids.buf;
    for (Py_ssize_t i = 0; i < nrows; i++) {
        uint64_t r;
        memcpy(&r, idb + 8 * i, 8);
        uniform_row((char *)out.buf + i * ncols * itemsize, ncols, itemsize, r, key_state, span, low);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------------------------
   Layout checks of a row_sparse request (protocol/kv.py _row_sparse, _rows), one pass each instead of a few numpy
   calls: True when the request is what a worker sends, False for anything the Python checks must look at (they
   name what is wrong). */

/* sorted_rows(keys): the uint64 keys frame has row keys strictly increasing from the master key (keys[0]) on, the
   last one at most 2**63 - 1 past it (MXNet's int64 row ids). */
static PyObject *sorted_rows(PyObject *self, PyObject *arg) {
    Py_buffer keys;
    if (PyObject_GetBuffer(arg, &keys, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = keys.len / 8;
    int ok = keys.len % 8 == 0 && n >= 2;
    if (ok) {
        const unsigned char *kb = keys.buf;
        uint64_t master, previous, key;
        memcpy(&master, kb, 8);
        previous = master;
        for (Py_ssize_t i = 1; i < n && ok; i++) {
            memcpy(&key, kb + 8 * i, 8);
            ok = i == 1 ? key >= master : key > previous;
            previous = key;
        }
        ok = ok && previous - master <= (uint64_t)INT64_MAX;
    }
    PyBuffer_Release(&keys);
    return PyBool_FromLong(ok);
}

/* row_lens(lens, row_bytes, row_size): the int32 lens frame is 0 for the master key, then each row's bytes or
   elements (a stock worker's lens may be either: see kv._rows). */
static PyObject *row_lens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "row_lens takes 3 arguments"); return NULL; }
    long long row_bytes = PyLong_AsLongLong(args[1]), row_size = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer lens;
    if (PyObject_GetBuffer(args[0], &lens, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = lens.len / 4;
    int ok = lens.len % 4 == 0 && n >= 1;
    const unsigned char *lb = lens.buf;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        int32_t len;
        memcpy(&len, lb + 4 * i, 4);
        ok = i == 0 ? len == 0 : (len == row_bytes || len == row_size);
    }
    PyBuffer_Release(&lens);
    return PyBool_FromLong(ok);
}

/* ---------------------------------------------------------------------------------------------------------------
   Optimizer updates in one call, no numpy or ctypes set-up: the update kernels of store/kernels.c themselves
   (sgd_rows, sgd_mom_rows, adam_rows), reached through the addresses optimizers.py hands over once
   (set_update_kernels, from store/kernels.py's loaded library), so the arithmetic is that one compiled code and its
   results are the same bits. `slots` None: a dense array, one row of all its elements (slot 0), the tables and the
   gradient of one shape; else the row tables' rows `slots` (int64, each in [0, rows)) get the gradient's rows (2-D
   tables of one shape, a (len(slots), cols) gradient), as kernels.py's wrappers and kernels.accepts take them.

   set_update_kernels(sgd_rows, sgd_mom_rows, adam_rows, merge_rows_f32): the functions' addresses (ints).
   sgd(weight, slots, grad, lr, wd, rescale, clip) -> bool: kernels.sgd_rows.
   sgd_mom(weight, mom, slots, grad, lr, wd, rescale, clip, momentum) -> bool: kernels.sgd_mom_rows (mom None: no
   momentum state, multi_sgd_update).
   adam(weight, mean, var, slots, grad, lr, wd, beta1, beta2, eps, rescale, clip, square_first) -> bool.
   Each returns False, touching nothing, unless every array is a C-contiguous float32 buffer (int64 slots) of the
   shapes above, the tables writable, or no kernels were handed over: the caller then takes its own path. */

typedef void (*SgdRows)(float *, const int64_t *, int64_t, const float *, int64_t, float, float, float, float);
typedef void (*SgdMomRows)(float *, float *, const int64_t *, int64_t, const float *, int64_t, float, float, float,
                           float, float);
typedef void (*AdamRows)(float *, float *, float *, const int64_t *, int64_t, const float *, int64_t, float, float,
                         float, float, float, float, float, int);
typedef int64_t (*MergeRows)(const int64_t *, const float *, int64_t, const int64_t *, const float *, int64_t, int64_t,
                             int64_t *, float *);
static SgdRows sgd_rows_fn;
static SgdMomRows sgd_mom_rows_fn;
static AdamRows adam_rows_fn;
static MergeRows merge_rows_fn;

static PyObject *set_update_kernels(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "set_update_kernels takes 4 arguments"); return NULL; }
    void *sgd = PyLong_AsVoidPtr(args[0]), *sgd_mom = PyLong_AsVoidPtr(args[1]), *adam = PyLong_AsVoidPtr(args[2]);
    void *merge = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    sgd_rows_fn = (SgdRows)sgd;
    sgd_mom_rows_fn = (SgdMomRows)sgd_mom;
    adam_rows_fn = (AdamRows)adam;
    merge_rows_fn = (MergeRows)merge;
    Py_RETURN_NONE;
}

/* The buffers of an update: `ntables` tables (writable), then the gradient, then the slots (or None). */
typedef struct {
    Py_buffer views[5];
    int held;
    int64_t n, cols;
    const int64_t *slots;
} Update;

static const int64_t ROW0[1] = {0};

static void release_update(Update *u) {
    for (int i = 0; i < u->held; i++) PyBuffer_Release(&u->views[i]);
    u->held = 0;
}

static int same_shape(const Py_buffer *a, const Py_buffer *b) {
    if (a->ndim != b->ndim || a->len != b->len) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* 1: the arrays are what the kernels take (views held: release_update); 0: they are not (nothing held). */
static int update_arrays(PyObject *const *tables, int ntables, PyObject *grad, PyObject *slots, Update *u) {
    u->held = 0;
    for (int i = 0; i <= ntables; i++) {
        PyObject *array = i < ntables ? tables[i] : grad;
        int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (i < ntables ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(array, &u->views[i], flags) < 0) { PyErr_Clear(); goto no; }
        u->held++;
        const char *format = u->views[i].format;
        if (u->views[i].itemsize != 4 || format == NULL || strcmp(format, "f") != 0) goto no;
        if (i && i < ntables && !same_shape(&u->views[i], &u->views[0])) goto no;
    }
    Py_buffer *table = &u->views[0], *g = &u->views[ntables];
    if (slots == Py_None) {
        if (!same_shape(g, table)) goto no;
        u->n = 1, u->cols = table->len / 4, u->slots = ROW0;
        return 1;
    }
    Py_buffer *sv = &u->views[ntables + 1];
    if (PyObject_GetBuffer(slots, sv, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); goto no; }
    u->held++;
    const char *format = sv->format;
    if (sv->itemsize != 8 || sv->ndim != 1 || format == NULL || (strcmp(format, "l") && strcmp(format, "q"))
            || table->ndim != 2 || g->ndim != 2 || g->shape[0] != sv->shape[0] || g->shape[1] != table->shape[1])
        goto no;
    u->n = sv->shape[0], u->cols = table->shape[1], u->slots = sv->buf;
    for (int64_t i = 0; i < u->n; i++)
        if (u->slots[i] < 0 || u->slots[i] >= table->shape[0]) goto no;
    return 1;
no:
    release_update(u);
    return 0;
}

/* An update's arguments: `want` of them, the tables args[0..ntables), the gradient args[grad_at], the slots
   args[slots_at], `nfloats` float32 scalars from args[first_float] on (into f). 1: the kernel (`ready`: its address
   was handed over) can run (u's views held: end_update), 0: it cannot (return False), -1: an error is set. */
static int begin_update(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int ntables,
                        int grad_at, int slots_at, int first_float, int nfloats, float *f, int ready, Update *u) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    for (int i = 0; i < nfloats; i++) {
        f[i] = (float)PyFloat_AsDouble(args[first_float + i]);
        if (f[i] == -1.0f && PyErr_Occurred()) return -1;
    }
    return ready && update_arrays(args, ntables, args[grad_at], args[slots_at], u);
}

static PyObject *end_update(Update *u) {
    release_update(u);
    Py_RETURN_TRUE;
}

static PyObject *sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[4];
    Update u;
    int ok = begin_update("sgd", args, nargs, 7, 1, 2, 1, 3, 4, f, sgd_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    sgd_rows_fn(u.views[0].buf, u.slots, u.n, u.views[1].buf, u.cols, f[0], f[1], f[2], f[3]);
    return end_update(&u);
}

static PyObject *sgd_mom(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[5];
    Update u;
    int has_mom = nargs > 1 && args[1] != Py_None;
    int ok = begin_update("sgd_mom", args, nargs, 9, has_mom ? 2 : 1, 3, 2, 4, 5, f, sgd_mom_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    sgd_mom_rows_fn(u.views[0].buf, has_mom ? u.views[1].buf : NULL, u.slots, u.n, u.views[has_mom ? 2 : 1].buf,
                    u.cols, f[0], f[1], f[2], f[3], f[4]);
    return end_update(&u);
}

static PyObject *adam(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[7];
    Update u;
    int square_first = nargs == 13 ? PyObject_IsTrue(args[12]) : 0;
    if (square_first < 0) return NULL;
    int ok = begin_update("adam", args, nargs, 13, 3, 4, 3, 5, 7, f, adam_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    adam_rows_fn(u.views[0].buf, u.views[1].buf, u.views[2].buf, u.slots, u.n, u.views[3].buf, u.cols, f[0], f[1],
                 f[2], f[3], f[4], f[5], f[6], square_first);
    return end_update(&u);
}

/* merge_rows(ids_a, vals_a, ids_b, vals_b) -> (ids, vals) or None: kernels.merge_rows of a dist_sync round (kernels.c
   merge_rows_f32: the union of two sorted unique int64 id lists, rows in both summed a + b) as bytearrays of the
   int64 ids and the float32 rows; None unless the ids are 1-D int64 and the rows C-contiguous float32 (len(ids),
   cols) of one cols (kernels.merge_rows decides). */
static PyObject *merge_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "merge_rows takes 4 arguments"); return NULL; }
    if (merge_rows_fn == NULL) Py_RETURN_NONE;
    Py_buffer v[4];
    int held = 0;
    PyObject *ids = NULL, *vals = NULL, *result = NULL;
    for (; held < 4; held++) {
        if (PyObject_GetBuffer(args[held], &v[held], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            goto fallback;
        }
        const char *format = v[held].format;
        int is_ids = held % 2 == 0;
        if (format == NULL || v[held].itemsize != (is_ids ? 8 : 4) || v[held].ndim != (is_ids ? 1 : 2)
                || (is_ids ? strcmp(format, "l") && strcmp(format, "q") : strcmp(format, "f") != 0)) {
            held++;
            goto fallback;
        }
    }
    int64_t na = v[0].shape[0], nb = v[2].shape[0], cols = v[1].shape[1];
    if (v[1].shape[0] != na || v[3].shape[0] != nb || v[3].shape[1] != cols) goto fallback;
    ids = PyByteArray_FromStringAndSize(NULL, (na + nb) * 8);
    vals = PyByteArray_FromStringAndSize(NULL, (na + nb) * cols * 4);
    if (ids == NULL || vals == NULL) goto done;
    int64_t n = merge_rows_fn(v[0].buf, v[1].buf, na, v[2].buf, v[3].buf, nb, cols,
                              (int64_t *)PyByteArray_AsString(ids), (float *)PyByteArray_AsString(vals));
    if (PyByteArray_Resize(ids, n * 8) < 0 || PyByteArray_Resize(vals, n * cols * 4) < 0) goto done;
    result = Py_BuildValue("(NN)", ids, vals);   /* takes both references */
    ids = vals = NULL;
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(vals);
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------------------------------------
   parse_float32(text) -> float or None: optimizers._dmlc_parse(text, np.float32) (dmlc::ParseFloat<float>, step by
   step: not correctly rounded), for the ASCII text str(float) gives, which is what a changing hyper-parameter (Adam's
   bias-corrected lr, every update) is parsed from; None for anything else (whitespace, non-ASCII, inf/nan, an
   integer part of more than 15 digits): the Python parser decides. The float32 operations are the ones numpy does
   there, in the same order; the fraction's digits (at most 19, as uint64) become a double, divided by 10**digits
   (exact) in double, as Python's int / float does. */

static const double POW10[20] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14,
                                 1e15, 1e16, 1e17, 1e18, 1e19};

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static PyObject *parse_float32(PyObject *self, PyObject *arg) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &n);
    if (s == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if ((unsigned char)s[k] <= 0x20 || (unsigned char)s[k] >= 0x80) Py_RETURN_NONE;
    Py_ssize_t i = 0, j;
    int neg = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    if (i < n && (s[i] == 'i' || s[i] == 'I' || s[i] == 'n' || s[i] == 'N')) Py_RETURN_NONE;
    uint64_t whole = 0;
    for (j = i; j < n && is_digit(s[j]); j++) {
        if (j - i == 15) Py_RETURN_NONE;
        whole = whole * 10 + (uint64_t)(s[j] - '0');
    }
    float value = (float)(double)whole;
    i = j;
    if (i < n && s[i] == '.') {
        i++;
        uint64_t digits = 0;
        int count = 0;
        for (j = i; j < n && is_digit(s[j]); j++)
            if (count < 19) digits = digits * 10 + (uint64_t)(s[j] - '0'), count++;
        if (count) value = value + (float)((double)digits / POW10[count]);
        i = j;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        int frac = i < n && s[i] == '-';
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        int expon = 0;
        for (j = i; j < n && is_digit(s[j]); j++)
            if (expon < 38) expon = expon * 10 + (s[j] - '0');
        if (expon > 38) expon = 38;
        float scale = 1.0f;
        while (expon >= 8) scale = scale * 1e8f, expon -= 8;
        while (expon > 0) scale = scale * 10.0f, expon--;
        value = frac ? value / scale : value * scale;
    }
    return PyFloat_FromDouble((double)(neg ? -value : value));
}

/* row_push(keys, lens, vals_len, itemsize) -> (local_ids, row_size, master) or None: a row_sparse push's frames as a
   worker sends them, checked in one pass: what protocol/kv.py's decode_kv, _row_sparse and _rows check, for a push of
   at least one row (uint64 keys, the row keys strictly increasing from the master key on and at most 2**63 - 1 past
   it; one int32 len per key, 0 for the master key, then each row's bytes or elements; vals_len bytes a whole number
   of rows of whole values). local_ids (a bytearray of int64) are the row keys less the master key. None for
   anything else: kv.py's checks decide and name what is wrong. */
static PyObject *row_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "row_push takes 4 arguments"); return NULL; }
    Py_ssize_t vals_len = PyLong_AsSsize_t(args[2]), itemsize = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer keys, lens;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &lens, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&keys); return NULL; }
    PyObject *ids = NULL, *result = NULL;
    Py_ssize_t nkeys = keys.len / 8, nrows = nkeys - 1;
    if (keys.len % 8 || nkeys < 2 || lens.len != nkeys * 4 || itemsize <= 0 || vals_len % nrows) goto fallback;
    Py_ssize_t row_bytes = vals_len / nrows, row_size = row_bytes / itemsize;
    if (row_bytes == 0 || row_bytes % itemsize || row_bytes > INT32_MAX) goto fallback;
    const unsigned char *kb = keys.buf, *lb = lens.buf;
    int32_t len;
    memcpy(&len, lb, 4);
    if (len != 0) goto fallback;
    for (Py_ssize_t i = 1; i < nkeys; i++) {
        memcpy(&len, lb + 4 * i, 4);
        if (len != row_bytes && len != row_size) goto fallback;
    }
    uint64_t master, previous, key;
    memcpy(&master, kb, 8);
    ids = PyByteArray_FromStringAndSize(NULL, nrows * 8);
    if (ids == NULL) goto done;
    int64_t *local = (int64_t *)PyByteArray_AsString(ids);
    previous = master;
    for (Py_ssize_t i = 1; i < nkeys; i++) {
        memcpy(&key, kb + 8 * i, 8);
        if (i == 1 ? key < master : key <= previous) goto fallback;
        if (key - master > (uint64_t)INT64_MAX) goto fallback;
        local[i - 1] = (int64_t)(key - master);
        previous = key;
    }
    result = Py_BuildValue("(NnK)", ids, row_size, (unsigned long long)master);   /* takes ids' reference */
    ids = NULL;
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&lens);
    return result;
}

/* ---------------------------------------------------------------------------------------------------------------
   ZeroMQ messages whole: one call receives every part of a message (or sends every part of one), where pyzmq's
   Socket.recv/send cost a Python call, a Frame and, per received part, a getsockopt(RCVMORE) through an enum
   lookup. The functions are those of the libzmq pyzmq itself loaded (transport/zmq_van.py finds it and hands their
   addresses over: set_zmq), used on the sockets pyzmq made (their `underlying` handles), from the thread that owns
   them, as pyzmq's own calls are.

   set_zmq(msg_init, msg_recv, msg_close, msg_data, msg_size, msg_more, msg_gets, send): the addresses (ints).
   recv_message(handle, zero_copy_min, peer) -> (parts, peer_address, nbytes), or None if no message is queued
     (ZMQ_DONTWAIT). Parts shorter than zero_copy_min are bytes; longer ones memoryviews of a ZmqPart that keeps the
     zmq_msg_t (no copy), writable, as pyzmq's Frame. peer_address: the last part's "Peer-Address" property with
     `peer` (None without, or for a transport that has none). An error of libzmq raises OSError(errno).
   send_message(handle, parts) -> True once libzmq took the message, False if it could not take the first part
     now (EAGAIN: nothing was sent); a multipart message is then taken whole (ZeroMQ's guarantee), so the later
     parts do not wait. `parts`: a list of objects with a contiguous buffer, copied (zmq_send); the first part of a
     received message is always bytes (the ROUTER's identity). */

typedef struct { _Alignas(8) unsigned char bytes[64]; } zmsg;     /* zmq_msg_t: 64 bytes, pointer-aligned */
#define Z_DONTWAIT 1
#define Z_SNDMORE 2

static int (*z_msg_init)(zmsg *);
static int (*z_msg_recv)(zmsg *, void *, int);
static int (*z_msg_close)(zmsg *);
static void *(*z_msg_data)(zmsg *);
static size_t (*z_msg_size)(const zmsg *);
static int (*z_msg_more)(const zmsg *);
static const char *(*z_msg_gets)(const zmsg *, const char *);
static int (*z_send)(void *, const void *, size_t, int);
static PyObject *PartType;

typedef struct { PyObject_HEAD zmsg msg; } Part;

static void part_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    z_msg_close(&((Part *)self)->msg);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static int part_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    zmsg *msg = &((Part *)self)->msg;
    return PyBuffer_FillInfo(view, self, z_msg_data(msg), (Py_ssize_t)z_msg_size(msg), 0, flags);
}

static PyType_Slot part_slots[] = {
    {Py_tp_dealloc, part_dealloc},
    {Py_bf_getbuffer, part_getbuffer},
    {Py_tp_doc, "One received ZeroMQ message part kept without a copy (the buffer of recv_message's memoryviews)."},
    {0, NULL},
};
static PyType_Spec part_spec = {"kvstore_lazy.protocol._fast.ZmqPart", sizeof(Part), 0, Py_TPFLAGS_DEFAULT,
                                part_slots};

static PyObject *set_zmq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) { PyErr_SetString(PyExc_TypeError, "set_zmq takes 8 arguments"); return NULL; }
    void *addr[8];
    for (int i = 0; i < 8; i++) {
        addr[i] = PyLong_AsVoidPtr(args[i]);
        if (addr[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "set_zmq: a function address is 0");
            return NULL;
        }
    }
    z_msg_init = addr[0]; z_msg_recv = addr[1]; z_msg_close = addr[2]; z_msg_data = addr[3];
    z_msg_size = addr[4]; z_msg_more = addr[5]; z_msg_gets = addr[6]; z_send = addr[7];
    Py_RETURN_NONE;
}

static int zmq_ready(void) {
    if (z_send != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "set_zmq was not called");
    return 0;
}

static PyObject *zmq_error(const char *what) {
    int err = errno;
    PyObject *args = Py_BuildValue("(is)", err, what);
    if (args != NULL) { PyErr_SetObject(PyExc_OSError, args); Py_DECREF(args); }
    return NULL;
}

static PyObject *recv_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "recv_message takes 3 arguments"); return NULL; }
    if (!zmq_ready()) return NULL;
    void *handle = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t zero_copy_min = PyLong_AsSsize_t(args[1]);
    int peer = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred() || peer < 0) return NULL;
    PyObject *parts = PyList_New(0), *address = NULL, *item = NULL;
    if (parts == NULL) return NULL;
    Py_ssize_t total = 0;
    int more = 1, first = 1;
    zmsg msg;
    while (more) {
        z_msg_init(&msg);
        int rc;
        do { rc = z_msg_recv(&msg, handle, Z_DONTWAIT); } while (rc < 0 && errno == EINTR);
        if (rc < 0) {
            int err = errno;
            z_msg_close(&msg);
            if (first && err == EAGAIN) { Py_DECREF(parts); Py_RETURN_NONE; }
            errno = err;
            zmq_error("zmq_msg_recv");
            goto error;
        }
        first = 0;
        Py_ssize_t size = (Py_ssize_t)z_msg_size(&msg);
        total += size;
        more = z_msg_more(&msg);
        if (!more && peer) {
            const char *value = z_msg_gets(&msg, "Peer-Address");
            if (value != NULL && (address = PyUnicode_FromString(value)) == NULL) { z_msg_close(&msg); goto error; }
        }
        if (size < zero_copy_min || PyList_Size(parts) == 0) {
            item = PyBytes_FromStringAndSize(z_msg_data(&msg), size);
            z_msg_close(&msg);
        } else {
            allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)PartType, Py_tp_alloc);
            PyObject *holder = alloc((PyTypeObject *)PartType, 0);
            if (holder == NULL) { z_msg_close(&msg); goto error; }
            memcpy(&((Part *)holder)->msg, &msg, sizeof msg);   /* the holder owns the message now */
            item = PyMemoryView_FromObject(holder);
            Py_DECREF(holder);
        }
        if (item == NULL || PyList_Append(parts, item) < 0) goto error;
        Py_CLEAR(item);
    }
    if (address == NULL) { address = Py_None; Py_INCREF(address); }
    return Py_BuildValue("(NNn)", parts, address, total);
error:
    Py_XDECREF(item);
    Py_XDECREF(address);
    Py_DECREF(parts);
    return NULL;
}

static PyObject *send_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "send_message takes 2 arguments"); return NULL; }
    if (!zmq_ready()) return NULL;
    void *handle = PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) return NULL;
    PyObject *parts = args[1];
    if (!PyList_Check(parts)) { PyErr_SetString(PyExc_TypeError, "send_message: parts must be a list"); return NULL; }
    Py_INCREF(parts);
    Py_ssize_t n = PyList_Size(parts);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyList_GetItem(parts, i), &view, PyBUF_SIMPLE) < 0) goto done;
        int flags = (i + 1 < n ? Z_SNDMORE : 0) | (i == 0 ? Z_DONTWAIT : 0), rc;
        do { rc = z_send(handle, view.buf, (size_t)view.len, flags); } while (rc < 0 && errno == EINTR);
        int err = errno;
        PyBuffer_Release(&view);
        if (rc < 0) {
            if (i == 0 && err == EAGAIN) { result = Py_False; Py_INCREF(result); goto done; }
            errno = err;
            zmq_error("zmq_send");
            goto done;
        }
    }
    result = Py_True;
    Py_INCREF(result);
done:
    Py_DECREF(parts);
    return result;
}

static PyObject *digest(PyObject *self, PyObject *unused) { return PyUnicode_FromString(FAST_DIGEST); }

static PyMethodDef methods[] = {
    {"decode_meta", decode_meta, METH_O, "A PBMeta's fields as a dict, or None (see pbmeta.decode_meta)."},
    {"encode_meta", encode_meta, METH_O, "A Meta's __dict__ as PBMeta bytes, or None (see pbmeta.encode_meta)."},
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_FASTCALL,
     "A row_sparse pull's (payload, lens) from a row table, or None."},
    {"ensure_rows", (PyCFunction)(void (*)(void))ensure_rows, METH_FASTCALL,
     "RowTable.ensure of a float32 table with uniform initial values in one call, or None."},
    {"uniform_rows", (PyCFunction)(void (*)(void))uniform_rows, METH_FASTCALL,
     "Counter-based uniform initial values of rows."},
    {"sorted_rows", sorted_rows, METH_O, "Whether a keys frame's row keys are what a worker sends."},
    {"row_lens", (PyCFunction)(void (*)(void))row_lens, METH_FASTCALL, "Whether a lens frame is what a worker sends."},
    {"set_update_kernels", (PyCFunction)(void (*)(void))set_update_kernels, METH_FASTCALL,
     "The addresses of store/kernels.c's sgd_rows, sgd_mom_rows and adam_rows."},
    {"sgd", (PyCFunction)(void (*)(void))sgd, METH_FASTCALL, "kernels.sgd_rows in one call; False if it cannot."},
    {"sgd_mom", (PyCFunction)(void (*)(void))sgd_mom, METH_FASTCALL,
     "kernels.sgd_mom_rows in one call; False if it cannot."},
    {"adam", (PyCFunction)(void (*)(void))adam, METH_FASTCALL, "kernels.adam_rows in one call; False if it cannot."},
    {"merge_rows", (PyCFunction)(void (*)(void))merge_rows, METH_FASTCALL,
     "kernels.merge_rows of a round as bytearrays, or None."},
    {"row_push", (PyCFunction)(void (*)(void))row_push, METH_FASTCALL,
     "A row_sparse push's (local_ids, row_size, master key) if its frames are what a worker sends, else None."},
    {"parse_float32", parse_float32, METH_O, "optimizers._dmlc_parse(text, float32) of str(float)'s text, or None."},
    {"set_zmq", (PyCFunction)(void (*)(void))set_zmq, METH_FASTCALL,
     "The addresses of libzmq's zmq_msg_init, _recv, _close, _data, _size, _more, _gets and zmq_send."},
    {"recv_message", (PyCFunction)(void (*)(void))recv_message, METH_FASTCALL,
     "Every part of the next queued message of a socket: (parts, peer address, bytes), or None."},
    {"send_message", (PyCFunction)(void (*)(void))send_message, METH_FASTCALL,
     "Every part of one message; False if libzmq cannot take it now."},
    {"digest", digest, METH_NOARGS, "The SHA-256 of the _fast.c this module was built from."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) {
    static const char *names[14] = {NULL, "head", NULL, NULL, "request", "push", "simple_app", "app_id",
                                    "timestamp", NULL, "customer_id", "data_size", "pull", "priority"};
    for (int i = 0; i < 14; i++)
        if (names[i] != NULL && (NAMES[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    if ((S_CONTROL = PyUnicode_InternFromString("control")) == NULL
            || (S_BODY = PyUnicode_InternFromString("body")) == NULL
            || (S_DATA_TYPE = PyUnicode_InternFromString("data_type")) == NULL
            || (S_CMD = PyUnicode_InternFromString("cmd")) == NULL)
        return NULL;
    if ((PartType = PyType_FromSpec(&part_spec)) == NULL) return NULL;
    return PyModule_Create(&module);
}
