/* kvtier indexer's C helper: decode_batch, a vLLM KV-event batch straight into
 * kvtier.wire.kv_events objects, for the usual shape only.
 *
 * decode_batch(payload, seq, classes) -> EventBatch, or None: the payload is not the usual
 * shape and kvtier.indexer.fastdecode's msgspec path must answer. The usual shape is what
 * that path decodes with its typed structs: [ts (float), [event maps], dp_rank (int|nil)?]
 * with each event a map whose first key is "type" ("BlockStored", "BlockRemoved",
 * "AllBlocksCleared"), known fields of the expected msgpack types (ints not bools; strings
 * valid UTF-8; token_ids an array of ints, kept as its msgpack bytes in a RawTokens;
 * extra_keys nil or all nil), no duplicate keys, unknown keys skipped, nothing trailing.
 * Anything else gives None, so the answer is always the msgspec path's (tests compare).
 * classes: (EventBatch, its member descriptors (seq, ts, events, dp_rank), BlockStored,
 * (block_hashes, parent_block_hash, token_ids, block_size, medium, lora_name,
 * has_extra_keys, group_idx), BlockRemoved, (block_hashes, medium, group_idx),
 * AllBlocksCleared, RawTokens, (raw, _n, _list)). Objects are made by setting their slots
 * (frozen dataclasses: their __init__ does only that).
 */
#include "kvtier_native.h"

typedef struct { const unsigned char *p; Py_ssize_t len, pos; } cur;

#define UNUSUAL 1   /* return codes below: 0 ok, UNUSUAL, -1 Python error */

static int rd_be(cur *c, int w, uint64_t *v) {
    if (c->pos + w > c->len) return UNUSUAL;
    uint64_t x = 0;
    for (int i = 0; i < w; i++) x = (x << 8) | c->p[c->pos + i];
    c->pos += w;
    *v = x;
    return 0;
}

static int rd_container(cur *c, unsigned char fix, unsigned char b16, Py_ssize_t *n) {
    if (c->pos >= c->len) return UNUSUAL;
    unsigned char t = c->p[c->pos];
    uint64_t v;
    if ((t & 0xf0) == fix) { c->pos++; *n = t & 0x0f; return 0; }
    if (t != b16 && t != b16 + 1) return UNUSUAL;
    c->pos++;
    if (rd_be(c, t == b16 ? 2 : 4, &v)) return UNUSUAL;
    *n = (Py_ssize_t)v;
    return 0;
}
#define rd_array(c, n) rd_container(c, 0x90, 0xdc, n)
#define rd_map(c, n) rd_container(c, 0x80, 0xde, n)

static int rd_str(cur *c, const char **s, Py_ssize_t *n) {
    if (c->pos >= c->len) return UNUSUAL;
    unsigned char t = c->p[c->pos];
    uint64_t v;
    if (t >= 0xa0 && t <= 0xbf) { c->pos++; v = t & 0x1f; }
    else if (t >= 0xd9 && t <= 0xdb) { c->pos++; if (rd_be(c, 1 << (t - 0xd9), &v)) return UNUSUAL; }
    else return UNUSUAL;
    if ((uint64_t)(c->len - c->pos) < v) return UNUSUAL;
    *s = (const char *)c->p + c->pos;
    *n = (Py_ssize_t)v;
    c->pos += (Py_ssize_t)v;
    return 0;
}

static inline int is_nil(cur *c) {
    if (c->pos < c->len && c->p[c->pos] == 0xc0) { c->pos++; return 1; }
    return 0;
}

