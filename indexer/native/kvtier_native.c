/* kvtier indexer: request keys of a token list, as kvtier.hashing.RequestKeyHasher.keys.
 *
 * key(i) = XXH3_64(key(i-1) as 8 bytes little-endian || block i as uint32 little-endian, seed)
 *
 * Tokens must be ints in [0, 2**32): OverflowError otherwise, TypeError for a non-int
 * (what array('I', ...) raises on the pure-Python path). Built by build.py against the
 * system's xxhash.h (Debian: libxxhash-dev), fully inlined: no library at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
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
static int mp_uint(const unsigned char *p, Py_ssize_t len, Py_ssize_t *pos, uint64_t *v,
                   int *neg) {
    if (*pos >= len) return -1;
    unsigned char t = p[(*pos)++];
    Py_ssize_t need = 0;
    *neg = 0;
    if (t <= 0x7f) { *v = t; return 0; }
    if (t >= 0xe0) { *neg = 1; return 0; }
    if (t == 0xc2 || t == 0xc3) { *v = t - 0xc2; return 0; }   /* bool is an int in Python */
    switch (t) {
    case 0xcc: need = 1; break;
    case 0xcd: need = 2; break;
    case 0xce: need = 4; break;
    case 0xcf: need = 8; break;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        Py_ssize_t w = (Py_ssize_t)1 << (t - 0xd0);
        if (*pos + w > len) return -1;
        /* a signed encoding: negative iff its top bit is set */
        *neg = (p[*pos] & 0x80) != 0;
        uint64_t x = 0;
        for (Py_ssize_t i = 0; i < w; i++) x = (x << 8) | p[*pos + i];
        *pos += w;
        *v = x;
        return 0;
    }
    default: return -2;   /* not an int */
    }
    if (*pos + need > len) return -1;
    uint64_t x = 0;
    for (Py_ssize_t i = 0; i < need; i++) x = (x << 8) | p[*pos + i];
    *pos += need;
    *v = x;
    return 0;
}

