/* ZeroMQ messages received and sent whole, in one call each: a CPython extension module
   (kvstore_lazy.transport._zmqmsg, _zmqmsg.so), the compiled half of transport/zmq_van.py.

Owns: calling libzmq on sockets pyzmq made: one call receives every part of a message (or sends every part of one),
where pyzmq's Socket.recv/send cost a Python call, a Frame and, per received part, a getsockopt(RCVMORE) through an
enum lookup. Does not own: the sockets, their options, queues or polling (zmq_van.py), or what a message holds
(protocol/). The functions are those of the libzmq pyzmq itself loaded (zmq_van.py finds it and hands their
addresses over: set_zmq), used on the sockets pyzmq made (their `underlying` handles), from the thread that owns
them, as pyzmq's own calls are.

Built by setup.py with the limited API of CPython 3.11 (Py_LIMITED_API), so one build loads in every
CPython >= 3.11, and named _zmqmsg.so; no libzmq headers or library at build time (the message type is 64 opaque
bytes, the flags are ZeroMQ's stable values). It records the SHA-256 of its source (digest(), checked by
zmq_van.py).

The functions:
set_zmq(msg_init, msg_recv, msg_close, msg_data, msg_size, msg_more, msg_gets, send, msg_init_data, msg_send): the
  addresses (ints).
recv_message(handle, zero_copy_min, peer) -> (parts, peer_address, nbytes), or None if no message is queued
  (ZMQ_DONTWAIT). Parts shorter than zero_copy_min are bytes; longer ones memoryviews of a Part that keeps the
  zmq_msg_t (no copy), writable, as pyzmq's Frame. peer_address: the last part's "Peer-Address" property with
  `peer` (None without, or for a transport that has none). An error of libzmq raises OSError(errno).
send_message(handle, parts, zero_copy_min) -> True once libzmq took the message, False if it could not take the
  first part now (EAGAIN: nothing was sent); a multipart message is then taken whole (ZeroMQ's guarantee), so the
  later parts do not wait. `parts`: a list of objects with a contiguous buffer; parts shorter than zero_copy_min
  are copied (zmq_send), longer ones are handed over without a copy (zmq_msg_init_data: a reply's payload of
  8,192 rows is 1 MiB), their buffers held until ZeroMQ is done with them: its I/O thread then puts them on a list
  (no Python API there, so no GIL and no thread of pyzmq's), and every call of this module releases what is on it.
  Such a part must not change until then (a reply's own buffers: nothing writes them after the send). The first
  part of a received message is always bytes (the ROUTER's identity).
release_sent() -> None: release the parts ZeroMQ is done with now (the van's close; every call does it too). */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#ifndef ZMQMSG_DIGEST
#error "build with -DZMQMSG_DIGEST=\"<sha256 of its sources>\" (setup.py does)"
#endif

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
static int (*z_msg_init_data)(zmsg *, void *, size_t, void (*)(void *, void *), void *);
static int (*z_msg_send)(zmsg *, void *, int);
static PyObject *PartType;

/* A part handed to ZeroMQ without a copy: its buffer held (a reference to its object) until ZeroMQ calls sent_with()
   (from its I/O thread, or zmq_msg_close here), which puts it on `done` with an atomic push: no Python API, no GIL.
   release_done() (with the GIL, at every call of this module) releases what is there. */
typedef struct Held { Py_buffer view; struct Held *next; } Held;
static Held *done;

