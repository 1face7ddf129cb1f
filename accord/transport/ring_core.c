/* The shared-memory ring's one-piece message, written and taken in C.
 *
 * Optional: transport/ring_helper.py imports this module where it was built
 * (pip install with a C compiler builds it; the build is allowed to fail) and
 * the shared-memory transport falls back to its pure-Python code otherwise,
 * or when ACCORD_RING_HELPER=0. It does exactly what shm.py's
 * _Link.write_inline / _take_whole and their wake-up checks do, on the same
 * words of the same arena, so a helper-built rank and a pure one interoperate:
 *
 *   put:  (a collective's or a tagged message) room for header + payload in one
 *         contiguous piece (an empty ring whose head is past `rewind` gets a pad
 *         to its end first, and the message at its beginning)?  header, payload
 *         (by memcpy, or with streaming stores and a fence after them where the
 *         caller asks: transport/shared_write.py), publish head (release), full
 *         fence, wake the consumer if its want-data flag asks for this much;
 *   take: (spinning up to spin_s for the bytes) the next message, if it is of
 *         the kind asked for, the destination's size, matching the stamp (a
 *         collective) or the tag (tagged), and all there in one piece (past a
 *         pad, if one is next): copy it
 *         out, publish tail (release), full fence, wake the producer if its
 *         want-space or want-ack flag is now satisfied.
 *
 * A message's buffer is one object with the buffer protocol, or a scattered one
 * (byte_stream.py's ByteStream: its `views`, a list of byte buffers, written back
 * to back into the ring, or filled in turn from it).
 *
 * Anything else (no room, a wrap, another message first, a Desync, a peer's
 * last words) returns -1 with nothing consumed or written, and Python's general
 * path takes over, errors included. The GIL is held throughout: a put or take
 * never blocks, and the spin is bounded by the caller (as Python's own spin).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include "../stream_store.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire header is little-endian: the pure path serves this machine"
#endif

#define HEADER_SIZE 32
#define COLL 1
#define P2P 2
#define PAD 0x20                         /* shm.py's _PAD: empty to the ring's end */
#define OP_SEND 10                       /* wire.OP_CODES["send"] */
#define SEQ_MASK ((((int64_t)1) << 40) - 1)
/* FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0), as futex.py's add_and_wake */
#define OP_ADD_ONE ((1 << 28) | (0 << 24) | (1 << 12) | 0)

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef struct {
    PyObject_HEAD
    int64_t *q;                  /* the arena's 64-bit words */
    char *o_ring, *i_ring;
    int64_t cap;
    int64_t rewind;              /* shm.py's _Link.rewind: where an empty ring starts over */
    Py_ssize_t o_head_i, o_tail_i, o_want_data_i;
    Py_ssize_t i_head_i, i_tail_i, i_want_space_i, i_want_ack_i, i_acked_i;
    int32_t *peer_doorbell;
    int wake_n;
    Py_buffer arena;             /* held: the arena cannot be unmapped under us */
    int held;
} RingLink;

static PyObject *s_op, *s_dtype, *s_redop, *s_root, *s_seqf, *s_count;

static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static void wake(RingLink *l)
{
    syscall(SYS_futex, l->peer_doorbell, FUTEX_WAKE_OP, l->wake_n, NULL, l->peer_doorbell,
            OP_ADD_ONE);
}

static int stamp_fields(PyObject *stamp, long long out[6])
{
    PyObject *names[6] = {s_op, s_dtype, s_redop, s_root, s_seqf, s_count};
    for (int i = 0; i < 6; i++) {
        PyObject *v = PyObject_GetAttr(stamp, names[i]);
        if (v == NULL)
            return -1;
        out[i] = PyLong_AsLongLong(v);
        Py_DECREF(v);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* A message's memory: one buffer, or the byte buffers of a ByteStream (its `views`,
 * a list or tuple), copied in turn. */
typedef struct {
    Py_buffer one;
    Py_buffer *parts;            /* NULL: just `one` */
    Py_ssize_t nparts;
    int64_t len;
    int readonly;
} Parts;

static PyObject *s_views;

static int parts_get(PyObject *o, Parts *p)
{
    p->parts = NULL;
    p->nparts = 0;
    if (PyObject_CheckBuffer(o)) {
        if (PyObject_GetBuffer(o, &p->one, PyBUF_SIMPLE) < 0)
            return -1;
        p->len = p->one.len;
        p->readonly = p->one.readonly;
        return 0;
    }
    PyObject *attr = PyObject_GetAttr(o, s_views);
    PyObject *views = attr == NULL ? NULL : PySequence_Fast(attr, "");
    Py_XDECREF(attr);
    if (views == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "a message is a buffer or a ByteStream");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
    p->parts = PyMem_Malloc(sizeof(Py_buffer) * (n ? n : 1));
    if (p->parts == NULL) {
        Py_DECREF(views);
        PyErr_NoMemory();
        return -1;
    }
    p->len = 0;
    p->readonly = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(views, i), &p->parts[i],
                               PyBUF_SIMPLE) < 0) {
            while (i--)
                PyBuffer_Release(&p->parts[i]);
            PyMem_Free(p->parts);
            p->parts = NULL;
            Py_DECREF(views);
            return -1;
        }
        p->len += p->parts[i].len;
        p->readonly |= p->parts[i].readonly && p->parts[i].len;
        p->nparts = i + 1;
    }
    Py_DECREF(views);
    return 0;
}

