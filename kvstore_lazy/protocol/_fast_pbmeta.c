/* The PBMeta codec of the compiled fast path: protocol/pbmeta.py's reference decoder and encoder, for the common
   shape of a PBMeta (what ps-lite sends: one-byte keys, known fields, no groups).

   Owns: decode_meta and encode_meta, which give exactly what pbmeta.py gives or return None (then pbmeta.py's
   Python codec decides every unusual case and names every error; nothing here raises on a peer's bytes), and the
   interned attribute names they use (fast_pbmeta_init, called once by PyInit__fast). Does not own: what a
   message means (protocol/message.py, protocol/kv.py). */
#include "_fast.h"

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
PyObject *decode_meta(PyObject *self, PyObject *arg) {
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
PyObject *encode_meta(PyObject *self, PyObject *dict) {
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

int fast_pbmeta_init(void) {
    static const char *names[14] = {NULL, "head", NULL, NULL, "request", "push", "simple_app", "app_id",
                                    "timestamp", NULL, "customer_id", "data_size", "pull", "priority"};
    for (int i = 0; i < 14; i++)
        if (names[i] != NULL && (NAMES[i] = PyUnicode_InternFromString(names[i])) == NULL) return -1;
    if ((S_CONTROL = PyUnicode_InternFromString("control")) == NULL
            || (S_BODY = PyUnicode_InternFromString("body")) == NULL
            || (S_DATA_TYPE = PyUnicode_InternFromString("data_type")) == NULL
            || (S_CMD = PyUnicode_InternFromString("cmd")) == NULL)
        return -1;
    return 0;
}