static void sent_with(void *data, void *hint) {
    Held *held = hint;
    held->next = __atomic_load_n(&done, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&done, &held->next, held, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {}
}

static void release_done(void) {
    Held *held = __atomic_exchange_n(&done, NULL, __ATOMIC_ACQUIRE);
    while (held != NULL) {
        Held *next = held->next;
        PyBuffer_Release(&held->view);
        free(held);
        held = next;
    }
}

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
static PyType_Spec part_spec = {"kvstore_lazy.transport._zmqmsg.Part", sizeof(Part), 0, Py_TPFLAGS_DEFAULT,
                                part_slots};

static PyObject *set_zmq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) { PyErr_SetString(PyExc_TypeError, "set_zmq takes 10 arguments"); return NULL; }
    void *addr[10];
    for (int i = 0; i < 10; i++) {
        addr[i] = PyLong_AsVoidPtr(args[i]);
        if (addr[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "set_zmq: a function address is 0");
            return NULL;
        }
    }
    z_msg_init = addr[0]; z_msg_recv = addr[1]; z_msg_close = addr[2]; z_msg_data = addr[3];
    z_msg_size = addr[4]; z_msg_more = addr[5]; z_msg_gets = addr[6]; z_send = addr[7];
    z_msg_init_data = addr[8]; z_msg_send = addr[9];
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
    release_done();
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

/* One part without a copy: its buffer held (Held) until ZeroMQ is done with it; -1 with errno as zmq_msg_send's
   (the message closed: the part goes to `done`), or ENOMEM. */
static int send_held(void *handle, Held *held, int flags) {
    zmsg msg;
    if (z_msg_init_data(&msg, held->view.buf, (size_t)held->view.len, sent_with, held) < 0) {
        int err = errno;
        PyBuffer_Release(&held->view);
        free(held);
        errno = err;
        return -1;
    }
    int rc;
    do { rc = z_msg_send(&msg, handle, flags); } while (rc < 0 && errno == EINTR);
    if (rc < 0) {
        int err = errno;
        z_msg_close(&msg);     /* calls sent_with: the part is released with the others */
        errno = err;
    }
    return rc;
}

static PyObject *send_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "send_message takes 3 arguments"); return NULL; }
    if (!zmq_ready()) return NULL;
    void *handle = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t zero_copy_min = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    release_done();
    PyObject *parts = args[1];
    if (!PyList_Check(parts)) { PyErr_SetString(PyExc_TypeError, "send_message: parts must be a list"); return NULL; }
    Py_INCREF(parts);
    Py_ssize_t n = PyList_Size(parts);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = (i + 1 < n ? Z_SNDMORE : 0) | (i == 0 ? Z_DONTWAIT : 0), rc, err;
        Held *held = malloc(sizeof(Held));
        if (held == NULL) { PyErr_NoMemory(); goto done; }
        if (PyObject_GetBuffer(PyList_GetItem(parts, i), &held->view, PyBUF_SIMPLE) < 0) { free(held); goto done; }
        if (held->view.len >= zero_copy_min) {
            rc = send_held(handle, held, flags);
            err = errno;
        } else {
            do { rc = z_send(handle, held->view.buf, (size_t)held->view.len, flags); } while (rc < 0 && errno == EINTR);
            err = errno;
            PyBuffer_Release(&held->view);
            free(held);
        }
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

static PyObject *release_sent(PyObject *self, PyObject *unused) {
    release_done();
    Py_RETURN_NONE;
}

static PyObject *digest(PyObject *self, PyObject *unused) { return PyUnicode_FromString(ZMQMSG_DIGEST); }

static PyMethodDef methods[] = {
    {"set_zmq", (PyCFunction)(void (*)(void))set_zmq, METH_FASTCALL,
     "The addresses of libzmq's zmq_msg_init, _recv, _close, _data, _size, _more, _gets, zmq_send, "
     "zmq_msg_init_data and zmq_msg_send."},
    {"recv_message", (PyCFunction)(void (*)(void))recv_message, METH_FASTCALL,
     "Every part of the next queued message of a socket: (parts, peer address, bytes), or None."},
    {"send_message", (PyCFunction)(void (*)(void))send_message, METH_FASTCALL,
     "Every part of one message; False if libzmq cannot take it now."},
    {"release_sent", release_sent, METH_NOARGS, "Release the parts ZeroMQ is done with (sent without a copy)."},
    {"digest", digest, METH_NOARGS, "The SHA-256 of the _zmqmsg.c this module was built from."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmqmsg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zmqmsg(void) {
    if ((PartType = PyType_FromSpec(&part_spec)) == NULL) return NULL;
    return PyModule_Create(&module);
}
