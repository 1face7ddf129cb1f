/* bfloat16 reductions in one pass, for accord/bf16.py.
 *
 * Optional: bf16.py imports this module where it was built (pip install with a C
 * compiler builds it; the build is allowed to fail) and reduces with numpy in
 * chunks otherwise, or when ACCORD_BF16_HELPER=0. Both give the same bits: each
 * element is widened to float32 (its 16 bits become the top half), combined in
 * float32 (one IEEE operation, as numpy's float32 ufunc does), and narrowed back
 * rounding to nearest even, a NaN becoming 0x7FC0 (torch's rule). The GIL is
 * released while the elements are combined.
 *
 *   reduce(acc, other, op): acc = acc op other, op 0 a sum, 1 a product;
 *   divide(acc, n):         acc = acc / n (AVG's last step).
 *
 * acc and other are buffers of 16-bit elements (the tensors' bits), of one length.
 * Compiled without fast-math: the float operations must be IEEE's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* branch-free, so that the compiler vectorizes the loops: a NaN is an exponent of all
 * ones with a nonzero fraction */
static inline uint16_t narrow(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

/* the loops, built for AVX2 as well where the compiler can, picked at load time */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

CLONES static void sum_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) + widen(b[i]));
}

CLONES static void product_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) * widen(b[i]));
}

CLONES static void divide_loop(uint16_t *a, float f, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) / f);
}

static int get_pair(PyObject *a, PyObject *b, Py_buffer *x, Py_buffer *y)
{
    if (PyObject_GetBuffer(a, x, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b == NULL)
        return 0;
    if (PyObject_GetBuffer(b, y, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(x);
        return -1;
    }
    if (x->len != y->len || x->len % 2) {
        PyErr_Format(PyExc_ValueError, "bf16 reduce: acc holds %zd bytes, other %zd (two "
                     "bytes an element, both alike)", x->len, y->len);
        PyBuffer_Release(y);
        PyBuffer_Release(x);
        return -1;
    }
    return 0;
}

static PyObject *bf16_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer x, y;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "reduce(acc, other, op) takes three arguments");
        return NULL;
    }
    long op = PyLong_AsLong(args[2]);
    if (op == -1 && PyErr_Occurred())
        return NULL;
    if (op != 0 && op != 1) {
        PyErr_Format(PyExc_ValueError, "bf16 reduce: op %ld (0 a sum, 1 a product)", op);
        return NULL;
    }
    if (get_pair(args[0], args[1], &x, &y) < 0)
        return NULL;
    uint16_t *a = (uint16_t *)x.buf;
    const uint16_t *b = (const uint16_t *)y.buf;
    Py_ssize_t n = x.len / 2;
    void (*loop)(uint16_t *, const uint16_t *, Py_ssize_t) = op == 0 ? sum_loop : product_loop;
    if (n > 4096) {             /* below this, releasing the GIL costs more than the loop */
        Py_BEGIN_ALLOW_THREADS
        loop(a, b, n);
        Py_END_ALLOW_THREADS
    } else {
        loop(a, b, n);
    }
    PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyObject *bf16_divide(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer x;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "divide(acc, n) takes two arguments");
        return NULL;
    }
    long d = PyLong_AsLong(args[1]);
    if (d == -1 && PyErr_Occurred())
        return NULL;
    if (d <= 0 || d > (1L << 24)) {
        PyErr_Format(PyExc_ValueError, "bf16 divide: n must be 1 to 2**24, not %ld", d);
        return NULL;
    }
    if (get_pair(args[0], NULL, &x, NULL) < 0)
        return NULL;
    if (x.len % 2) {
        PyErr_Format(PyExc_ValueError, "bf16 divide: %zd bytes, not whole elements", x.len);
        PyBuffer_Release(&x);
        return NULL;
    }
    uint16_t *a = (uint16_t *)x.buf;
    Py_ssize_t n = x.len / 2;
    float f = (float)d;
    Py_BEGIN_ALLOW_THREADS
    divide_loop(a, f, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))bf16_reduce, METH_FASTCALL,
     "reduce(acc, other, op): acc = acc op other over bfloat16 bits (op 0 sum, 1 product)."},
    {"divide", (PyCFunction)(void (*)(void))bf16_divide, METH_FASTCALL,
     "divide(acc, n): acc = acc / n over bfloat16 bits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bf16_core",
    "accord's optional helper for bfloat16 reductions (see accord/bf16.py).", -1, methods,
};

PyMODINIT_FUNC PyInit_bf16_core(void)
{
    return PyModule_Create(&module);
}
