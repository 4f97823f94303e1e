/* Canonical typed JSON in C (attrs.canonical_typed_json's text, UTF-8) for the
 * shapes of a decoded item image: what the ordering guard hashes twice per
 * change (ordering.image_hash) and writes as each clock's qualifier, and what a
 * backfill writes as each item's marker (compiled._key_json).
 *
 * Nothing is decided here that the Python reference does not decide: a value
 * of any other shape (B, NS, BS, a str or dict subclass, a malformed value)
 * makes the whole answer None, and the caller hands the value to
 * attrs.canonical_typed_json, which writes it or raises. A string is quoted
 * here when it is printable ASCII without '"' or '\\' (attrs.dump_str's fast
 * case, the same text); any other string by attrs.dump_str itself.
 * tests/unit/transforms/test_ordering_guard_hash.py holds the texts equal.
 *
 * Compiled into the rowwriter_c module (pyproject.toml): one C extension, one
 * optional build, one switch (DDB2BT_ROW_WRITER=python turns both off).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* The first buffer's size: a typical image's text (~10 attributes) fits. */
#define FIRST_BUFFER 512

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap;
    while (cap < b->len + more)
        cap *= 2;
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

static int put_typed(Buf *b, PyObject *value, PyObject *dump_str);

/* A dict of exact-str keys, keys sorted, as {"key":<typed value>,...}: 1, 0 or -1 as above. */
static int put_map_body(Buf *b, PyObject *map, PyObject *dump_str) {
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
        member = PyDict_GetItemWithError(map, key); /* borrowed; the map is not changed meanwhile */
        if (member == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            break;
        }
        Py_INCREF(member); /* a dump_str call below runs Python code */
        rc = i && PUT_LITERAL(b, ",") < 0 ? -1 : put_str(b, key, dump_str);
        if (rc == 1)
            rc = PUT_LITERAL(b, ":") < 0 ? -1 : put_typed(b, member, dump_str);
        Py_DECREF(member);
    }
    if (rc == 1 && PUT_LITERAL(b, "}") < 0)
        rc = -1;
    Py_DECREF(keys);
    return rc;
}

/* One typed AttributeValue ({"S": ...}, {"M": {...}}, ...): 1, 0 or -1 as above. */
static int put_typed(Buf *b, PyObject *value, PyObject *dump_str) {
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
    /* The nested shapes recurse: as deep as Python would let the reference go. */
    if (Py_EnterRecursiveCall(" in canonical typed JSON"))
        return -1;
    rc = 0;
    if (tn == 1 && t[0] == 'M') {
        rc = PUT_LITERAL(b, "{\"M\":") < 0 ? -1 : put_map_body(b, inner, dump_str);
    } else if (tn == 2 && t[0] == 'S' && t[1] == 'S') {
        rc = PUT_LITERAL(b, "{\"SS\":") < 0 ? -1 : put_string_set(b, inner, dump_str);
    } else if (tn == 1 && t[0] == 'L' && PyList_CheckExact(inner)) {
        rc = PUT_LITERAL(b, "{\"L\":[") < 0 ? -1 : 1;
        /* by index, each member held: a dump_str call runs Python code that could change the list */
        for (Py_ssize_t i = 0; rc == 1 && i < PyList_GET_SIZE(inner); i++) {
            PyObject *member = PyList_GET_ITEM(inner, i);
            Py_INCREF(member);
            rc = i && PUT_LITERAL(b, ",") < 0 ? -1 : put_typed(b, member, dump_str);
            Py_DECREF(member);
        }
        if (rc == 1)
            rc = PUT_LITERAL(b, "]") < 0 ? -1 : 1;
    }
    Py_LeaveRecursiveCall();
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
    PyObject *result = NULL;
    int rc = PUT_LITERAL(&b, "{\"M\":") < 0 ? -1 : put_map_body(&b, args[1], args[0]);
    if (rc == 1 && PUT_LITERAL(&b, "}") < 0)
        rc = -1;
    if (rc == 1)
        result = PyBytes_FromStringAndSize(b.data, b.len);
    else if (rc == 0) {
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(b.data);
    return result;
}
