/* kvtier indexer's C helper: MemoryIndex's loops (store, the prefix walk) and the
 * per-holder rows of a /v1/route answer. Each is the Python loop it replaces in
 * kvtier.indexer.index / kvtier.indexer.select, with the same answers (tests compare them).
 */
#include "kvtier_native.h"

/* One block of store(), with the number API (any ints). 0 stored, 1 the engine hash maps
 * to another request key (not stored), -1 error. */
static int store_one(PyObject *maps, PyObject *keys, PyObject *eh, PyObject *rk, PyObject *tb,
                     PyObject *bit, PyObject *mte) {
    PyObject *two = PyLong_FromLong(2);
    if (two == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(maps, eh), *packed = NULL;
    if (old == NULL) {
        if (PyErr_Occurred()) goto fail;
        PyObject *sh = PyNumber_Lshift(rk, two);
        if (sh == NULL) goto fail;
        packed = PyNumber_Or(sh, tb);
        Py_DECREF(sh);
        if (packed == NULL) goto fail;
    } else {
        Py_INCREF(old);
        PyObject *ork = PyNumber_Rshift(old, two);
        if (ork == NULL) { Py_DECREF(old); goto fail; }
        int differ = PyObject_RichCompareBool(ork, rk, Py_NE);
        Py_DECREF(ork);
        if (differ != 0) { Py_DECREF(old); Py_DECREF(two); return differ < 0 ? -1 : 1; }
        PyObject *has = PyNumber_And(old, tb);
        if (has == NULL) { Py_DECREF(old); goto fail; }
        int set = PyObject_IsTrue(has);
        Py_DECREF(has);
        if (set < 0) { Py_DECREF(old); goto fail; }
        if (!set) {
            packed = PyNumber_Or(old, tb);
            if (packed == NULL) { Py_DECREF(old); goto fail; }
        }
        Py_DECREF(old);
    }
    Py_DECREF(two);
    two = NULL;
    if (packed != NULL) {
        int rc = PyDict_SetItem(maps, eh, packed);
        Py_DECREF(packed);
        if (rc < 0) return -1;
    }
    PyObject *cur = PyDict_GetItemWithError(keys, rk);
    if (cur == NULL) {
        if (PyErr_Occurred()) return -1;
        return PyObject_SetItem(keys, rk, bit) < 0 ? -1 : 0;   /* new: already last */
    }
    Py_INCREF(cur);
    PyObject *has = PyNumber_And(cur, bit);
    if (has == NULL) { Py_DECREF(cur); return -1; }
    int set = PyObject_IsTrue(has);
    Py_DECREF(has);
    if (set < 0) { Py_DECREF(cur); return -1; }
    if (!set) {
        PyObject *nw = PyNumber_Or(cur, bit);
        if (nw == NULL) { Py_DECREF(cur); return -1; }
        int rc = PyObject_SetItem(keys, rk, nw);
        Py_DECREF(nw);
        if (rc < 0) { Py_DECREF(cur); return -1; }
    }
    Py_DECREF(cur);
    PyObject *a[2] = {keys, rk};
    PyObject *r = PyObject_Vectorcall(mte, a, 2, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
fail:
    Py_XDECREF(two);
    Py_XDECREF(packed);
    return -1;
}

#ifdef KV_INT_DIGITS
#define KV_MASK30 ((uint64_t)0x3FFFFFFF)

/* A request key as uint64; 0 if it is not an exact int in [0, 2**64) (then the number API). */
static int key_u64(PyObject *o, uint64_t *v) {
    if (!PyLong_CheckExact(o)) return 0;
    Py_ssize_t n = Py_SIZE(o);
    if (n < 0 || n > 3) return 0;
    const digit *d = KV_DIGITS(o);
    uint64_t x = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (i == 2 && d[2] >> 4) return 0;   /* over 64 bits */
        x = (x << 30) | d[i];
    }
    *v = x;
    return 1;
}

/* request_key << 2 | tiers (66 bits at most) as an int, built from its digits. */
static PyObject *packed_new(uint64_t rk, unsigned tiers) {
    if (rk < ((uint64_t)1 << 62)) return PyLong_FromUnsignedLongLong(rk << 2 | tiers);
    PyLongObject *o = _PyLong_New(3);
    if (o == NULL) return NULL;
    o->ob_digit[0] = (digit)(((rk << 2) | tiers) & KV_MASK30);
    o->ob_digit[1] = (digit)((rk >> 28) & KV_MASK30);
    o->ob_digit[2] = (digit)(rk >> 58);   /* non-zero: rk >= 2**62 */
    return (PyObject *)o;
}

/* A packed mapping value -> (request key, tiers); 0 if it is not one (number API). */
static int packed_get(PyObject *o, uint64_t *rk, unsigned *tiers) {
    if (!PyLong_CheckExact(o)) return 0;
    Py_ssize_t n = Py_SIZE(o);
    if (n < 0 || n > 3) return 0;
    const digit *d = KV_DIGITS(o);
    uint64_t d0 = n > 0 ? d[0] : 0, d1 = n > 1 ? d[1] : 0, d2 = n > 2 ? d[2] : 0;
    if (d2 >> 6) return 0;   /* over 66 bits */
    *tiers = (unsigned)(d0 & 3);
    *rk = (d0 >> 2) | (d1 << 28) | (d2 << 58);
    return 1;
}

/* Is bit ``slot`` set in the non-negative int ``m``? */
static inline int has_slot(PyObject *m, Py_ssize_t slot) {
    Py_ssize_t i = slot / PyLong_SHIFT;
    return i < Py_SIZE(m) && ((KV_DIGITS(m)[i] >> (slot % PyLong_SHIFT)) & 1);
}

/* The slot of a power of two, or -1. */
static Py_ssize_t slot_of(PyObject *bit) {
    if (!PyLong_CheckExact(bit) || Py_SIZE(bit) <= 0) return -1;
    Py_ssize_t n = Py_SIZE(bit);
    const digit *d = KV_DIGITS(bit);
    for (Py_ssize_t i = 0; i < n - 1; i++) if (d[i]) return -1;
    digit top = d[n - 1];
    if (top & (top - 1)) return -1;
    return (n - 1) * PyLong_SHIFT + __builtin_ctz((unsigned int)top);
}
#endif

/* What store needs per call: the unbound OrderedDict.move_to_end (called without a bound
 * method per block) and, on CPython 3.11, the holder's slot and the tier bit as C ints. */
typedef struct { PyObject *mte, *tb, *bit; int fast; Py_ssize_t slot; long tbv; } store_ctx;

static int ctx_init(store_ctx *x, PyObject *keys, PyObject *tb, PyObject *bit) {
    static PyObject *mte_name = NULL;
    if (mte_name == NULL) mte_name = PyUnicode_InternFromString("move_to_end");
    if (mte_name == NULL) return -1;
    x->mte = PyObject_GetAttr((PyObject *)Py_TYPE(keys), mte_name);
    if (x->mte == NULL) return -1;
    x->tb = tb;
    x->bit = bit;
    x->fast = 0;
#ifdef KV_INT_DIGITS
    x->slot = slot_of(bit);
    x->tbv = PyLong_AsLong(tb);
    if (x->tbv == -1 && PyErr_Occurred()) { Py_CLEAR(x->mte); return -1; }
    x->fast = x->slot >= 0 && (x->tbv == 1 || x->tbv == 2);
#endif
    return 0;
}

/* One block: 0 stored, 1 the engine hash maps to another request key (not stored), -1 error.
 * On CPython 3.11 the ints are read and built from their digits (no arithmetic objects). */
static int store_block(PyObject *maps, PyObject *keys, PyObject *eh, PyObject *rk,
                       const store_ctx *x) {
#ifdef KV_INT_DIGITS
    uint64_t rkv, ork;
    unsigned otiers;
    if (x->fast && key_u64(rk, &rkv)) {
        /* a new engine hash is the common case: insert and look up in one probe */
        PyObject *fresh = packed_new(rkv, (unsigned)x->tbv), *packed = NULL;
        if (fresh == NULL) return -1;
        PyObject *old = PyDict_SetDefault(maps, eh, fresh);
        Py_DECREF(fresh);   /* maps holds it if it went in */
        if (old == NULL) return -1;
        if (old != fresh) {
            if (!packed_get(old, &ork, &otiers)) goto generic;
            if (ork != rkv) return 1;
            if (!(otiers & x->tbv)) {
                packed = packed_new(rkv, otiers | (unsigned)x->tbv);
                if (packed == NULL) return -1;
            }
        }
        if (packed != NULL) {
            int rc = PyDict_SetItem(maps, eh, packed);
            Py_DECREF(packed);
            if (rc < 0) return -1;
        }
        PyObject *cur = PyDict_GetItemWithError(keys, rk);
        if (cur == NULL) {
            if (PyErr_Occurred()) return -1;
            return PyObject_SetItem(keys, rk, x->bit) < 0 ? -1 : 0;   /* new: already last */
        }
        if (!PyLong_CheckExact(cur) || Py_SIZE(cur) < 0) {
            PyErr_SetString(PyExc_TypeError, "holder masks must be non-negative ints");
            return -1;
        }
        if (!has_slot(cur, x->slot)) {
            PyObject *nw = PyNumber_Or(cur, x->bit);
            if (nw == NULL) return -1;
            int rc = PyObject_SetItem(keys, rk, nw);
            Py_DECREF(nw);
            if (rc < 0) return -1;
        }
        PyObject *a[2] = {keys, rk};
        PyObject *r = PyObject_Vectorcall(x->mte, a, 2, NULL);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
generic:
#endif
    return store_one(maps, keys, eh, rk, x->tb, x->bit, x->mte);
}

/* store(maps, keys, blocks, tb, bit, start) -> -1 or i: MemoryIndex.store's loop from
 * blocks[start]. maps: engine hash -> request_key << 2 | tier bits; keys (an OrderedDict):
 * request key -> holder mask. Stops at the first block whose engine hash maps to another
 * request key (returns its index: the caller handles that rare case and goes on). */
PyObject *kv_store(PyObject *self, PyObject *args) {
    PyObject *maps, *keys, *blocks, *tb, *bit;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!n", &PyDict_Type, &maps, &PyDict_Type, &keys,
                          &PyList_Type, &blocks, &PyLong_Type, &tb, &PyLong_Type, &bit, &start))
        return NULL;
    store_ctx x;
    if (ctx_init(&x, keys, tb, bit) < 0) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(blocks, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "blocks must be (engine_hash, request_key) tuples");
            goto done;
        }
        int rc = store_block(maps, keys, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), &x);
        if (rc < 0) goto done;
        if (rc == 1) { ret = PyLong_FromSsize_t(i); goto done; }
    }
    ret = PyLong_FromLong(-1);
