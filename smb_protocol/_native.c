/* Elementwise kernels on raw buffers: the sums, scalings and 16-bit conversions of the
 * memory server's arithmetic and of a collective's chunks (their Python faces,
 * smb_server.memserver.kernels and smb_protocol.chunk_types, check types and lengths
 * and raise the project's errors).
 *
 * Why native: in numpy a bfloat16 or float16 operation is several passes over the
 * data, with a temporary between them, and the interpreter lock is taken again between
 * passes; here each operation is one pass with the lock released for all of it, so a
 * server's other request threads run meanwhile.
 *
 * Arithmetic rules (the same on every path):
 *   float32, float64: computed in the type itself (no fused multiply-add: built with
 *     -ffp-contract=off);
 *   float16: widened to float32, computed there, rounded once to float16;
 *   bfloat16 (uint16 bit patterns): widened to float32, computed there, rounded once
 *     to nearest-even, NaN stored as 0x7FC0;
 *   int32, int64: wrap around.
 * Type codes are smb_protocol.dtypes.DType's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"
#include "_rounds.h"

static Py_ssize_t item_size(int code)
{
    switch (code) {
    case T_F32: case T_I32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_F64: case T_I64: return 8;
    default: return 0;
    }
}

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bfloat16 <-> float32 */
static inline float bf16_wide(uint16_t h) { return from_bits((uint32_t)h << 16); }

static inline uint16_t bf16_round(float f)
{
    uint32_t u = to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half <-> float32: widening is exact; narrowing rounds to nearest-even, beyond
 * the largest half is infinity, a NaN stays a (quiet) NaN with its sign and top bits */
static inline float f16_wide(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)
        return from_bits(sign | 0x7f800000u | (m << 13));
    if (e)
        return from_bits(sign | ((e + 112u) << 23) | (m << 13));
    return from_bits(sign | to_bits((float)m * 5.9604644775390625e-8f));   /* m * 2^-24, exact */
}

static inline uint16_t f16_round(float f)
{
    uint32_t u = to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                      /* NaN */
        return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u)                     /* 65520 and up (and inf): infinity */
        return sign | 0x7c00u;
    if (a >= 0x38800000u) {                   /* a normal half */
        uint32_t r = a - 0x38000000u;         /* the exponent rebiased from 127 to 15 */
        r += 0xfffu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    if (a <= 0x33000000u)                     /* 2^-25 and below: zero (2^-25 ties to even) */
        return sign;
    /* a subnormal half: units of 2^-24 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - (a >> 23);        /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;                                  /* may carry into the smallest normal: right */
    return sign | (uint16_t)q;
}

/* The loops. Pointers never overlap (checked before); each loop is one pass. */
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx2", "default")))   /* wider vectors where the CPU has them */
#else
#define CLONES
#endif

CLONES static void add_f32(float *restrict d, const float *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += s[i]; }
CLONES static void add_f64(double *restrict d, const double *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += s[i]; }
CLONES static void add_u32(uint32_t *restrict d, const uint32_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += s[i]; }
CLONES static void add_u64(uint64_t *restrict d, const uint64_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += s[i]; }
CLONES static void add_bf16(uint16_t *restrict d, const uint16_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_round(bf16_wide(d[i]) + bf16_wide(s[i])); }

CLONES static void axpy_f32(float *restrict d, float a, const float *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += a * s[i]; }
CLONES static void axpy_f64(double *restrict d, double a, const double *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += a * s[i]; }
CLONES static void axpy_bf16(uint16_t *restrict d, float a, const uint16_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_round(bf16_wide(d[i]) + a * bf16_wide(s[i])); }

CLONES static void scale_f32(float *d, float a, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] *= a; }
CLONES static void scale_f64(double *d, double a, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] *= a; }
CLONES static void scale_bf16(uint16_t *d, float a, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_round(bf16_wide(d[i]) * a); }

CLONES static void widen_bf16(float *restrict d, const uint16_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_wide(s[i]); }
CLONES static void widen_add_bf16(float *restrict d, const uint16_t *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] += bf16_wide(s[i]); }
CLONES static void narrow_bf16(uint16_t *restrict d, const float *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_round(s[i]); }