static PyObject *request_keys_msgpack(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t bs, max_blocks;
    unsigned long long seed, prev;
    if (!PyArg_ParseTuple(args, "y*nKKn", &raw, &bs, &seed, &prev, &max_blocks)) return NULL;
    const unsigned char *p = raw.buf;
    Py_ssize_t len = raw.len, pos = 0, count;
    PyObject *out = NULL;
    unsigned char *buf = NULL;
    if (bs <= 0) { PyErr_SetString(PyExc_ValueError, "block_size must be positive"); goto done; }
    if (len < 1) goto notarray;
    if (p[0] >= 0x90 && p[0] <= 0x9f) { count = p[0] & 0x0f; pos = 1; }
    else if (p[0] == 0xdc && len >= 3) { count = (p[1] << 8) | p[2]; pos = 3; }
    else if (p[0] == 0xdd && len >= 5) {
        count = ((Py_ssize_t)p[1] << 24) | (p[2] << 16) | (p[3] << 8) | p[4]; pos = 5;
    } else goto notarray;
    Py_ssize_t n = count / bs;
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
            else {
                int rc = mp_uint(p, len, &pos, &v, &neg);
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
    PyObject *keys = PyList_New(n);
    if (keys == NULL) goto done;
    for (Py_ssize_t b = 0; b < n; b++) {
        unsigned char *q = buf + stride * (size_t)b;
        put_u64le(q, (uint64_t)prev);
        prev = XXH3_64bits_withSeed(q, stride, (XXH64_hash_t)seed);
        PyObject *k = PyLong_FromUnsignedLongLong(prev);
        if (k == NULL) { Py_DECREF(keys); goto done; }
        PyList_SET_ITEM(keys, b, k);
    }
    out = Py_BuildValue("(Nn)", keys, count);
    goto done;
notarray:
    PyErr_SetString(PyExc_ValueError, "not a msgpack array");
done:
    PyMem_Free(buf);
    PyBuffer_Release(&raw);
    return out;
}

/* store(maps, keys, blocks, tb, bit, start) -> -1 or i: MemoryIndex.store's loop from
 * blocks[start]. maps: engine hash -> request_key << 2 | tier bits; keys (an OrderedDict):
 * request key -> holder mask. Stops at the first block whose engine hash maps to another
 * request key (returns its index: the caller handles that rare case and goes on). */
static PyObject *store(PyObject *self, PyObject *args) {
    PyObject *maps, *keys, *blocks, *tb, *bit;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!n", &PyDict_Type, &maps, &PyDict_Type, &keys,
                          &PyList_Type, &blocks, &PyLong_Type, &tb, &PyLong_Type, &bit, &start))
        return NULL;
    static PyObject *two = NULL, *mte = NULL;
    if (two == NULL) two = PyLong_FromLong(2);
    if (mte == NULL) mte = PyUnicode_InternFromString("move_to_end");
    if (two == NULL || mte == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(blocks, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "blocks must be (engine_hash, request_key) tuples");
            return NULL;
        }
        PyObject *eh = PyTuple_GET_ITEM(pair, 0), *rk = PyTuple_GET_ITEM(pair, 1);
        PyObject *old = PyDict_GetItemWithError(maps, eh), *packed = NULL;
        if (old == NULL) {
            if (PyErr_Occurred()) return NULL;
            PyObject *sh = PyNumber_Lshift(rk, two);
            if (sh == NULL) return NULL;
            packed = PyNumber_Or(sh, tb);
            Py_DECREF(sh);
            if (packed == NULL) return NULL;
        } else {
            Py_INCREF(old);
            PyObject *ork = PyNumber_Rshift(old, two);
            if (ork == NULL) { Py_DECREF(old); return NULL; }
            int differ = PyObject_RichCompareBool(ork, rk, Py_NE);
            Py_DECREF(ork);
            if (differ != 0) { Py_DECREF(old); return differ < 0 ? NULL : PyLong_FromSsize_t(i); }
            PyObject *has = PyNumber_And(old, tb);
            if (has == NULL) { Py_DECREF(old); return NULL; }
            int set = PyObject_IsTrue(has);
            Py_DECREF(has);
            if (set < 0) { Py_DECREF(old); return NULL; }
            if (!set) {
                packed = PyNumber_Or(old, tb);
                if (packed == NULL) { Py_DECREF(old); return NULL; }
            }
            Py_DECREF(old);
        }
        if (packed != NULL) {
            int rc = PyDict_SetItem(maps, eh, packed);
            Py_DECREF(packed);
            if (rc < 0) return NULL;
        }
        PyObject *cur = PyDict_GetItemWithError(keys, rk);
        if (cur == NULL) {
            if (PyErr_Occurred()) return NULL;
            if (PyObject_SetItem(keys, rk, bit) < 0) return NULL;   /* new: already last */
            continue;
        }
        Py_INCREF(cur);
        PyObject *has = PyNumber_And(cur, bit);
        if (has == NULL) { Py_DECREF(cur); return NULL; }
        int set = PyObject_IsTrue(has);
        Py_DECREF(has);
        if (set < 0) { Py_DECREF(cur); return NULL; }
        if (!set) {
            PyObject *nw = PyNumber_Or(cur, bit);
            if (nw == NULL) { Py_DECREF(cur); return NULL; }
            int rc = PyObject_SetItem(keys, rk, nw);
            Py_DECREF(nw);
            if (rc < 0) { Py_DECREF(cur); return NULL; }
        }
        Py_DECREF(cur);
        PyObject *r = PyObject_CallMethodOneArg(keys, mte, rk);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    return PyLong_FromLong(-1);
}