done:
    Py_DECREF(x.mte);
    return ret;
}

/* store_tokens(maps, keys, hashes, raw, block_size, seed, parent_key, n, tb, bit) ->
 *     (-1 or i, request keys): request_keys_msgpack of the first n blocks of raw (a msgpack
 * token array holding at least n blocks), then store's loop over zip(hashes, those keys),
 * without making the pairs. Stops as store does at i (keys: all n). */
PyObject *kv_store_tokens(PyObject *self, PyObject *args) {
    PyObject *maps, *keys, *hashes, *tb, *bit;
    Py_buffer raw;
    Py_ssize_t bs, n, count = 0;
    unsigned long long seed, prev;
    if (!PyArg_ParseTuple(args, "O!O!Oy*nKKnO!O!", &PyDict_Type, &maps, &PyDict_Type, &keys,
                          &hashes, &raw, &bs, &seed, &prev, &n, &PyLong_Type, &tb,
                          &PyLong_Type, &bit))
        return NULL;
    PyObject *rks = kv_msgpack_keys(raw.buf, raw.len, bs, seed, prev, n, &count);
    PyBuffer_Release(&raw);
    if (rks == NULL) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a tuple or list");
    if (seq == NULL) { Py_DECREF(rks); return NULL; }
    if (PyList_GET_SIZE(rks) != n || PySequence_Fast_GET_SIZE(seq) < n) {
        PyErr_SetString(PyExc_ValueError, "store_tokens: fewer hashes or token blocks than n");
        Py_DECREF(seq);
        Py_DECREF(rks);
        return NULL;
    }
    store_ctx x;
    if (ctx_init(&x, keys, tb, bit) < 0) { Py_DECREF(seq); Py_DECREF(rks); return NULL; }
    PyObject **ehs = PySequence_Fast_ITEMS(seq), *ret = NULL;
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        int rc = store_block(maps, keys, ehs[i], PyList_GET_ITEM(rks, i), &x);
        if (rc < 0) goto done;
        if (rc == 1) break;
    }
    ret = Py_BuildValue("(nO)", i < n ? i : (Py_ssize_t)-1, rks);