static void parts_release(Parts *p)
{
    if (p->parts == NULL) {
        PyBuffer_Release(&p->one);
        return;
    }
    for (Py_ssize_t i = 0; i < p->nparts; i++)
        PyBuffer_Release(&p->parts[i]);
    PyMem_Free(p->parts);
}

static void parts_gather(Parts *p, unsigned char *dst)
{
    if (p->parts == NULL) {
        memcpy(dst, p->one.buf, (size_t)p->len);
        return;
    }
    for (Py_ssize_t i = 0; i < p->nparts; i++) {
        memcpy(dst, p->parts[i].buf, (size_t)p->parts[i].len);
        dst += p->parts[i].len;
    }
}

/* parts_gather with streaming stores, then a fence: they are weakly ordered, and
 * the head published after them must not pass them */
static void parts_gather_streaming(Parts *p, unsigned char *dst)
{
    if (p->parts == NULL) {
        stream_store_copy(dst, p->one.buf, (size_t)p->len);
    } else {
        for (Py_ssize_t i = 0; i < p->nparts; i++) {
            stream_store_copy(dst, p->parts[i].buf, (size_t)p->parts[i].len);
            dst += p->parts[i].len;
        }
    }
    stream_store_fence();
}

static void parts_scatter(Parts *p, const unsigned char *src)
{
    if (p->parts == NULL) {
        memcpy(p->one.buf, src, (size_t)p->len);
        return;
    }
    for (Py_ssize_t i = 0; i < p->nparts; i++) {
        memcpy(p->parts[i].buf, src, (size_t)p->parts[i].len);
        src += p->parts[i].len;
    }
}

static int RingLink_init(RingLink *self, PyObject *args, PyObject *kw)
{
    unsigned long long q, o_ring, i_ring, bell;
    long long cap, rewind;
    Py_ssize_t ix[8];
    int wake_n;
    PyObject *keep;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "RingLink takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OKKKLnnnnnnnnKiL", &keep, &q, &o_ring, &i_ring, &cap,
                          &ix[0], &ix[1], &ix[2], &ix[3], &ix[4], &ix[5], &ix[6], &ix[7],
                          &bell, &wake_n, &rewind))
        return -1;
    if (cap <= HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "ring too small");
        return -1;
    }
    self->q = (int64_t *)(uintptr_t)q;
    self->o_ring = (char *)(uintptr_t)o_ring;
    self->i_ring = (char *)(uintptr_t)i_ring;
    self->cap = cap;
    self->rewind = rewind;
    self->o_head_i = ix[0]; self->o_tail_i = ix[1]; self->o_want_data_i = ix[2];
    self->i_head_i = ix[3]; self->i_tail_i = ix[4]; self->i_want_space_i = ix[5];
    self->i_want_ack_i = ix[6]; self->i_acked_i = ix[7];
    self->peer_doorbell = (int32_t *)(uintptr_t)bell;
    self->wake_n = wake_n;
    if (self->held) {
        PyBuffer_Release(&self->arena);
        self->held = 0;
    }
    if (PyObject_GetBuffer(keep, &self->arena, PyBUF_SIMPLE) < 0)
        return -1;
    self->held = 1;
    uintptr_t lo = (uintptr_t)self->arena.buf, hi = lo + (uintptr_t)self->arena.len;
    if (q < lo || o_ring < lo || i_ring < lo || o_ring + cap > hi || i_ring + cap > hi ||
            bell < lo || bell + 4 > hi) {
        PyErr_SetString(PyExc_ValueError, "addresses outside the arena");
        return -1;
    }
    for (int i = 0; i < 8; i++) {
        if (ix[i] < 0 || q + (uintptr_t)(ix[i] + 1) * 8 > hi) {
            PyErr_SetString(PyExc_ValueError, "a word index outside the arena");
            return -1;
        }
    }
    return 0;
}