/* walk(keys, table) -> [(depth, mask), ...]: the prefix walk of MemoryIndex.lookup.
 * table maps key -> holder bitmask (int); a holder bit set on keys[0..d-1] and not on keys[d]
 * ends up in the mask paired with depth d (those still set at the end: depth len(keys)). */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *keys, *table;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &keys, &PyDict_Type, &table)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(0);
    if (out == NULL || n == 0) return out;
    PyObject *zero = PyLong_FromLong(0);
    PyObject *active = PyDict_GetItemWithError(table, PyList_GET_ITEM(keys, 0));
    if (active == NULL) {
        Py_DECREF(zero);
        if (PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        return out;
    }
    Py_INCREF(active);
    Py_ssize_t i = 1;
    for (; i < n; i++) {
        PyObject *m = PyDict_GetItemWithError(table, PyList_GET_ITEM(keys, i));
        if (m == NULL) {
            if (PyErr_Occurred()) goto fail;
            m = zero;
        }
        if (m == active) continue;  /* the same object: nothing dropped */
        PyObject *nw = PyNumber_And(active, m);
        if (nw == NULL) goto fail;
        int same = PyObject_RichCompareBool(nw, active, Py_EQ);
        if (same < 0) { Py_DECREF(nw); goto fail; }
        if (same) { Py_DECREF(nw); continue; }
        PyObject *dropped = PyNumber_Xor(active, nw);
        if (dropped == NULL) { Py_DECREF(nw); goto fail; }
        PyObject *pair = Py_BuildValue("(nN)", i, dropped);
        if (pair == NULL || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); Py_DECREF(nw); goto fail; }
        Py_DECREF(pair);
        Py_DECREF(active);
        active = nw;
        int empty = PyObject_Not(active);
        if (empty < 0) goto fail;
        if (empty) break;
    }
    if (i == n) {
        int empty = PyObject_Not(active);
        if (empty < 0) goto fail;
        if (!empty) {
            PyObject *pair = Py_BuildValue("(nO)", n, active);
            if (pair == NULL || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); goto fail; }
            Py_DECREF(pair);
        }
    }
    Py_DECREF(active);
    Py_DECREF(zero);
    return out;
fail:
    Py_DECREF(active);
    Py_DECREF(zero);
    Py_DECREF(out);
    return NULL;
}

#if PY_VERSION_HEX < 0x030C0000
/* CPython 3.11: an int's absolute value is Py_SIZE(o) digits of PyLong_SHIFT bits in
 * ob_digit, least significant first (cpython/longintrepr.h). Masks are never negative. */
#define KV_DIGITS(o) (((PyLongObject *)(o))->ob_digit)

/* (a & m) == a, without allocating; -1: not two non-negative ints (use the slow path). */
static int is_subset(PyObject *a, PyObject *m) {
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(m)) return -1;
    Py_ssize_t na = Py_SIZE(a), nm = Py_SIZE(m);
    if (na < 0 || nm < 0) return -1;
    if (na > nm) return 0;           /* a's top digit is non-zero, m has none there */
    const digit *da = KV_DIGITS(a), *dm = KV_DIGITS(m);
    for (Py_ssize_t i = 0; i < na; i++)
        if ((da[i] & dm[i]) != da[i]) return 0;
    return 1;
}

/* out[holders[slot]] = depth for every set bit of mask (None holders skipped). */
static int expand(PyObject *out, PyObject *mask, PyObject *holders, Py_ssize_t depth) {
    Py_ssize_t nd = Py_SIZE(mask), nh = PyList_GET_SIZE(holders);
    if (nd < 0) { PyErr_SetString(PyExc_ValueError, "negative holder mask"); return -1; }
    PyObject *d = PyLong_FromSsize_t(depth);
    if (d == NULL) return -1;
    const digit *dg = KV_DIGITS(mask);
    for (Py_ssize_t i = 0; i < nd; i++) {
        digit bits = dg[i];
        while (bits) {
            Py_ssize_t slot = i * PyLong_SHIFT + __builtin_ctz((unsigned int)bits);
            bits &= bits - 1;
            if (slot >= nh) continue;
            PyObject *h = PyList_GET_ITEM(holders, slot);
            if (h != Py_None && PyDict_SetItem(out, h, d) < 0) { Py_DECREF(d); return -1; }
        }
    }
    Py_DECREF(d);
    return 0;
}