/* float16: one routine per shape of operation, its elements converted by the CPU's
 * F16C instructions where it has them (eight at a time), else by f16_wide/f16_round */
enum { F16_ADD, F16_AXPY, F16_SCALE };

static inline float f16_op(int op, uint16_t d, float a, uint16_t s)
{
    float x = f16_wide(d);
    return op == F16_ADD ? x + f16_wide(s) : op == F16_AXPY ? x + a * f16_wide(s) : x * a;
}

static void f16_arith_sw(int op, uint16_t *d, float a, const uint16_t *s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = f16_round(f16_op(op, d[i], a, s ? s[i] : 0)); }
static void f16_widen_sw(float *restrict d, const uint16_t *restrict s, Py_ssize_t n, int add)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = add ? d[i] + f16_wide(s[i]) : f16_wide(s[i]); }
static void f16_narrow_sw(uint16_t *restrict d, const float *restrict s, Py_ssize_t n)
{ for (Py_ssize_t i = 0; i < n; i++) d[i] = f16_round(s[i]); }

#if defined(__x86_64__)
#include <immintrin.h>
static int use_f16c;   /* set at import where the CPU has F16C and AVX */
#define F16C __attribute__((target("avx,f16c")))
#define WIDE8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define NARROW8(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))

F16C static void f16_arith_hw(int op, uint16_t *d, float a, const uint16_t *s, Py_ssize_t n)
{
    __m256 va = _mm256_set1_ps(a);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = WIDE8(d + i);
        if (op == F16_ADD)
            x = _mm256_add_ps(x, WIDE8(s + i));
        else if (op == F16_AXPY)
            x = _mm256_add_ps(x, _mm256_mul_ps(va, WIDE8(s + i)));
        else
            x = _mm256_mul_ps(x, va);
        NARROW8(d + i, x);
    }
    f16_arith_sw(op, d + i, a, s ? s + i : NULL, n - i);
}

F16C static void f16_widen_hw(float *restrict d, const uint16_t *restrict s, Py_ssize_t n, int add)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 w = WIDE8(s + i);
        _mm256_storeu_ps(d + i, add ? _mm256_add_ps(_mm256_loadu_ps(d + i), w) : w);
    }
    f16_widen_sw(d + i, s + i, n - i, add);
}

F16C static void f16_narrow_hw(uint16_t *restrict d, const float *restrict s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        NARROW8(d + i, _mm256_loadu_ps(s + i));
    f16_narrow_sw(d + i, s + i, n - i);
}
#define PICK(name) (use_f16c ? name##_hw : name##_sw)
#else
static int use_f16c;
#define PICK(name) (name##_sw)
#endif

static void f16_arith(int op, uint16_t *d, float a, const uint16_t *s, Py_ssize_t n)
{ PICK(f16_arith)(op, d, a, s, n); }
static void f16_widen(float *d, const uint16_t *s, Py_ssize_t n, int add)
{ PICK(f16_widen)(d, s, n, add); }
static void f16_narrow(uint16_t *d, const float *s, Py_ssize_t n)
{ PICK(f16_narrow)(d, s, n); }

/* Argument checks: every failure is ValueError (the Python face raises the project's
 * typed errors before calling here; reaching one of these is a bug in a caller). */
static int overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *p = a->buf, *q = b->buf;
    return p < q + b->len && q < p + a->len;
}

static int check_pair(const Py_buffer *d, Py_ssize_t dsize, const Py_buffer *s, Py_ssize_t ssize,
                      Py_ssize_t *n)
{
    if (d->len % dsize || s->len % ssize) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes are not whole elements of "
                     "%zd and %zd bytes", d->len, s->len, dsize, ssize);
        return -1;
    }
    if (d->len / dsize != s->len / ssize) {
        PyErr_Format(PyExc_ValueError, "%zd elements into %zd", s->len / ssize, d->len / dsize);
        return -1;
    }
    if (overlap(d, s)) {
        PyErr_SetString(PyExc_ValueError, "source and destination overlap");
        return -1;
    }
    *n = d->len / dsize;
    return 0;
}

