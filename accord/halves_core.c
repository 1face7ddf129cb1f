/* Reductions of 16-bit floats in one pass, for accord/halves.py.
 *
 * Optional: halves.py imports this module where it was built (pip install with a
 * C compiler builds it; the build is allowed to fail) and reduces with numpy
 * otherwise, or when ACCORD_HALF_HELPER=0.
 *
 * bfloat16: each element is widened to float32 (its 16 bits become the top half),
 * combined in float32 (one IEEE operation, as numpy's float32 ufunc does), and
 * narrowed back rounding to nearest even, a NaN becoming 0x7FC0 (torch's rule):
 * the numpy path's bits.
 *
 * float16: widened and narrowed by the CPU's own conversions (F16C on x86, checked
 * at import; without them the f16 functions are not offered), combined in float32:
 * the correctly rounded float16 result, as numpy's, since float32 holds more than
 * twice float16's precision plus two bits. Widened halves and their sums, products
 * and quotients by a group size are normal float32 numbers or zero, so flush-to-zero
 * settings cannot change them.
 *
 *   bf16_reduce(acc, other, op), f16_reduce(acc, other, op): acc = acc op other,
 *       op 0 a sum, 1 a product;
 *   bf16_divide(acc, n), f16_divide(acc, n): acc = acc / n (AVG's last step).
 *
 * acc and other are C-contiguous buffers of 16-bit elements, of one length. The
 * GIL is released while the elements are combined. Compiled without fast-math:
 * the float operations must be IEEE's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86_PATHS 1
#endif

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

/* the portable loops (vectorized by the compiler for the baseline instruction set) */
static void sum_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) + widen(b[i]));
}

static void product_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) * widen(b[i]));
}

static void divide_loop(uint16_t *a, float f, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        a[i] = narrow(widen(a[i]) / f);
}

#ifdef HAVE_X86_PATHS
/* bfloat16 with AVX2, sixteen elements a step: unpacking against zeros puts each
 * element in the top half of a 32-bit lane (within each 128-bit half), and packing
 * the two results back (also within each half) restores the order */
#define AVX2_TARGET __attribute__((target("avx2")))

AVX2_TARGET static inline __m256i narrow8(__m256 r)
{
    __m256i u = _mm256_castps_si256(r);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(t, _mm256_set1_epi32(0x7FC0), nan);
}

#define BF16_AVX2_LOOP(name, OP, SCALAR)                                               \
    AVX2_TARGET static void name(uint16_t *a, const uint16_t *b, Py_ssize_t n)         \
    {                                                                                  \
        Py_ssize_t i = 0;                                                              \
        const __m256i z = _mm256_setzero_si256();                                      \
        for (; i + 16 <= n; i += 16) {                                                 \
            __m256i x = _mm256_loadu_si256((const __m256i *)(a + i));                  \
            __m256i y = _mm256_loadu_si256((const __m256i *)(b + i));                  \
            __m256 lo = OP(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)),          \
                           _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, y)));         \
            __m256 hi = OP(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)),          \
                           _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, y)));         \
            _mm256_storeu_si256((__m256i *)(a + i),                                    \
                                _mm256_packus_epi32(narrow8(lo), narrow8(hi)));        \
        }                                                                              \
        for (; i < n; i++)                                                             \
            a[i] = narrow(widen(a[i]) SCALAR widen(b[i]));                             \
    }

BF16_AVX2_LOOP(sum_avx2, _mm256_add_ps, +)
BF16_AVX2_LOOP(product_avx2, _mm256_mul_ps, *)

AVX2_TARGET static void divide_avx2(uint16_t *a, float f, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    const __m256i z = _mm256_setzero_si256();
    const __m256 d = _mm256_set1_ps(f);
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a + i));
        __m256 lo = _mm256_div_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)), d);
        __m256 hi = _mm256_div_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)), d);
        _mm256_storeu_si256((__m256i *)(a + i), _mm256_packus_epi32(narrow8(lo), narrow8(hi)));
    }
    for (; i < n; i++)
        a[i] = narrow(widen(a[i]) / f);
}
#endif

/* the bfloat16 loops this CPU runs: AVX2's where it has it (set at import) */
static void (*bf16_sum)(uint16_t *, const uint16_t *, Py_ssize_t) = sum_loop;
static void (*bf16_product)(uint16_t *, const uint16_t *, Py_ssize_t) = product_loop;
static void (*bf16_div)(uint16_t *, float, Py_ssize_t) = divide_loop;

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
        PyErr_Format(PyExc_ValueError, "reduce: acc holds %zd bytes, other %zd (two "
                     "bytes an element, both alike)", x->len, y->len);
        PyBuffer_Release(y);
        PyBuffer_Release(x);
        return -1;
    }
    return 0;
}