/* lookup(keys, table, holders) -> (dict holder -> depth, deepest): MemoryIndex.lookup's
 * walk and answer in one pass; the masks are only combined (allocated) where a holder
 * drops out, which is at most once per distinct depth. */
static PyObject *lookup(PyObject *self, PyObject *args) {
    PyObject *keys, *table, *holders;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &keys, &PyDict_Type, &table,
                          &PyList_Type, &holders)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), deepest = 0;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    if (n == 0) return Py_BuildValue("(Nn)", out, deepest);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *active = PyDict_GetItemWithError(table, PyList_GET_ITEM(keys, 0));
    if (active == NULL) {
        Py_DECREF(zero);
        if (PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        return Py_BuildValue("(Nn)", out, deepest);
    }
    Py_INCREF(active);
    Py_ssize_t i = 1;
    for (; i < n; i++) {
        PyObject *m = PyDict_GetItemWithError(table, PyList_GET_ITEM(keys, i));
        if (m == NULL) {
            if (PyErr_Occurred()) goto fail;
            m = zero;
        }
        if (m == active) continue;
        int sub = is_subset(active, m);
        if (sub == 1) continue;
        PyObject *nw = PyNumber_And(active, m);
        if (nw == NULL) goto fail;
        if (sub < 0) {
            int same = PyObject_RichCompareBool(nw, active, Py_EQ);
            if (same != 0) { Py_DECREF(nw); if (same < 0) goto fail; continue; }
        }
        PyObject *dropped = PyNumber_Xor(active, nw);
        if (dropped == NULL) { Py_DECREF(nw); goto fail; }
        int rc = PyLong_CheckExact(dropped) ? expand(out, dropped, holders, i) : -1;
        if (rc < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "holder masks must be ints");
        Py_DECREF(dropped);
        Py_DECREF(active);
        active = nw;
        if (rc < 0) goto fail;
        if (Py_SIZE(active) == 0) { deepest = i; break; }
    }
    if (i == n && Py_SIZE(active) != 0) {
        if (!PyLong_CheckExact(active)) {
            PyErr_SetString(PyExc_TypeError, "holder masks must be ints");
            goto fail;
        }
        if (expand(out, active, holders, n) < 0) goto fail;
        deepest = n;
    }
    Py_DECREF(active);
    Py_DECREF(zero);
    return Py_BuildValue("(Nn)", out, deepest);
fail:
    Py_DECREF(active);
    Py_DECREF(zero);
    Py_DECREF(out);
    return NULL;
}
#endif

static PyMethodDef methods[] = {
#if PY_VERSION_HEX < 0x030C0000
    {"lookup", lookup, METH_VARARGS,
     "lookup(keys, table, holders) -> (dict holder -> depth, deepest)"},
#endif
    {"walk", walk, METH_VARARGS, "walk(keys, table) -> list[(depth, dropped_mask)]"},
    {"store", store, METH_VARARGS, "store(maps, keys, blocks, tb, bit, start) -> -1 or index"},
    {"request_keys_msgpack", request_keys_msgpack, METH_VARARGS,
     "request_keys_msgpack(raw, block_size, seed, parent_key, max_blocks) -> (keys, ntokens)"},
    {"request_keys", request_keys, METH_VARARGS,
     "request_keys(tokens, block_size, seed, parent_key) -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvtier_indexer_native",
    "kvtier indexer: compiled request keys and prefix walk", -1, methods,
};

PyMODINIT_FUNC PyInit__kvtier_indexer_native(void) { return PyModule_Create(&module); }