static int check_code(int code, int floating)
{
    if (!item_size(code) || (floating && (code == T_I32 || code == T_I64))) {
        PyErr_Format(PyExc_ValueError, "no such %selement type code: %d", floating ? "floating " : "", code);
        return -1;
    }
    return 0;
}

static int check_wire(int wire)
{
    if (wire != T_BF16 && wire != T_F16) {
        PyErr_Format(PyExc_ValueError, "a wire type is bfloat16 or float16, not code %d", wire);
        return -1;
    }
    return 0;
}

/* The operations on a destination and a source, behind one signature: ``code`` is the
 * element type (the wire type for widen and narrow), ``n`` the elements. */
typedef smb_pair_op pair_op;

static void op_add(void *d, const void *s, double alpha, int code, Py_ssize_t n)
{
    (void)alpha;
    switch (code) {
    case T_F32: add_f32(d, s, n); break;
    case T_F64: add_f64(d, s, n); break;
    case T_I32: add_u32(d, s, n); break;
    case T_I64: add_u64(d, s, n); break;
    case T_BF16: add_bf16(d, s, n); break;
    case T_F16: f16_arith(F16_ADD, d, 0.0f, s, n); break;
    }
}

static void op_axpy(void *d, const void *s, double alpha, int code, Py_ssize_t n)
{
    float a = (float)alpha;
    switch (code) {
    case T_F32: axpy_f32(d, a, s, n); break;
    case T_F64: axpy_f64(d, alpha, s, n); break;
    case T_BF16: axpy_bf16(d, a, s, n); break;
    case T_F16: f16_arith(F16_AXPY, d, a, s, n); break;
    }
}

static void op_widen(void *d, const void *s, double add, int wire, Py_ssize_t n)
{
    if (wire == T_F16)
        f16_widen(d, s, n, add != 0.0);
    else
        (add != 0.0 ? widen_add_bf16 : widen_bf16)(d, s, n);
}

static void op_narrow(void *d, const void *s, double alpha, int wire, Py_ssize_t n)
{
    (void)alpha;
    if (wire == T_F16)
        f16_narrow(d, s, n);
    else
        narrow_bf16(d, s, n);
}

/* Check the pair (unless ``refused`` already: an error is set), run ``op`` with the
 * interpreter lock released, release both buffers. */