typedef void (*pair_loop)(uint16_t *, const uint16_t *, Py_ssize_t);
typedef void (*scale_loop)(uint16_t *, float, Py_ssize_t);

static PyObject *run_reduce(PyObject *const *args, Py_ssize_t nargs, pair_loop sum,
                            pair_loop product)
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
        PyErr_Format(PyExc_ValueError, "reduce: op %ld (0 a sum, 1 a product)", op);
        return NULL;
    }
    if (get_pair(args[0], args[1], &x, &y) < 0)
        return NULL;
    uint16_t *a = (uint16_t *)x.buf;
    const uint16_t *b = (const uint16_t *)y.buf;
    Py_ssize_t n = x.len / 2;
    pair_loop loop = op == 0 ? sum : product;
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

static PyObject *run_divide(PyObject *const *args, Py_ssize_t nargs, scale_loop divide)
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
        PyErr_Format(PyExc_ValueError, "divide: n must be 1 to 2**24, not %ld", d);
        return NULL;
    }
    if (get_pair(args[0], NULL, &x, NULL) < 0)
        return NULL;
    if (x.len % 2) {
        PyErr_Format(PyExc_ValueError, "divide: %zd bytes, not whole elements", x.len);
        PyBuffer_Release(&x);
        return NULL;
    }
    uint16_t *a = (uint16_t *)x.buf;
    Py_ssize_t n = x.len / 2;
    float f = (float)d;
    Py_BEGIN_ALLOW_THREADS
    divide(a, f, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

#ifdef HAVE_X86_PATHS
/* float16 through F16C: eight elements a step, the tail one by one */
#define F16C_TARGET __attribute__((target("avx,f16c")))

F16C_TARGET static void f16_sum_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(a + i),
                         _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        a[i] = _cvtss_sh(_cvtsh_ss(a[i]) + _cvtsh_ss(b[i]), _MM_FROUND_TO_NEAREST_INT);
}

F16C_TARGET static void f16_product_loop(uint16_t *a, const uint16_t *b, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(a + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        a[i] = _cvtss_sh(_cvtsh_ss(a[i]) * _cvtsh_ss(b[i]), _MM_FROUND_TO_NEAREST_INT);
}

F16C_TARGET static void f16_divide_loop(uint16_t *a, float f, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    __m256 d = _mm256_set1_ps(f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        _mm_storeu_si128((__m128i *)(a + i),
                         _mm256_cvtps_ph(_mm256_div_ps(x, d), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        a[i] = _cvtss_sh(_cvtsh_ss(a[i]) / f, _MM_FROUND_TO_NEAREST_INT);
}

static PyObject *f16_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run_reduce(args, nargs, f16_sum_loop, f16_product_loop);
}

static PyObject *f16_divide(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run_divide(args, nargs, f16_divide_loop);
}
#endif

static PyObject *bf16_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run_reduce(args, nargs, bf16_sum, bf16_product);
}

static PyObject *bf16_divide(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run_divide(args, nargs, bf16_div);
}

static PyMethodDef methods[] = {
    {"bf16_reduce", (PyCFunction)(void (*)(void))bf16_reduce, METH_FASTCALL,
     "bf16_reduce(acc, other, op): acc = acc op other over bfloat16 bits (op 0 sum, 1 "
     "product)."},
    {"bf16_divide", (PyCFunction)(void (*)(void))bf16_divide, METH_FASTCALL,
     "bf16_divide(acc, n): acc = acc / n over bfloat16 bits."},
    {NULL, NULL, 0, NULL},
};

#ifdef HAVE_X86_PATHS
static PyMethodDef f16_methods[] = {
    {"f16_reduce", (PyCFunction)(void (*)(void))f16_reduce, METH_FASTCALL,
     "f16_reduce(acc, other, op): acc = acc op other over float16 (op 0 sum, 1 product)."},
    {"f16_divide", (PyCFunction)(void (*)(void))f16_divide, METH_FASTCALL,
     "f16_divide(acc, n): acc = acc / n over float16."},
    {NULL, NULL, 0, NULL},
};
#endif

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "halves_core",
    "accord's optional helper for 16-bit float reductions (see accord/halves.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit_halves_core(void)
{
    PyObject *m = PyModule_Create(&module);
#ifdef HAVE_X86_PATHS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        bf16_sum = sum_avx2;
        bf16_product = product_avx2;
        bf16_div = divide_avx2;
    }
    /* the float16 functions only where the CPU has the conversions */
    if (m != NULL && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") &&
            PyModule_AddFunctions(m, f16_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
