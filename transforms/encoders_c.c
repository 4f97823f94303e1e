/* The ordering guard's encoders in C, each the same bytes as its Python
 * reference for the shapes written here, and None (the reference decides) for
 * any other:
 *
 * - canonical typed JSON (attrs.canonical_typed_json's text, UTF-8) of a decoded
 *   item image: what the guard hashes twice per change (ordering.image_hash)
 *   and writes as each clock's qualifier;
 * - mutations on the wire (transforms.wire.encode_mutations): every row the
 *   guard swaps, as its CheckAndMutateRowRequest's mutations.
 *
 * Nothing is decided here that the Python does not decide. For the JSON: a
 * value of any other shape (B, NS, BS, a str or dict subclass, a malformed
 * value) makes the whole answer None, and the caller hands the value to
 * attrs.canonical_typed_json, which writes it or raises. A string is quoted
 * here when it is printable ASCII without '"' or '\\' (attrs.dump_str's fast
 * case, the same text); any other string by attrs.dump_str itself; maps and
 * lists nested past MAX_NESTING levels go to the reference too. For the
 * mutations: anything but a SetCell or DeleteCells of exact str, bytes and
 * ints (in int64 range once in microseconds) gives None.
 * tests/unit/transforms/test_ordering_guard_hash.py and
 * tests/unit/sink/test_sink_requests.py hold the bytes equal.
 *
 * Compiled into the rowwriter_c module (pyproject.toml): one C extension, one
 * optional build, one switch (DDB2BT_ROW_WRITER=python turns it all off).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The first buffer's size: a typical image's text (~10 attributes) fits. */
#define FIRST_BUFFER 512
/* Maps and lists nested deeper than this are left to the Python reference:
 * DynamoDB allows 32 levels, so no item of a table gets near it, and the C
 * stack never grows past a fixed bound (whatever Python's recursion limit). */
#define MAX_NESTING 64

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap;
    while (cap < b->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const char *s, Py_ssize_t n) {
    if (reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LITERAL(b, s) put((b), (s), (Py_ssize_t)(sizeof(s) - 1))

/* attrs.dump_str(s), UTF-8: quoted here when printable ASCII without '"' or
 * '\\' (what dump_str returns for it), else dump_str's own text. 1 written;
 * 0 when the text is not UTF-8 (a lone surrogate): the reference then decides,
 * which finds a bad value elsewhere in the image first where there is one, as
 * it writes the whole text before encoding it; -1 an error. */
static int put_str(Buf *b, PyObject *s, PyObject *dump_str) {
    if (PyUnicode_IS_ASCII(s)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(s);
        const Py_UCS1 *c = PyUnicode_1BYTE_DATA(s);
        Py_ssize_t i = 0;
        while (i < n && c[i] >= 0x20 && c[i] <= 0x7e && c[i] != '"' && c[i] != '\\')
            i++;
        if (i == n) {
            if (reserve(b, n + 2) < 0)
                return -1;
            b->data[b->len++] = '"';
            memcpy(b->data + b->len, c, (size_t)n);
            b->len += n;
            b->data[b->len++] = '"';
            return 1;
        }
    }
    PyObject *text = PyObject_CallOneArg(dump_str, s);
    if (text == NULL)
        return -1;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
    int rc;
    if (utf8 != NULL)
        rc = put(b, utf8, n) < 0 ? -1 : 1;
    else if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();
        rc = 0;
    } else
        rc = -1;
    Py_DECREF(text);
    return rc;
}

/* A list of exact strs, sorted, as a JSON array: 1 written, 0 not this shape, -1 error. */
static int put_string_set(Buf *b, PyObject *members, PyObject *dump_str) {
    if (!PyList_CheckExact(members))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(members);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(members, i)))
            return 0;
    PyObject *sorted = PyList_GetSlice(members, 0, n);
    if (sorted == NULL)
        return -1;
    int rc = PyList_Sort(sorted) < 0 || PUT_LITERAL(b, "[") < 0 ? -1 : 1;
    for (Py_ssize_t i = 0; rc == 1 && i < PyList_GET_SIZE(sorted); i++)
        rc = i && PUT_LITERAL(b, ",") < 0 ? -1 : put_str(b, PyList_GET_ITEM(sorted, i), dump_str);
    if (rc == 1 && PUT_LITERAL(b, "]") < 0)
        rc = -1;
    Py_DECREF(sorted);
    return rc;
}

