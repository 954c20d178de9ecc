/* The server's per-message fast path in C: a CPython extension module (kvstore_lazy.protocol._fast), built by
setup.py from the units below into _fast.so.

Each function either gives exactly what the Python reference gives (protocol/pbmeta.py, protocol/kv.py,
store/rows.py's RowIndex, store/kernels.py, initializers.py, optimizers.py) or returns None (False), and the Python
caller then takes its general path, which decides every unusual case and names every error. Nothing here raises on
a peer's bytes. Does not own: what a request means, which rows exist or how absent rows are made (server/keys.py),
and no socket: ZeroMQ messages are received and sent by kvstore_lazy/transport/_zmqmsg.c.

The units, one concern each (each opens by saying what it owns):
  _fast.h           what they share: the limited API, the headers, the functions of the method table below
  _fast.c           this file: the module, its method table and the digest of its sources
  _fast_pbmeta.c    the PBMeta codec (decode_meta, encode_meta)
  _fast_checks.c    a row_sparse request's frames checked in one pass (sorted_rows, row_lens, row_push), two
                    frames compared (same_bytes)
  _fast_rows.c      a pull's rows gathered from a row table, a round's new rows made in it (gather_rows, ensure_rows)
  _fast_uniform.h   one row of the counter-based uniform initial values, inline where rows are made
  _fast_uniform.c   uniform_rows
  _fast_updates.c   optimizer updates and round merges through store/kernels.c's kernels (sgd, sgd_mom, adam,
                    merge_rows)
  _fast_float.c     optimizers.py's float parser (parse_float32)

Built with the limited API of CPython 3.11 (Py_LIMITED_API, _fast.h), so one build loads in every CPython >= 3.11
(the server wheel runs on 3.13); arrays come in through the buffer protocol (no numpy C API). The float flags of
the kernels apply (-ffp-contract=off: no fused multiply-add), so the uniform values are the float64 operations
initializers.py does, in the same order. */
#include "_fast.h"

#ifndef FAST_DIGEST
#error "build with -DFAST_DIGEST=\"<sha256 of its sources>\" (setup.py does)"
#endif

/* The SHA-256 of the sources this module was built from (all the units above: setup.py's digest): fast.py refuses
   a module older than any of them. */
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
    {"same_bytes", (PyCFunction)(void (*)(void))same_bytes, METH_FASTCALL, "Whether two buffers hold the same bytes."},
    {"parse_float32", parse_float32, METH_O, "optimizers._dmlc_parse(text, float32) of str(float)'s text, or None."},
    {"digest", digest, METH_NOARGS, "The SHA-256 of the sources (_fast.c and its units) this module was built from."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) {
    if (fast_pbmeta_init() < 0) return NULL;
    return PyModule_Create(&module);
}