static void RingLink_dealloc(RingLink *self)
{
    if (self->held)
        PyBuffer_Release(&self->arena);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* put(head, stamp, tag, view[, streaming]) -> the new head, or -1 (not written).
 * stamp: a collective's Stamp, or None for a tagged message with this tag;
 * streaming: the payload written with streaming stores (transport/shared_write.py). */
static PyObject *RingLink_put(RingLink *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "put(head, stamp, tag, view[, streaming])");
        return NULL;
    }
    int streaming = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (streaming < 0)
        return NULL;
    long long head = PyLong_AsLongLong(args[0]);
    if (head == -1 && PyErr_Occurred())
        return NULL;
    /* kind, op, dtype, redop, root, seq, count: a tagged message's are wire.py's
     * (P2P, OP_SEND, 0, 0, -1, tag, -1) */
    int kind = COLL;
    long long f[6];
    if (args[1] == Py_None) {
        kind = P2P;
        long long tag = PyLong_AsLongLong(args[2]);
        if (tag == -1 && PyErr_Occurred())
            return NULL;
        f[0] = OP_SEND; f[1] = 0; f[2] = 0; f[3] = -1; f[4] = tag; f[5] = -1;
    } else if (stamp_fields(args[1], f) < 0) {
        return NULL;
    }
    Parts b;
    if (parts_get(args[3], &b) < 0)
        return NULL;
    int64_t n = b.len, size = HEADER_SIZE + n;
    int64_t pos = head % l->cap;
    int64_t tail = load(&l->q[l->o_tail_i]);
    if (pos + size > l->rewind && head == tail && size <= pos &&
            l->cap - pos >= HEADER_SIZE) {
        /* the ring is empty: a pad to its end, and the message at its beginning */
        unsigned char *p = (unsigned char *)l->o_ring + pos;
        int32_t none = -1;
        int64_t zero = 0, minus = -1;
        uint64_t rest = (uint64_t)(l->cap - pos - HEADER_SIZE);
        p[0] = PAD; p[1] = 0; p[2] = 0; p[3] = 0;
        memcpy(p + 4, &none, 4);
        memcpy(p + 8, &zero, 8);
        memcpy(p + 16, &minus, 8);
        memcpy(p + 24, &rest, 8);
        head += l->cap - pos;
        pos = 0;
    }
    if (pos + size > l->cap || head + size - tail > l->cap) {
        parts_release(&b);
        return PyLong_FromLong(-1);
    }
    unsigned char *h = (unsigned char *)l->o_ring + pos;
    int32_t root = (int32_t)f[3];
    int64_t seqf = f[4], count = f[5];
    uint64_t length = (uint64_t)n;
    h[0] = (unsigned char)kind; h[1] = (unsigned char)f[0]; h[2] = (unsigned char)f[1];
    h[3] = (unsigned char)f[2];
    memcpy(h + 4, &root, 4);
    memcpy(h + 8, &seqf, 8);
    memcpy(h + 16, &count, 8);
    memcpy(h + 24, &length, 8);
    if (n && streaming)
        parts_gather_streaming(&b, h + HEADER_SIZE);
    else if (n)
        parts_gather(&b, h + HEADER_SIZE);
    parts_release(&b);
    head += HEADER_SIZE + n;
    store(&l->q[l->o_head_i], head);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t w = load(&l->q[l->o_want_data_i]);
    if (w && head >= w)
        wake(l);
    return PyLong_FromLongLong(head);
}

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* take(tail, stamp, tag, view, spin_s) -> the new tail, or -1 (nothing taken).
 * stamp: a collective's Stamp, or None for a tagged message with this tag. */