static PyObject *run_pair(Py_buffer *d, Py_buffer *s, Py_ssize_t dsize, Py_ssize_t ssize, int refused,
                          pair_op op, double alpha, int code)
{
    Py_ssize_t n;
    PyObject *result = NULL;
    if (!refused && !check_pair(d, dsize, s, ssize, &n)) {
        Py_BEGIN_ALLOW_THREADS
        op(d->buf, s->buf, alpha, code, n);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(d);
    PyBuffer_Release(s);
    return result;
}

PyDoc_STRVAR(add_doc, "add(dst, src, code)\n--\n\ndst += src elementwise, in place.");

static PyObject *py_add(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer d, s;
    int code;
    if (!PyArg_ParseTuple(args, "w*y*i", &d, &s, &code))
        return NULL;
    int refused = check_code(code, 0);
    return run_pair(&d, &s, item_size(code), item_size(code), refused, op_add, 0.0, code);
}

PyDoc_STRVAR(axpy_doc, "axpy(dst, alpha, src, code)\n--\n\ndst += alpha * src elementwise (floating types).");

static PyObject *py_axpy(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer d, s;
    double alpha;
    int code;
    if (!PyArg_ParseTuple(args, "w*dy*i", &d, &alpha, &s, &code))
        return NULL;
    int refused = check_code(code, 1);
    return run_pair(&d, &s, item_size(code), item_size(code), refused, op_axpy, alpha, code);
}

PyDoc_STRVAR(widen_doc, "widen(dst, src, wire, add)\n--\n\n"
             "The 16-bit src widened into float32 dst (exact), stored or, with add, added.");

static PyObject *py_widen(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer d, s;
    int wire, add;
    if (!PyArg_ParseTuple(args, "w*y*ip", &d, &s, &wire, &add))
        return NULL;
    int refused = check_wire(wire);
    return run_pair(&d, &s, 4, 2, refused, op_widen, add ? 1.0 : 0.0, wire);
}

PyDoc_STRVAR(narrow_doc, "narrow(dst, src, wire)\n--\n\n"
             "float32 src rounded once into the 16-bit dst (nearest-even; NaN stays NaN).");

static PyObject *py_narrow(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer d, s;
    int wire;
    if (!PyArg_ParseTuple(args, "w*y*i", &d, &s, &wire))
        return NULL;
    int refused = check_wire(wire);
    return run_pair(&d, &s, 2, 4, refused, op_narrow, 0.0, wire);
}

PyDoc_STRVAR(scale_doc, "scale(dst, alpha, code)\n--\n\ndst *= alpha elementwise (floating types).");

static PyObject *py_scale(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer d;
    double alpha;
    int code;
    if (!PyArg_ParseTuple(args, "w*di", &d, &alpha, &code))
        return NULL;
    if (check_code(code, 1) || d.len % item_size(code)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%zd bytes are not whole elements", d.len);
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_ssize_t n = d.len / item_size(code);
    float a = (float)alpha;
    Py_BEGIN_ALLOW_THREADS
    switch (code) {
    case T_F32: scale_f32(d.buf, a, n); break;
    case T_F64: scale_f64(d.buf, alpha, n); break;
    case T_BF16: scale_bf16(d.buf, a, n); break;
    case T_F16: f16_arith(F16_SCALE, d.buf, a, NULL, n); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(f16c_doc, "f16c(on=None)\n--\n\n"
             "Whether float16 elements are converted by the CPU's F16C instructions; with on, "
             "use them (True, where the CPU has them) or not (False). Returns the setting "
             "before. For tests of both conversions.");

static PyObject *py_f16c(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *on = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &on))
        return NULL;
    int before = use_f16c;
    if (on != Py_None) {
        int want = PyObject_IsTrue(on);
        if (want < 0)
            return NULL;
#if defined(__x86_64__)
        __builtin_cpu_init();
        use_f16c = want && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    }
    return PyBool_FromLong(before);
}

PyDoc_STRVAR(admit_push_doc, "admit_push(word, parties, round, root)\n--\n\n"
             "(step, value): what a push does to a slot with count word ``word`` (_rounds.h).");

static PyObject *py_admit_push(PyObject *Py_UNUSED(self), PyObject *args)
{
    long long word, parties, round;
    int root;
    if (!PyArg_ParseTuple(args, "LLLp", &word, &parties, &round, &root))
        return NULL;
    int64_t value = 0;
    int step = round_admit_push(word, parties, round, root, &value);
    return Py_BuildValue("iL", step, (long long)value);
}

PyDoc_STRVAR(admit_pull_doc, "admit_pull(word, parties, round)\n--\n\n"
             "(step, value): what a pull does to a slot with count word ``word`` (_rounds.h).");

static PyObject *py_admit_pull(PyObject *Py_UNUSED(self), PyObject *args)
{
    long long word, parties, round;
    if (!PyArg_ParseTuple(args, "LLL", &word, &parties, &round))
        return NULL;
    int64_t value = 0;
    int step = round_admit_pull(word, parties, round, &value);
    return Py_BuildValue("iL", step, (long long)value);
}

static PyMethodDef methods[] = {
    {"admit_push", py_admit_push, METH_VARARGS, admit_push_doc},
    {"admit_pull", py_admit_pull, METH_VARARGS, admit_pull_doc},
    {"add", py_add, METH_VARARGS, add_doc},
    {"axpy", py_axpy, METH_VARARGS, axpy_doc},
    {"scale", py_scale, METH_VARARGS, scale_doc},
    {"widen", py_widen, METH_VARARGS, widen_doc},
    {"narrow", py_narrow, METH_VARARGS, narrow_doc},
    {"f16c", py_f16c, METH_VARARGS, f16c_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "smb_protocol._native",
    "Elementwise kernels on raw buffers, one pass each, the interpreter lock released "
    "(their faces: smb_server.memserver.kernels, smb_protocol.chunk_types).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    static const struct smb_kernels kernels = {op_add, op_widen, item_size, op_narrow};
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New((void *)&kernels, KERNELS_CAPSULE, NULL);
    int failed = capsule == NULL || PyModule_AddObjectRef(m, "kernels", capsule) < 0;
    Py_XDECREF(capsule);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
