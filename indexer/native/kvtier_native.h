/* Shared by the indexer's C helper sources (kvtier_native.c, index_ops.c, decode.c). */
#ifndef KVTIER_NATIVE_H
#define KVTIER_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* CPython 3.11 with 30-bit digits: an int's absolute value is Py_SIZE(o) digits of
 * PyLong_SHIFT bits in ob_digit, least significant first (cpython/longintrepr.h). The
 * index's fast paths read and build ints that way; elsewhere they use the number API. */
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
#define KV_INT_DIGITS 1
#define KV_DIGITS(o) (((PyLongObject *)(o))->ob_digit)
#endif

/* One msgpack int at p[*pos]: 0 and *v (*neg: a negative value, *v its two's complement
 * bits), -1 truncated, -2 not an int. */
static inline int kv_mp_int(const unsigned char *p, Py_ssize_t len, Py_ssize_t *pos, uint64_t *v,
              int *neg) {
    if (*pos >= len) return -1;
    unsigned char t = p[*pos];
    *neg = 0;
    if (t <= 0x7f) { (*pos)++; *v = t; return 0; }
    if (t >= 0xe0) { (*pos)++; *neg = 1; *v = (uint64_t)(int64_t)(int8_t)t; return 0; }
    Py_ssize_t w;
    int is_signed;
    switch (t) {
    case 0xcc: case 0xcd: case 0xce: case 0xcf: w = (Py_ssize_t)1 << (t - 0xcc); is_signed = 0; break;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: w = (Py_ssize_t)1 << (t - 0xd0); is_signed = 1; break;
    default: return -2;   /* not an int */
    }
    if (*pos + 1 + w > len) return -1;
    const unsigned char *q = p + *pos + 1;
    uint64_t x = 0;
    for (Py_ssize_t i = 0; i < w; i++) x = (x << 8) | q[i];
    if (is_signed && (q[0] & 0x80)) {   /* a signed encoding: negative iff its top bit is set */
        *neg = 1;
        if (w < 8) x |= ~(uint64_t)0 << (8 * w);   /* sign-extend to 64 bits */
    }
    *pos += 1 + w;
    *v = x;
    return 0;
}

PyObject *kv_make(PyObject *cls, PyObject *descrs, PyObject **vals);
PyObject *kv_store(PyObject *self, PyObject *args);
PyObject *kv_store_tokens(PyObject *self, PyObject *args);
PyObject *kv_msgpack_keys(const unsigned char *p, Py_ssize_t len, Py_ssize_t bs, uint64_t seed,
                          uint64_t prev, Py_ssize_t max_blocks, Py_ssize_t *count);
PyObject *kv_walk(PyObject *self, PyObject *args);
PyObject *kv_route_rows(PyObject *self, PyObject *args);
#ifdef KV_INT_DIGITS
PyObject *kv_lookup(PyObject *self, PyObject *args);
#endif
PyObject *kv_decode_batch(PyObject *self, PyObject *args);

#endif
