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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

static void copy_streaming(char *dst, const char *src, size_t n)
{
#if STREAMING
    /* streaming stores need 16-byte aligned destinations: the head goes by memcpy */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    /* streaming stores are weakly ordered: make them visible before anything after */
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
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

static PyMethodDef methods[] = {
    {"stream_copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "stream_copy(dst, src): copy src's bytes into dst with non-temporal stores."},
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
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