/* Skip one value of any type (nesting bounded). */
static int skip(cur *c, int depth) {
    if (c->pos >= c->len || depth > 32) return UNUSUAL;
    unsigned char t = c->p[c->pos];
    uint64_t v;
    Py_ssize_t n;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) { c->pos++; return 0; }
    if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
        if (rd_array(c, &n)) return UNUSUAL;
        for (Py_ssize_t i = 0; i < n; i++) if (skip(c, depth + 1)) return UNUSUAL;
        return 0;
    }
    if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
        if (rd_map(c, &n)) return UNUSUAL;
        for (Py_ssize_t i = 0; i < 2 * n; i++) if (skip(c, depth + 1)) return UNUSUAL;
        return 0;
    }
    if ((t >= 0xa0 && t <= 0xbf) || (t >= 0xd9 && t <= 0xdb)) {
        const char *s;
        return rd_str(c, &s, &n);
    }
    c->pos++;
    switch (t) {
    case 0xcc: case 0xd0: c->pos += 1; break;
    case 0xcd: case 0xd1: c->pos += 2; break;
    case 0xca: case 0xce: case 0xd2: c->pos += 4; break;
    case 0xcb: case 0xcf: case 0xd3: c->pos += 8; break;
    case 0xd4: c->pos += 2; break;
    case 0xd5: c->pos += 3; break;
    case 0xd6: c->pos += 5; break;
    case 0xd7: c->pos += 9; break;
    case 0xd8: c->pos += 17; break;
    case 0xc4: case 0xc5: case 0xc6:   /* bin */
        if (rd_be(c, 1 << (t - 0xc4), &v)) return UNUSUAL;
        if ((uint64_t)(c->len - c->pos) < v) return UNUSUAL;
        c->pos += (Py_ssize_t)v;
        break;
    case 0xc7: case 0xc8: case 0xc9:   /* ext */
        if (rd_be(c, 1 << (t - 0xc7), &v)) return UNUSUAL;
        if ((uint64_t)(c->len - c->pos) < v + 1) return UNUSUAL;
        c->pos += (Py_ssize_t)v + 1;
        break;
    default: return UNUSUAL;
    }
    return c->pos <= c->len ? 0 : UNUSUAL;
}

/* An int (never a bool) as a Python int; ``fold``: a negative one as its uint64 bits
 * (kv_events folds negative block hashes so). */
static int rd_int(cur *c, int fold, PyObject **out) {
    uint64_t v;
    int neg;
    if (kv_mp_int(c->p, c->len, &c->pos, &v, &neg)) return UNUSUAL;
    *out = (neg && !fold) ? PyLong_FromLongLong((long long)(int64_t)v)
                          : PyLong_FromUnsignedLongLong(v);
    return *out == NULL ? -1 : 0;
}

static int rd_opt_int(cur *c, int fold, PyObject **out) {
    if (is_nil(c)) { Py_INCREF(Py_None); *out = Py_None; return 0; }
    return rd_int(c, fold, out);
}

static int rd_opt_str(cur *c, PyObject **out) {
    if (is_nil(c)) { Py_INCREF(Py_None); *out = Py_None; return 0; }
    const char *s;
    Py_ssize_t n;
    if (rd_str(c, &s, &n)) return UNUSUAL;
    *out = PyUnicode_DecodeUTF8(s, n, NULL);
    if (*out == NULL) { PyErr_Clear(); return UNUSUAL; }   /* msgspec's path says what */
    return 0;
}

static int rd_hashes(cur *c, PyObject **out) {
    Py_ssize_t n;
    if (rd_array(c, &n)) return UNUSUAL;
    if (n > c->len - c->pos) return UNUSUAL;   /* each element is at least one byte */
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h;
        int rc = rd_int(c, 1, &h);
        if (rc) { Py_DECREF(t); return rc; }
        PyTuple_SET_ITEM(t, i, h);
    }
    *out = t;
    return 0;
}

static int key_is(const char *s, Py_ssize_t n, const char *name) {
    return (Py_ssize_t)strlen(name) == n && memcmp(s, name, (size_t)n) == 0;
}