static PyObject *RingLink_take(RingLink *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take(tail, stamp, tag, view, spin_s)");
        return NULL;
    }
    long long tail = PyLong_AsLongLong(args[0]);
    if (tail == -1 && PyErr_Occurred())
        return NULL;
    PyObject *stamp = args[1];
    long long f[6] = {0, 0, 0, 0, 0, 0};
    long long tag = 0;
    int kind;
    if (stamp == Py_None) {
        kind = P2P;
        tag = PyLong_AsLongLong(args[2]);
        if (tag == -1 && PyErr_Occurred())
            return NULL;
    } else {
        kind = COLL;
        if (stamp_fields(stamp, f) < 0)
            return NULL;
    }
    double spin = PyFloat_AsDouble(args[4]);
    if (spin == -1.0 && PyErr_Occurred())
        return NULL;
    Parts b;
    /* not PyBUF_WRITABLE: an empty destination may be read-only (nothing is written) */
    if (parts_get(args[3], &b) < 0)
        return NULL;
    int64_t n = b.len;
    if (n && b.readonly) {
        parts_release(&b);
        PyErr_SetString(PyExc_TypeError, "cannot receive into read-only memory");
        return NULL;
    }
    int64_t want = tail + HEADER_SIZE + n;
    int64_t pos = tail % l->cap;
    PyObject *result = NULL;
    if (pos + HEADER_SIZE > l->cap)
        goto decline;
    /* a pad and the message after it are published at once (put's rewind), so
     * once `want` is there, a message after a pad is all there too */
    int64_t head = load(&l->q[l->i_head_i]);
    if (head < want) {
        /* bytes past the tail but short of the whole message: it comes in pieces (the
         * ring had no room for it in one) or another message is first; either way only
         * the general path takes it, so spinning here would only hold it up */
        if (spin <= 0.0 || head != tail)
            goto decline;
        double end = now_s() + spin;
        unsigned turns = 0;
        while ((head = load(&l->q[l->i_head_i])) == tail) {
            cpu_relax();
            if ((++turns & 63) == 0 && now_s() >= end)
                break;
        }
        if (head < want)
            goto decline;
    }
    const unsigned char *h = (const unsigned char *)l->i_ring + pos;
    if (h[0] == PAD) {
        uint64_t rest;
        memcpy(&rest, h + 24, 8);
        if (rest != (uint64_t)(l->cap - pos - HEADER_SIZE))
            goto decline;                /* the general path names the corrupt header */
        tail += l->cap - pos;
        want = tail + HEADER_SIZE + n;
        pos = 0;
        h = (const unsigned char *)l->i_ring;
        if (load(&l->q[l->i_head_i]) < want)
            goto decline;
    }
    if (pos + HEADER_SIZE + n > l->cap)
        goto decline;
    int32_t root;
    int64_t seq, count;
    uint64_t length;
    memcpy(&root, h + 4, 4);
    memcpy(&seq, h + 8, 8);
    memcpy(&count, h + 16, 8);
    memcpy(&length, h + 24, 8);
    if (h[0] != kind || length != (uint64_t)n)
        goto decline;
    if (kind == COLL) {
        if (h[1] != f[0] || ((seq ^ f[4]) & SEQ_MASK) != 0 || root != f[3] ||
                h[2] != f[1] || h[3] != f[2] || count != f[5])
            goto decline;
    } else if (seq != tag) {
        goto decline;
    }
    if (n)
        parts_scatter(&b, h + HEADER_SIZE);
    tail = want;
    store(&l->q[l->i_tail_i], tail);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    {
        int64_t ws = load(&l->q[l->i_want_space_i]), wa = load(&l->q[l->i_want_ack_i]);
        if ((ws && tail >= ws) || (wa && load(&l->q[l->i_acked_i]) >= wa))
            wake(l);
    }
    result = PyLong_FromLongLong(tail);
    parts_release(&b);
    return result;
decline:
    parts_release(&b);
    return PyLong_FromLong(-1);
}

static PyMethodDef RingLink_methods[] = {
    {"put", (PyCFunction)(void (*)(void))RingLink_put, METH_FASTCALL,
     "put(head, stamp, tag, view) -> new head, or -1: a message written in one piece "
     "(view: a buffer, or a ByteStream gathered)"},
    {"take", (PyCFunction)(void (*)(void))RingLink_take, METH_FASTCALL,
     "take(tail, stamp, tag, view, spin_s) -> new tail, or -1: the awaited message taken "
     "(view: a buffer, or a ByteStream scattered into)"},
    {NULL, NULL, 0, NULL}
};

static PyTypeObject RingLinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "accord.transport.ring_core.RingLink",
    .tp_basicsize = sizeof(RingLink),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RingLink(arena, q, o_ring, i_ring, cap, o_head_i, o_tail_i, o_want_data_i, "
              "i_head_i, i_tail_i, i_want_space_i, i_want_ack_i, i_acked_i, peer_doorbell, "
              "wake_n, rewind): one rank's two rings with a peer, by address",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RingLink_init,
    .tp_dealloc = (destructor)RingLink_dealloc,
    .tp_methods = RingLink_methods,
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "accord.transport.ring_core",
    "The shared-memory ring's one-piece messages in C (optional; see ring_helper.py).",
    -1, NULL, NULL, NULL, NULL, NULL
};

PyMODINIT_FUNC PyInit_ring_core(void)
{
    if (PyType_Ready(&RingLinkType) < 0)
        return NULL;
    s_op = PyUnicode_InternFromString("op");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_redop = PyUnicode_InternFromString("redop");
    s_root = PyUnicode_InternFromString("root");
    s_seqf = PyUnicode_InternFromString("_seqf");
    s_count = PyUnicode_InternFromString("count");
    s_views = PyUnicode_InternFromString("views");
    if (!s_op || !s_dtype || !s_redop || !s_root || !s_seqf || !s_count || !s_views)
        return NULL;
    PyObject *m = PyModule_Create(&ring_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RingLinkType);
    if (PyModule_AddObject(m, "RingLink", (PyObject *)&RingLinkType) < 0) {
        Py_DECREF(&RingLinkType);
        Py_DECREF(m);
        return NULL;
    }
    /* whether put's streaming flag writes with streaming stores (x86-64) */
    if (PyModule_AddIntConstant(m, "STREAMING", STREAM_STORES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