done:
    Py_DECREF(x.mte);
    Py_DECREF(seq);
    Py_DECREF(rks);
    return ret;
}

/* walk(keys, table) -> [(depth, mask), ...]: the prefix walk of MemoryIndex.lookup.
 * table maps key -> holder bitmask (int); a holder bit set on keys[0..d-1] and not on keys[d]
 * ends up in the mask paired with depth d (those still set at the end: depth len(keys)). */
PyObject *kv_walk(PyObject *self, PyObject *args) {
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

#ifdef KV_INT_DIGITS
/* Masks are never negative. */

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

/* out[holders[slot]] = depth for every set bit of mask (None holders skipped). hashes: None,
 * or hash(holders[slot]) per slot (a holder's tier is an Enum, whose hash is Python code). */
static int expand(PyObject *out, PyObject *mask, PyObject *holders, PyObject *hashes,
                  Py_ssize_t depth) {
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
            if (h == Py_None) continue;
            int rc;
            if (hashes != Py_None && slot < PyList_GET_SIZE(hashes)) {
                Py_hash_t hv = PyLong_AsSsize_t(PyList_GET_ITEM(hashes, slot));
                if (hv == -1 && PyErr_Occurred()) { Py_DECREF(d); return -1; }
                rc = _PyDict_SetItem_KnownHash(out, h, d, hv);
            } else {
                rc = PyDict_SetItem(out, h, d);
            }
            if (rc < 0) { Py_DECREF(d); return -1; }
        }
    }
    Py_DECREF(d);
    return 0;
}