enum { K_TYPE, K_HASHES, K_PARENT, K_TOKENS, K_BS, K_MEDIUM, K_LORA, K_EXTRA, K_GROUP, NK };
static const char *KEYS[NK] = {"type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "medium", "lora_name", "extra_keys", "group_idx"};

/* classes' layout (see the top) */
enum { C_BATCH, C_BATCH_D, C_STORED, C_STORED_D, C_REMOVED, C_REMOVED_D, C_CLEARED, C_RAW,
       C_RAW_D, NC };

/* One event map into *out, or UNUSUAL / -1. */
static int rd_event(cur *c, PyObject *classes, PyObject **out) {
    Py_ssize_t nk, sl;
    const char *s;
    if (rd_map(c, &nk) || nk < 1 || rd_str(c, &s, &sl) || !key_is(s, sl, "type")
        || rd_str(c, &s, &sl)) return UNUSUAL;
    int kind;   /* 0 BlockStored, 1 BlockRemoved, 2 AllBlocksCleared */
    if (key_is(s, sl, "BlockStored")) kind = 0;
    else if (key_is(s, sl, "BlockRemoved")) kind = 1;
    else if (key_is(s, sl, "AllBlocksCleared")) kind = 2;
    else return UNUSUAL;
    PyObject *v[NK] = {NULL};
    Py_ssize_t tok_start = 0, tok_len = 0, tok_n = 0;
    int rc = 0, seen = 1 << K_TYPE;
    for (Py_ssize_t i = 1; i < nk && rc == 0; i++) {
        if (rd_str(c, &s, &sl)) { rc = UNUSUAL; break; }
        int k = NK;
        if (kind != 2)
            for (int j = 1; j < NK; j++) if (key_is(s, sl, KEYS[j])) { k = j; break; }
        if (key_is(s, sl, "type")) k = K_TYPE;   /* a second tag */
        if (kind == 1 && k != K_TYPE && k != K_HASHES && k != K_MEDIUM && k != K_GROUP) k = NK;
        if (k == NK) { rc = skip(c, 0); continue; }
        if (seen & (1 << k)) { rc = UNUSUAL; break; }   /* a duplicate key */
        seen |= 1 << k;
        switch (k) {
        case K_HASHES: rc = rd_hashes(c, &v[k]); break;
        case K_PARENT: rc = rd_opt_int(c, 1, &v[k]); break;
        case K_GROUP: rc = rd_opt_int(c, 0, &v[k]); break;
        case K_MEDIUM: case K_LORA: rc = rd_opt_str(c, &v[k]); break;
        case K_BS: {
            uint64_t b;
            int neg;
            if (kv_mp_int(c->p, c->len, &c->pos, &b, &neg) || neg || b == 0 || b > INT64_MAX)
                rc = UNUSUAL;
            else if ((v[k] = PyLong_FromUnsignedLongLong(b)) == NULL) rc = -1;
            break;
        }
        case K_TOKENS: {
            tok_start = c->pos;
            if (rd_array(c, &tok_n)) { rc = UNUSUAL; break; }
            for (Py_ssize_t j = 0; j < tok_n && rc == 0; j++) {
                uint64_t x;
                int neg;
                if (c->pos < c->len && c->p[c->pos] <= 0x7f) c->pos++;   /* fixint */
                else if (kv_mp_int(c->p, c->len, &c->pos, &x, &neg)) rc = UNUSUAL;
            }
            tok_len = c->pos - tok_start;
            break;
        }
        case K_EXTRA: {   /* has_extra_keys stays False: any non-nil entry is unusual */
            Py_ssize_t ne;
            if (is_nil(c)) break;
            if (rd_array(c, &ne)) { rc = UNUSUAL; break; }
            for (Py_ssize_t j = 0; j < ne && rc == 0; j++) if (!is_nil(c)) rc = UNUSUAL;
            break;
        }
        default: rc = UNUSUAL;   /* K_TYPE again */
        }
    }
    if (rc == 0 && kind != 2 && !(seen & (1 << K_HASHES))) rc = UNUSUAL;
    if (rc == 0 && kind == 0 && !((seen & (1 << K_TOKENS)) && (seen & (1 << K_BS))))
        rc = UNUSUAL;
    for (int j = 1; rc == 0 && j < NK; j++)
        if (v[j] == NULL) { Py_INCREF(Py_None); v[j] = Py_None; }
    if (rc == 0 && kind == 0) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)c->p + tok_start, tok_len);
        PyObject *n = PyLong_FromSsize_t(tok_n);
        PyObject *rv[3] = {raw, n, Py_None};
        PyObject *toks = (raw && n) ? kv_make(PyTuple_GET_ITEM(classes, C_RAW),
                                           PyTuple_GET_ITEM(classes, C_RAW_D), rv) : NULL;
        Py_XDECREF(raw);
        Py_XDECREF(n);
        if (toks == NULL) rc = -1;
        else {
            PyObject *sv[8] = {v[K_HASHES], v[K_PARENT], toks, v[K_BS], v[K_MEDIUM], v[K_LORA],
                               Py_False, v[K_GROUP]};
            *out = kv_make(PyTuple_GET_ITEM(classes, C_STORED),
                        PyTuple_GET_ITEM(classes, C_STORED_D), sv);
            Py_DECREF(toks);
            if (*out == NULL) rc = -1;
        }
    } else if (rc == 0 && kind == 1) {
        PyObject *rv[3] = {v[K_HASHES], v[K_MEDIUM], v[K_GROUP]};
        *out = kv_make(PyTuple_GET_ITEM(classes, C_REMOVED), PyTuple_GET_ITEM(classes, C_REMOVED_D),
                    rv);
        if (*out == NULL) rc = -1;
    } else if (rc == 0) {
        PyTypeObject *tp = (PyTypeObject *)PyTuple_GET_ITEM(classes, C_CLEARED);
        *out = tp->tp_alloc(tp, 0);
        if (*out == NULL) rc = -1;
    }
    for (int j = 0; j < NK; j++) Py_XDECREF(v[j]);
    return rc;
}