/* The answer of a walk that ended with ``rc`` (1 written, 0 not this shape,
 * -1 error set): the bytes, None, or NULL; the buffer freed either way. */
static PyObject *finish(Buf *b, int rc) {
    PyObject *result = NULL;
    if (rc == 1)
        result = PyBytes_FromStringAndSize(b->data, b->len);
    else if (rc == 0) {
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(b->data);
    return result;
}

static int put_typed(Buf *b, PyObject *value, PyObject *dump_str, int depth);

/* A dict of exact-str keys, keys sorted, as {"key":<typed value>,...}: 1, 0 or
 * -1 as above. The caller holds ``map`` (dump_str runs Python code, which
 * could drop the last other reference to it). */
static int put_map_body(Buf *b, PyObject *map, PyObject *dump_str, int depth) {
    if (!PyDict_CheckExact(map))
        return 0;
    Py_ssize_t pos = 0;
    PyObject *key, *member;
    while (PyDict_Next(map, &pos, &key, &member))
        if (!PyUnicode_CheckExact(key))
            return 0;
    PyObject *keys = PyDict_Keys(map);
    if (keys == NULL)
        return -1;
    int rc = PyList_Sort(keys) < 0 || PUT_LITERAL(b, "{") < 0 ? -1 : 1;
    for (Py_ssize_t i = 0; rc == 1 && i < PyList_GET_SIZE(keys); i++) {
        key = PyList_GET_ITEM(keys, i);
        member = PyDict_GetItemWithError(map, key); /* borrowed, then held across the Python calls below */
        if (member == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            break;
        }
        Py_INCREF(member); /* a dump_str call below runs Python code */
        rc = i && PUT_LITERAL(b, ",") < 0 ? -1 : put_str(b, key, dump_str);
        if (rc == 1)
            rc = PUT_LITERAL(b, ":") < 0 ? -1 : put_typed(b, member, dump_str, depth);
        Py_DECREF(member);
    }
    if (rc == 1 && PUT_LITERAL(b, "}") < 0)
        rc = -1;
    Py_DECREF(keys);
    return rc;
}

/* One typed AttributeValue ({"S": ...}, {"M": {...}}, ...): 1, 0 or -1 as above. */
static int put_typed(Buf *b, PyObject *value, PyObject *dump_str, int depth) {
    if (!PyDict_CheckExact(value) || PyDict_GET_SIZE(value) != 1)
        return 0;
    Py_ssize_t pos = 0;
    PyObject *tag, *inner;
    PyDict_Next(value, &pos, &tag, &inner);
    if (!PyUnicode_CheckExact(tag) || !PyUnicode_IS_ASCII(tag))
        return 0;
    const char *t = (const char *)PyUnicode_1BYTE_DATA(tag);
    Py_ssize_t tn = PyUnicode_GET_LENGTH(tag);
    int rc;
    if (tn == 1 && (t[0] == 'S' || t[0] == 'N')) {
        if (!PyUnicode_CheckExact(inner))
            return 0;
        rc = put(b, t[0] == 'S' ? "{\"S\":" : "{\"N\":", 5) < 0 ? -1 : put_str(b, inner, dump_str);
        return rc == 1 && PUT_LITERAL(b, "}") < 0 ? -1 : rc;
    }
    if (tn == 4 && memcmp(t, "BOOL", 4) == 0) {
        if (!PyBool_Check(inner))
            return 0;
        return (inner == Py_True ? PUT_LITERAL(b, "{\"BOOL\":true}") : PUT_LITERAL(b, "{\"BOOL\":false}")) < 0 ? -1 : 1;
    }
    if (tn == 4 && memcmp(t, "NULL", 4) == 0) {
        if (inner != Py_True)
            return 0;
        return PUT_LITERAL(b, "{\"NULL\":true}") < 0 ? -1 : 1;
    }
    /* The nested shapes recurse, to MAX_NESTING levels. ``inner`` is held: a
     * dump_str call below runs Python code, which could drop ``value``'s
     * reference to it. */
    if (depth >= MAX_NESTING)
        return 0;
    Py_INCREF(inner);
    rc = 0;
    if (tn == 1 && t[0] == 'M') {
        rc = PUT_LITERAL(b, "{\"M\":") < 0 ? -1 : put_map_body(b, inner, dump_str, depth + 1);
    } else if (tn == 2 && t[0] == 'S' && t[1] == 'S') {
        rc = PUT_LITERAL(b, "{\"SS\":") < 0 ? -1 : put_string_set(b, inner, dump_str);
    } else if (tn == 1 && t[0] == 'L' && PyList_CheckExact(inner)) {
        rc = PUT_LITERAL(b, "{\"L\":[") < 0 ? -1 : 1;
        /* by index, each member held: a dump_str call runs Python code that could change the list */
        for (Py_ssize_t i = 0; rc == 1 && i < PyList_GET_SIZE(inner); i++) {
            PyObject *member = PyList_GET_ITEM(inner, i);
            Py_INCREF(member);
            rc = i && PUT_LITERAL(b, ",") < 0 ? -1 : put_typed(b, member, dump_str, depth + 1);
            Py_DECREF(member);
        }
        if (rc == 1)
            rc = PUT_LITERAL(b, "]") < 0 ? -1 : 1;
    }
    Py_DECREF(inner);
    if (rc == 1 && PUT_LITERAL(b, "}") < 0)
        rc = -1;
    return rc;
}

/* typed_map_json(dump_str, image) -> bytes | None: canonical_typed_json({"M": image})
 * encoded as UTF-8, or None where the image is not of the shapes written here
 * (registered by rowwriter_c.c's module). */
PyObject *typed_map_json(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "typed_map_json(dump_str, image) takes 2 arguments");
        return NULL;
    }
    Buf b = {PyMem_Malloc(FIRST_BUFFER), 0, FIRST_BUFFER};
    if (b.data == NULL)
        return PyErr_NoMemory();
    int rc = PUT_LITERAL(&b, "{\"M\":") < 0 ? -1 : put_map_body(&b, args[1], args[0], 0);
    if (rc == 1 && PUT_LITERAL(&b, "}") < 0)
        rc = -1;
    return finish(&b, rc);
}