/* lookup(keys, table, holders) -> (dict holder -> depth, deepest): MemoryIndex.lookup's
 * walk and answer in one pass; the masks are only combined (allocated) where a holder
 * drops out, which is at most once per distinct depth. */
PyObject *kv_lookup(PyObject *self, PyObject *args) {
    PyObject *keys, *table, *holders, *hashes = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!O!|O", &PyList_Type, &keys, &PyDict_Type, &table,
                          &PyList_Type, &holders, &hashes)) return NULL;
    if (hashes != Py_None && !PyList_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list or None");
        return NULL;
    }
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
        int rc = PyLong_CheckExact(dropped) ? expand(out, dropped, holders, hashes, i) : -1;
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
        if (expand(out, active, holders, hashes, n) < 0) goto fail;
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

/* route_rows(found, block_size, target, tier_values, cpu, match, match_slots) ->
 *     (matches, target_blocks, cpu_holders): kvtier.indexer.select's per-holder loops of a
 * /v1/route answer in one pass. found: {(pod, tier): blocks}; matches: match(pod,
 * tier_values[tier], blocks * block_size) for blocks > 0, longest first, then pod, then tier
 * value; target_blocks: the most blocks a holder of pod ``target`` has (0 if none or target
 * is None); cpu_holders: [(pod, blocks)] of holders whose tier is ``cpu`` (by identity), pod
 * is not target and blocks > 0, in found's order. None (the caller's Python path answers)
 * if a key is not a (str, tier) pair or a value not an int. match_slots: None, or match's
 * three slot descriptors (a msgspec struct: made without calling it, see kv_make). */
typedef struct { Py_ssize_t n; PyObject *pod, *tv; const void *s; Py_ssize_t len; } kv_row;

/* str order (code points): for two 1-byte-kind strings, their bytes in memcmp order */
static int str_cmp(PyObject *a, const void *sa, Py_ssize_t la, PyObject *b, const void *sb,
                   Py_ssize_t lb) {
    if (sa != NULL && sb != NULL) {
        int c = memcmp(sa, sb, (size_t)(la < lb ? la : lb));
        if (c) return c;
        return la < lb ? -1 : la > lb;
    }
    return PyUnicode_Compare(a, b);
}

static int row_cmp(const void *a, const void *b) {
    const kv_row *x = a, *y = b;
    if (x->n != y->n) return x->n > y->n ? -1 : 1;
    int c = str_cmp(x->pod, x->s, x->len, y->pod, y->s, y->len);
    if (c) return c;
    return PyUnicode_Compare(x->tv, y->tv);
}