PyObject *kv_decode_batch(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *seq, *classes;
    if (!PyArg_ParseTuple(args, "y*O!O!", &buf, &PyLong_Type, &seq, &PyTuple_Type, &classes))
        return NULL;
    PyObject *events = NULL, *out = NULL, *ts = NULL, *dp = NULL;
    if (PyTuple_GET_SIZE(classes) != NC) {
        PyErr_SetString(PyExc_ValueError, "decode_batch: classes has the wrong length");
        goto done;
    }
    for (int i = 0; i < NC; i++) {
        PyObject *x = PyTuple_GET_ITEM(classes, i);
        if ((i == C_BATCH || i == C_STORED || i == C_REMOVED || i == C_CLEARED || i == C_RAW)
            ? !PyType_Check(x) : !PyTuple_Check(x)) {
            PyErr_SetString(PyExc_TypeError, "decode_batch: classes are (type, descriptors...)");
            goto done;
        }
    }
    cur c = {buf.buf, buf.len, 0};
    Py_ssize_t n, ne;
    int rc = 0;
    if (rd_array(&c, &n) || n < 2 || n > 3 || c.pos >= c.len) goto unusual;
    unsigned char t = c.p[c.pos];
    uint64_t bits;
    if (t == 0xcb) {
        c.pos++;
        if (rd_be(&c, 8, &bits)) goto unusual;
        double d;
        memcpy(&d, &bits, 8);
        ts = PyFloat_FromDouble(d);
    } else if (t == 0xca) {
        c.pos++;
        if (rd_be(&c, 4, &bits)) goto unusual;
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, 4);
        ts = PyFloat_FromDouble((double)f);
    } else goto unusual;
    if (ts == NULL) goto done;
    if (rd_array(&c, &ne) || ne > c.len - c.pos) goto unusual;
    events = PyList_New(ne);
    if (events == NULL) goto done;
    for (Py_ssize_t i = 0; i < ne; i++) {
        PyObject *e = NULL;
        rc = rd_event(&c, classes, &e);
        if (rc < 0) goto done;
        if (rc) goto unusual;
        PyList_SET_ITEM(events, i, e);
    }
    if (n == 3) {
        rc = rd_opt_int(&c, 0, &dp);
        if (rc < 0) goto done;
        if (rc) goto unusual;
    } else {
        dp = Py_None;
        Py_INCREF(dp);
    }
    if (c.pos != c.len) goto unusual;   /* trailing bytes */
    PyObject *bv[4] = {seq, ts, events, dp};
    out = kv_make(PyTuple_GET_ITEM(classes, C_BATCH), PyTuple_GET_ITEM(classes, C_BATCH_D), bv);
    goto done;
unusual:
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(ts);
    Py_XDECREF(dp);
    Py_XDECREF(events);
    PyBuffer_Release(&buf);
    return out;
}
