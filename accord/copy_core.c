/* copy_core: accord's optional helper for large local copies (accord/localcopy.py).
 *
 * A collective's own block (all_gather's, a scatter root's) is copied from the
 * caller's input into its output inside this process. For blocks larger than the
 * cache, the stores of a plain memcpy first read every destination line they
 * write; non-temporal stores write it without reading it. glibc's memcpy switches
 * to them only above x86_non_temporal_threshold, which it derives from the cache
 * size the CPU reports; a guest that reports a much larger cache than it has
 * (320 MiB of L3 against 32 MiB on the development VM) never gets there.
 *
 * stream_copy(dst, src): copy the bytes of src (a C-contiguous buffer) into dst (a
 * writable C-contiguous buffer of the same length), with SSE2 streaming stores on
 * x86-64 and memcpy elsewhere; the GIL is released while it copies. Overlapping
 * buffers are copied with memmove.
 *
 * views_copy(views, i, off, mem, n, into_views[, streaming]): the copies of a ByteStream
 * (accord/byte_stream.py), a stream of many small buffers taken range by range:
 * n bytes between mem and the stream that starts at views[i][off] (views: a list
 * or tuple of byte buffers), into mem (a gather) or, with into_views, from mem into
 * the views (a scatter). In Python each view the range crosses costs two slices
 * and an assignment: a state of 300 small tensors (5.5 MB) gathered in 1 MiB
 * chunks took 196 µs against 110 for a memcpy of the same bytes.
 * With streaming, a gather writes mem with streaming stores (a shared slot's
 * writer that timed them faster than memcpy: accord/transport/shared_write.py), one
 * fence after the last.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "stream_store.h"

/* dst[0:n] = src[0:n] with streaming stores, then the fence */
static void copy_streaming(char *dst, const char *src, size_t n)
{
    stream_store_copy(dst, src, n);
    stream_store_fence();
}

static PyObject *stream_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer d, s;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stream_copy(dst, src) takes two buffers");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &s, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: dst holds %zd bytes, src %zd",
                     d.len, s.len);
        PyBuffer_Release(&s);
        PyBuffer_Release(&d);
        return NULL;
    }
    char *dp = (char *)d.buf;
    const char *sp = (const char *)s.buf;
    size_t n = (size_t)d.len;
    int overlap = dp < sp + n && sp < dp + n;
    Py_BEGIN_ALLOW_THREADS
    if (overlap)
        memmove(dp, sp, n);
    else
        copy_streaming(dp, sp, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

static PyObject *views_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "views_copy(views, i, off, mem, n, into_views[, streaming])");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    Py_ssize_t off = PyLong_AsSsize_t(args[2]);
    Py_ssize_t n = PyLong_AsSsize_t(args[4]);
    int into = PyObject_IsTrue(args[5]);
    int streaming = nargs == 7 ? PyObject_IsTrue(args[6]) : 0;
    if (PyErr_Occurred() || into < 0 || streaming < 0)
        return NULL;
    PyObject *views = PySequence_Fast(args[0], "views_copy: views must be a list or tuple");
    if (views == NULL)
        return NULL;
    Py_buffer m;
    if (PyObject_GetBuffer(args[3], &m, into ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) {
        Py_DECREF(views);
        return NULL;
    }
    PyObject *result = NULL;
    if (n < 0 || n > m.len || i < 0 || off < 0) {
        PyErr_Format(PyExc_ValueError, "views_copy: %zd bytes from view %zd at %zd, "
                     "with a buffer of %zd", n, i, off, m.len);
        goto done;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(views);
    char *at = (char *)m.buf;
    while (n > 0) {
        if (i >= count) {
            PyErr_SetString(PyExc_ValueError, "views_copy: the stream ends before the range");
            goto done;
        }
        Py_buffer v;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(views, i), &v,
                               into ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            goto done;
        if (off > v.len) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_ValueError, "views_copy: an offset past its view's end");
            goto done;
        }
        Py_ssize_t k = v.len - off < n ? v.len - off : n;
        if (into)
            memcpy((char *)v.buf + off, at, (size_t)k);
        else if (streaming)
            stream_store_copy(at, (const char *)v.buf + off, (size_t)k);
        else
            memcpy(at, (const char *)v.buf + off, (size_t)k);
        PyBuffer_Release(&v);
        at += k;
        n -= k;
        i++;
        off = 0;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (streaming)
        stream_store_fence();
    PyBuffer_Release(&m);
    Py_DECREF(views);
    return result;
}

static PyMethodDef methods[] = {
    {"stream_copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "stream_copy(dst, src): copy src's bytes into dst with non-temporal stores."},
    {"views_copy", (PyCFunction)(void (*)(void))views_copy, METH_FASTCALL,
     "views_copy(views, i, off, mem, n, into_views[, streaming]): n bytes between mem "
     "and the stream of views that starts at views[i][off] (a gather, or with into_views "
     "a scatter); a gather with streaming writes mem with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "copy_core",
    "accord's optional helper for large local copies (see accord/localcopy.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit_copy_core(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAM_STORES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
