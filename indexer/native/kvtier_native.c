/* kvtier indexer's C helper: the module, and request keys of a token list, as
 * kvtier.hashing.RequestKeyHasher.keys (the index's loops: index_ops.c; the event
 * decoder: decode.c).
 *
 * key(i) = XXH3_64(key(i-1) as 8 bytes little-endian || block i as uint32 little-endian, seed)
 *
 * Tokens must be ints in [0, 2**32): OverflowError otherwise, TypeError for a non-int
 * (what array('I', ...) raises on the pure-Python path). Built by build.py against the
 * system's xxhash.h (Debian: libxxhash-dev), fully inlined: no library at run time.
 */
#include "kvtier_native.h"
#include <structmember.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

static inline void put_u64le(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void put_u32le(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}

static PyObject *request_keys(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t bs;
    unsigned long long seed, prev;
    if (!PyArg_ParseTuple(args, "OnKK", &tokens, &bs, &seed, &prev)) return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a list or tuple");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) / bs;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    size_t stride = 8 + 4 * (size_t)bs;
    unsigned char *buf = PyMem_Malloc(n > 0 ? stride * (size_t)n : 1);
    if (buf == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t b = 0; b < n; b++) {
        unsigned char *p = buf + stride * (size_t)b + 8;
        PyObject **blk = items + b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            PyObject *o = blk[j];
            if (!PyLong_Check(o)) {
                PyErr_Format(PyExc_TypeError, "token ids must be int, not %.100s",
                             Py_TYPE(o)->tp_name);
                goto fail;
            }
            unsigned long v = PyLong_AsUnsignedLong(o);
            if (v == (unsigned long)-1 && PyErr_Occurred()) goto fail;
            if (v > 0xFFFFFFFFUL) {
                PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
                goto fail;
            }
            put_u32le(p + 4 * j, (uint32_t)v);
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t b = 0; b < n; b++) {
        unsigned char *p = buf + stride * (size_t)b;
        put_u64le(p, (uint64_t)prev);
        prev = XXH3_64bits_withSeed(p, stride, (XXH64_hash_t)seed);
        PyObject *k = PyLong_FromUnsignedLongLong(prev);
        if (k == NULL) { Py_DECREF(out); goto fail; }
        PyList_SET_ITEM(out, b, k);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(buf);
    Py_DECREF(seq);
    return NULL;
}

/* request_keys_msgpack(raw, block_size, seed, parent_key, max_blocks) -> (keys, ntokens):
 * request_keys over a token list given as its msgpack encoding (an array of ints), so the
 * indexer's event decoder need not make a Python int per token. Keys for
 * min(ntokens // block_size, max_blocks) blocks. Not an array: ValueError (the caller checks
 * first); an element that is no int: TypeError; negative or >= 2**32: OverflowError (as the
 * list path raises). */

/* Request keys of the first min(count // bs, max_blocks) blocks of a msgpack token array
 * (*count: its length), or NULL with the error request_keys_msgpack raises. */
PyObject *kv_msgpack_keys(const unsigned char *p, Py_ssize_t len, Py_ssize_t bs, uint64_t seed,
                          uint64_t prev, Py_ssize_t max_blocks, Py_ssize_t *count) {
    Py_ssize_t pos = 0;
    PyObject *keys = NULL;
    unsigned char *buf = NULL;
    if (bs <= 0) { PyErr_SetString(PyExc_ValueError, "block_size must be positive"); return NULL; }
    if (len < 1) goto notarray;
    if (p[0] >= 0x90 && p[0] <= 0x9f) { *count = p[0] & 0x0f; pos = 1; }
    else if (p[0] == 0xdc && len >= 3) { *count = (p[1] << 8) | p[2]; pos = 3; }
    else if (p[0] == 0xdd && len >= 5) {
        *count = ((Py_ssize_t)p[1] << 24) | (p[2] << 16) | (p[3] << 8) | p[4]; pos = 5;
    } else goto notarray;
    Py_ssize_t n = *count / bs;
    if (n > max_blocks) n = max_blocks < 0 ? 0 : max_blocks;
    size_t stride = 8 + 4 * (size_t)bs;
    buf = PyMem_Malloc(n > 0 ? stride * (size_t)n : 1);
    if (buf == NULL) { PyErr_NoMemory(); goto done; }
    /* every element is checked (as the list path converts every token it hashes) */
    for (Py_ssize_t b = 0; b < n; b++) {
        unsigned char *q = buf + stride * (size_t)b + 8;
        for (Py_ssize_t j = 0; j < bs; j++) {
            uint64_t v; int neg;
            if (pos < len && p[pos] <= 0x7f) { v = p[pos++]; neg = 0; }   /* fixint */
            else if (pos + 2 < len && p[pos] == 0xcd) {                     /* uint16 */
                v = ((uint64_t)p[pos + 1] << 8) | p[pos + 2]; pos += 3; neg = 0;
            } else if (pos < len && (p[pos] == 0xc2 || p[pos] == 0xc3)) {   /* bool is an int */
                v = p[pos++] - 0xc2; neg = 0;
            } else {
                int rc = kv_mp_int(p, len, &pos, &v, &neg);
                if (rc == -1) {
                    PyErr_SetString(PyExc_ValueError, "truncated msgpack array");
                    goto done;
                }
                if (rc == -2) {
                    PyErr_SetString(PyExc_TypeError, "token ids must be int");
                    goto done;
                }
            }
            if (neg || v > 0xFFFFFFFFULL) {
                PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
                goto done;
            }
            put_u32le(q + 4 * j, (uint32_t)v);
        }
    }
    keys = PyList_New(n);
    if (keys == NULL) goto done;
    for (Py_ssize_t b = 0; b < n; b++) {
        unsigned char *q = buf + stride * (size_t)b;
        put_u64le(q, prev);
        prev = XXH3_64bits_withSeed(q, stride, (XXH64_hash_t)seed);
        PyObject *k = PyLong_FromUnsignedLongLong(prev);
        if (k == NULL) { Py_CLEAR(keys); goto done; }
        PyList_SET_ITEM(keys, b, k);
    }
    goto done;
notarray:
    PyErr_SetString(PyExc_ValueError, "not a msgpack array");
done:
    PyMem_Free(buf);
    return keys;
}

static PyObject *request_keys_msgpack(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t bs, max_blocks, count = 0;
    unsigned long long seed, prev;
    if (!PyArg_ParseTuple(args, "y*nKKn", &raw, &bs, &seed, &prev, &max_blocks)) return NULL;
    PyObject *keys = kv_msgpack_keys(raw.buf, raw.len, bs, seed, prev, max_blocks, &count);
    PyBuffer_Release(&raw);
    return keys == NULL ? NULL : Py_BuildValue("(Nn)", keys, count);
}

/* A new cls with its slots set from vals through their member descriptors, bypassing
 * __init__ (used for frozen dataclasses and msgspec structs whose __init__ does only that). */
PyObject *kv_make(PyObject *cls, PyObject *descrs, PyObject **vals) {
    PyTypeObject *tp = (PyTypeObject *)cls;
    PyObject *o = tp->tp_alloc(tp, 0);
    if (o == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(descrs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(descrs, i);
        if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {   /* a slot of cls: store it in place */
            PyMemberDescrObject *md = (PyMemberDescrObject *)d;
            if (PyType_IsSubtype(tp, PyDescr_TYPE(md)) && md->d_member->type == T_OBJECT_EX
                && md->d_member->offset > 0 && !(md->d_member->flags & READONLY)) {
                PyObject **slot = (PyObject **)((char *)o + md->d_member->offset);
                Py_INCREF(vals[i]);
                Py_XSETREF(*slot, vals[i]);
                continue;
            }
        }
        descrsetfunc set = Py_TYPE(d)->tp_descr_set;
        if (set == NULL) {
            PyErr_SetString(PyExc_TypeError, "not a slot descriptor");
            Py_DECREF(o);
            return NULL;
        }
        if (set(d, o, vals[i]) < 0) { Py_DECREF(o); return NULL; }
    }
    return o;
}

static PyMethodDef methods[] = {
#ifdef KV_INT_DIGITS
    {"lookup", kv_lookup, METH_VARARGS,
     "lookup(keys, table, holders, hashes=None) -> (dict holder -> depth, deepest)"},
#endif
    {"walk", kv_walk, METH_VARARGS, "walk(keys, table) -> list[(depth, dropped_mask)]"},
    {"store", kv_store, METH_VARARGS, "store(maps, keys, blocks, tb, bit, start) -> -1 or index"},
    {"store_tokens", kv_store_tokens, METH_VARARGS,
     "store_tokens(maps, keys, hashes, raw, block_size, seed, parent_key, n, tb, bit) -> "
     "(-1 or index, request keys)"},
    {"route_rows", kv_route_rows, METH_VARARGS,
     "route_rows(found, block_size, target, tier_values, cpu, match, match_slots) -> "
     "(matches, target_blocks, cpu_holders)"},
    {"decode_batch", kv_decode_batch, METH_VARARGS,
     "decode_batch(payload, seq, classes) -> EventBatch, or None for an unusual shape"},
    {"request_keys_msgpack", request_keys_msgpack, METH_VARARGS,
     "request_keys_msgpack(raw, block_size, seed, parent_key, max_blocks) -> (keys, ntokens)"},
    {"request_keys", request_keys, METH_VARARGS,
     "request_keys(tokens, block_size, seed, parent_key) -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvtier_indexer_native",
    "kvtier indexer: compiled event decoding, request keys, index store and prefix walk",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kvtier_indexer_native(void) { return PyModule_Create(&module); }