PyObject *kv_route_rows(PyObject *self, PyObject *args) {
    PyObject *found, *target, *tiers, *cpu, *match, *slots;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "O!nOO!OOO", &PyDict_Type, &found, &bs, &target, &PyDict_Type,
                          &tiers, &cpu, &match, &slots)) return NULL;
    if (slots != Py_None && !(PyTuple_Check(slots) && PyTuple_GET_SIZE(slots) == 3
                              && PyType_Check(match))) {
        PyErr_SetString(PyExc_TypeError, "match_slots must be None or 3 descriptors");
        return NULL;
    }
    Py_ssize_t size = PyDict_GET_SIZE(found), nrows = 0, pos = 0, tblocks = 0;
    kv_row *rows = PyMem_Malloc((size > 0 ? size : 1) * sizeof(kv_row));
    if (rows == NULL) return PyErr_NoMemory();
    PyObject *cpus = PyList_New(0), *out = NULL, *key, *val;
    if (cpus == NULL) goto done;
    while (PyDict_Next(found, &pos, &key, &val)) {
        if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) != 2 || !PyLong_CheckExact(val))
            goto unusual;
        PyObject *pod = PyTuple_GET_ITEM(key, 0), *tier = PyTuple_GET_ITEM(key, 1);
        if (!PyUnicode_Check(pod)) goto unusual;
        Py_ssize_t n = PyLong_AsSsize_t(val);
        if (n == -1 && PyErr_Occurred()) { PyErr_Clear(); goto unusual; }
        int is_target = 0;
        if (target != Py_None) {
            is_target = pod == target ? 1
                : PyUnicode_CheckExact(target) && PyUnicode_CheckExact(pod)
                ? PyUnicode_GET_LENGTH(pod) == PyUnicode_GET_LENGTH(target)
                  && PyUnicode_Compare(pod, target) == 0
                : PyObject_RichCompareBool(pod, target, Py_EQ);
            if (is_target < 0) goto done;
            if (is_target && n > tblocks) tblocks = n;
        }
        if (n <= 0) continue;
        /* the tier's value: by identity first (an Enum's hash is Python code) */
        PyObject *tv = NULL, *tk, *tval;
        Py_ssize_t tpos = 0;
        while (PyDict_Next(tiers, &tpos, &tk, &tval)) if (tk == tier) { tv = tval; break; }
        if (tv == NULL) tv = PyDict_GetItemWithError(tiers, tier);
        if (tv == NULL) { if (PyErr_Occurred()) goto done; goto unusual; }
        if (!PyUnicode_Check(tv)) goto unusual;
        rows[nrows].n = n;
        rows[nrows].pod = pod;
        rows[nrows].tv = tv;
        rows[nrows].s = PyUnicode_IS_READY(pod) && PyUnicode_KIND(pod) == PyUnicode_1BYTE_KIND
                        ? PyUnicode_DATA(pod) : NULL;
        rows[nrows].len = PyUnicode_GET_LENGTH(pod);
        nrows++;
        if (tier == cpu && !is_target) {
            PyObject *c = Py_BuildValue("(On)", pod, n);
            if (c == NULL || PyList_Append(cpus, c) < 0) { Py_XDECREF(c); goto done; }
            Py_DECREF(c);
        }
    }
    qsort(rows, (size_t)nrows, sizeof(kv_row), row_cmp);
    if (PyErr_Occurred()) goto done;   /* a str comparison failed */
    PyObject *ms = PyList_New(nrows);
    if (ms == NULL) goto done;
    for (Py_ssize_t i = 0; i < nrows; i++) {
        PyObject *tok = PyLong_FromSsize_t(rows[i].n * bs);
        if (tok == NULL) { Py_DECREF(ms); goto done; }
        PyObject *a[3] = {rows[i].pod, rows[i].tv, tok};
        PyObject *m = slots == Py_None ? PyObject_Vectorcall(match, a, 3, NULL)
                                       : kv_make(match, slots, a);
        Py_DECREF(tok);
        if (m == NULL) { Py_DECREF(ms); goto done; }
        PyList_SET_ITEM(ms, i, m);
    }
    out = Py_BuildValue("(NnO)", ms, tblocks, cpus);
    goto done;
unusual:
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(cpus);
    PyMem_Free(rows);
    return out;
}