/* --- mutations on the wire (transforms.wire.encode_mutations) ------------------- */

/* protobuf tags (transforms/wire.py) */
#define MUT_SET_CELL 0x0a
#define MUT_DELETE_FROM_COLUMN 0x12
#define CELL_FAMILY 0x0a
#define CELL_QUALIFIER 0x12
#define SET_TIMESTAMP 0x18
#define SET_VALUE 0x22
#define DELETE_TIME_RANGE 0x1a
#define RANGE_START 0x08
#define RANGE_END 0x10
#define US_PER_MS 1000
#define MAX_VARINT 10

static Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v > 0x7f) {
        v >>= 7;
        n++;
    }
    return n;
}

static void put_varint_raw(Buf *b, uint64_t v) {
    while (v > 0x7f) {
        b->data[b->len++] = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    b->data[b->len++] = (char)v;
}

/* A model timestamp (ms, an exact int) as int64 microseconds: 1, or 0 when it is
 * not one (another type, out of range: the Python encoder decides and raises). */
static int micros_of(PyObject *ms, int64_t *out) {
    if (!PyLong_CheckExact(ms))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(ms, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (v > INT64_MAX / US_PER_MS || v < INT64_MIN / US_PER_MS)
        return 0;
    *out = (int64_t)v * US_PER_MS;
    return 1;
}

/* One mutation: 1 written, 0 not of the shapes written here, -1 error. */
static int put_mutation(Buf *b, PyObject *m, int set, char field) {
    if (PyTuple_GET_SIZE(m) != 4)
        return 0;
    PyObject *family = PyTuple_GET_ITEM(m, 0), *qualifier = PyTuple_GET_ITEM(m, 1);
    if (!PyUnicode_CheckExact(family) || !PyBytes_CheckExact(qualifier))
        return 0;
    Py_ssize_t flen;
    const char *fam = PyUnicode_AsUTF8AndSize(family, &flen);
    if (fam == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear(); /* a lone surrogate: family.encode() raises it, in the Python encoder */
        return 0;
    }
    Py_ssize_t qlen = PyBytes_GET_SIZE(qualifier);
    Py_ssize_t column = (flen ? 1 + varint_size((uint64_t)flen) + flen : 0)
                        + (qlen ? 1 + varint_size((uint64_t)qlen) + qlen : 0);
    Py_ssize_t body;
    int64_t a = 0, z = 0;
    PyObject *value = NULL;
    Py_ssize_t vlen = 0, range = 0;
    if (set) {
        value = PyTuple_GET_ITEM(m, 2);
        if (!PyBytes_CheckExact(value) || !micros_of(PyTuple_GET_ITEM(m, 3), &a))
            return 0;
        vlen = PyBytes_GET_SIZE(value);
        body = column + (a ? 1 + varint_size((uint64_t)a) : 0) + (vlen ? 1 + varint_size((uint64_t)vlen) + vlen : 0);
    } else {
        if (!micros_of(PyTuple_GET_ITEM(m, 2), &a) || !micros_of(PyTuple_GET_ITEM(m, 3), &z))
            return 0;
        range = (a ? 1 + varint_size((uint64_t)a) : 0) + (z ? 1 + varint_size((uint64_t)z) : 0);
        body = column + 1 + varint_size((uint64_t)range) + range; /* the time range, present even if empty */
    }
    Py_ssize_t inner = 1 + varint_size((uint64_t)body) + body;
    if (reserve(b, 1 + varint_size((uint64_t)inner) + inner) < 0)
        return -1;
    b->data[b->len++] = field;
    put_varint_raw(b, (uint64_t)inner);
    b->data[b->len++] = set ? MUT_SET_CELL : MUT_DELETE_FROM_COLUMN;
    put_varint_raw(b, (uint64_t)body);
    if (flen) {
        b->data[b->len++] = CELL_FAMILY;
        put_varint_raw(b, (uint64_t)flen);
        memcpy(b->data + b->len, fam, (size_t)flen);
        b->len += flen;
    }
    if (qlen) {
        b->data[b->len++] = CELL_QUALIFIER;
        put_varint_raw(b, (uint64_t)qlen);
        memcpy(b->data + b->len, PyBytes_AS_STRING(qualifier), (size_t)qlen);
        b->len += qlen;
    }
    if (set) {
        if (a) {
            b->data[b->len++] = SET_TIMESTAMP;
            put_varint_raw(b, (uint64_t)a); /* a negative int64 as its two's complement, as protobuf writes it */
        }
        if (vlen) {
            b->data[b->len++] = SET_VALUE;
            put_varint_raw(b, (uint64_t)vlen);
            memcpy(b->data + b->len, PyBytes_AS_STRING(value), (size_t)vlen);
            b->len += vlen;
        }
    } else {
        b->data[b->len++] = DELETE_TIME_RANGE;
        put_varint_raw(b, (uint64_t)range);
        if (a) {
            b->data[b->len++] = RANGE_START;
            put_varint_raw(b, (uint64_t)a);
        }
        if (z) {
            b->data[b->len++] = RANGE_END;
            put_varint_raw(b, (uint64_t)z);
        }
    }
    return 1;
}

/* encode_mutations(set_cell_type, delete_cells_type, mutations, field) -> bytes | None:
 * transforms.wire.encode_mutations(mutations, field)'s bytes, or None where a
 * mutation is not exactly a SetCell or DeleteCells of exact str, bytes and ints
 * in int64 range once in microseconds (the Python encoder then decides, and
 * raises where it must). Registered by rowwriter_c.c's module. */
PyObject *encode_mutations(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "encode_mutations(set_cell_type, delete_cells_type, mutations, field) "
                                         "takes 4 arguments");
        return NULL;
    }
    for (int i = 0; i < 2; i++)
        if (!PyType_Check(args[i]) || !PyType_IsSubtype((PyTypeObject *)args[i], &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "encode_mutations: the mutation types must be tuple types");
            return NULL;
        }
    /* Only a list or a tuple, and a one-byte tag: anything else is left to the
     * Python encoder untouched (an iterator read here would reach it empty). */
    PyObject *seq = args[2];
    if ((!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) || !PyBytes_CheckExact(args[3])
        || PyBytes_GET_SIZE(args[3]) != 1)
        Py_RETURN_NONE;
    Py_INCREF(seq);
    char field = PyBytes_AS_STRING(args[3])[0];
    Buf b = {PyMem_Malloc(FIRST_BUFFER), 0, FIRST_BUFFER};
    int rc = b.data == NULL ? -1 : 1;
    if (rc < 0)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; rc == 1 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (Py_IS_TYPE(m, (PyTypeObject *)args[0]))
            rc = put_mutation(&b, m, 1, field);
        else if (Py_IS_TYPE(m, (PyTypeObject *)args[1]))
            rc = put_mutation(&b, m, 0, field);
        else
            rc = 0;
    }
    Py_DECREF(seq);
    return finish(&b, rc);
}
