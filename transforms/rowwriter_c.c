/* The compiled mapping's plain row in C: the same bytes as the row writer
 * transforms/rowwriter.py generates in Python for one shape of image, written
 * without a Python object per cell.
 *
 * A plain image (compiled._CompiledRule.plain_order) is one row whose every
 * attribute is a plain column: one SetCell each and, when the change prunes,
 * one DeleteFromColumn before the change's time. What the generated Python
 * spends per attribute — the value's lookup, its type tests, its encoding, the
 * lengths, nine list pieces — is done here in one pass; the row's mutations
 * come back as ONE bytes object (transforms.wire's format: the pieces the
 * Python writer returns, joined, which is all its callers do with them).
 *
 * Nothing here decides anything the Python writer does not: an attribute's
 * usual cases (its encoder's, inline in rowwriter._encode) are encoded here,
 * every other value goes to the encoder itself, which decides and raises as it
 * always does; a missing attribute raises KeyError as the Python does; both
 * make CompiledMapping.__call__ hand the change to the general engine.
 * tests/unit/transforms/test_row_writer.py compares this writer's bytes with
 * the generated one's and with the general engine's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* How a column's value is encoded: rowwriter.INLINE_* (the kind codes are
 * given by rowwriter.py: _NATIVE_KINDS). */
enum { KIND_CALL = 0, KIND_S = 1, KIND_AUTO = 2, KIND_INT64 = 3 };

/* protobuf wire tags (transforms/wire.py) */
#define ENTRY_MUTATION 0x12
#define MUT_SET_CELL 0x0a
#define MUT_DELETE_FROM_COLUMN 0x12
#define SET_VALUE 0x22
/* int64's inline case: at most this many ASCII digits (rowwriter.SAFE_INT64_DIGITS) */
#define SAFE_INT64_DIGITS 18
/* columns whose values are kept on the stack while a row is measured */
#define STACK_COLUMNS 64

typedef struct {
    PyObject *name;     /* the attribute (str) */
    int kind;           /* KIND_* */
    PyObject *encode;   /* the attribute's encoder: every value not encoded inline */
    PyObject *fields;   /* the column's family and qualifier fields (bytes) */
} Column;

typedef struct {
    PyObject_HEAD
    Py_ssize_t ncolumns;
    Column *columns;
    int prune;              /* each SetCell followed by its column's delete */
    PyObject *count;        /* the row's mutation count (int) */
    Py_ssize_t fixed;       /* the row's size before its values' lengths */
    PyObject *families;     /* tuple: the row's families, in order */
    PyObject *dump_str;     /* attrs.dump_str: a set member's JSON text, where it is not plain ASCII */
    PyObject *true_byte;    /* encoding.TRUE_BYTE */
    PyObject *false_byte;   /* encoding.FALSE_BYTE */
} RowWriter;

static PyObject *TAG_S, *TAG_N, *TAG_BOOL, *TAG_SS;

static inline Py_ssize_t varint_len(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline char *put_varint(char *out, uint64_t v) {
    while (v >= 0x80) {
        *out++ = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    *out++ = (char)v;
    return out;
}

/* SetCell's body: the column's fields, the timestamp field and the value field
 * (proto3: none for an empty value), ``vlen`` bytes of value. */
static inline Py_ssize_t set_cell_body(Py_ssize_t flen, Py_ssize_t ts_len, Py_ssize_t vlen) {
    return flen + ts_len + (vlen ? 1 + varint_len((uint64_t)vlen) + vlen : 0);
}

/* The bytes of one Entry.mutations field around a mutation body of ``body`` bytes. */
static inline Py_ssize_t mutation_len(Py_ssize_t body) {
    Py_ssize_t inner = 1 + varint_len((uint64_t)body) + body;
    return 1 + varint_len((uint64_t)inner) + inner;
}

/* An Entry.mutations field's head — its tag and length, the mutation's kind and
 * its body's length — and the body's first part, the column's fields, as
 * transforms.wire.mutation_field writes them. */
static inline char *put_mutation_head(char *out, char kind, Py_ssize_t body, PyObject *fields) {
    Py_ssize_t flen = PyBytes_GET_SIZE(fields);
    *out++ = (char)ENTRY_MUTATION;
    out = put_varint(out, (uint64_t)(1 + varint_len((uint64_t)body) + body));
    *out++ = kind;
    out = put_varint(out, (uint64_t)body);
    memcpy(out, PyBytes_AS_STRING(fields), (size_t)flen);
    return out + flen;
}

/* A str of ASCII digits only, 1..max_digits of them (str.isdigit() and
 * str.isascii(), with a length bound). */
static int ascii_digits(PyObject *t, Py_ssize_t max_digits) {
    if (!PyUnicode_CheckExact(t) || !PyUnicode_IS_ASCII(t))
        return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(t);
    if (n == 0 || n > max_digits)
        return 0;
    const Py_UCS1 *s = PyUnicode_1BYTE_DATA(t);
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* auto's number as text: t.isascii() and t.replace('.', '', 1).isdigit() —
 * ASCII digits with at most one '.', and at least one digit. */
static int plain_number(PyObject *t) {
    if (!PyUnicode_CheckExact(t) || !PyUnicode_IS_ASCII(t))
        return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(t), digits = 0;
    const Py_UCS1 *s = PyUnicode_1BYTE_DATA(t);
    int dot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] == '.' && !dot)
            dot = 1;
        else if (s[i] >= '0' && s[i] <= '9')
            digits++;
        else
            return 0;
    }
    return digits > 0;
}

static PyObject *pack_int64(PyObject *t) {
    /* ascii_digits(t, SAFE_INT64_DIGITS): below 10**18 < 2**63, non-negative */
    Py_ssize_t n = PyUnicode_GET_LENGTH(t);
    const Py_UCS1 *s = PyUnicode_1BYTE_DATA(t);
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        v = v * 10 + (uint64_t)(s[i] - '0');
    char out[8];
    for (int i = 7; i >= 0; i--) {
        out[i] = (char)(v & 0xff);
        v >>= 8;
    }
    return PyBytes_FromStringAndSize(out, 8);
}

/* The single value of a one-entry {tag: value} dict under ``tag``, borrowed, or NULL. */
static inline PyObject *tagged(PyObject *v, PyObject *tag) {
    return PyDict_GetItemWithError(v, tag);
}

/* A member dump_str quotes as it is: printable ASCII (0x20-0x7e) without '"' or '\\'. */
static int plain_member(PyObject *m) {
    if (!PyUnicode_IS_ASCII(m))
        return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(m);
    const Py_UCS1 *s = PyUnicode_1BYTE_DATA(m);
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7e || s[i] == '"' || s[i] == '\\')
            return 0;
    return 1;
}

/* auto's string set, rowwriter._string_set's bytes: canonical JSON, the members
 * sorted, each as attrs.dump_str writes it (plain ASCII ones quoted here, the
 * rest by dump_str itself), UTF-8; None (a new reference) unless every member
 * is a str, so the encoder decides. */
static PyObject *string_set(RowWriter *self, PyObject *members) {
    Py_ssize_t n = PyList_GET_SIZE(members);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(members, i)))
            Py_RETURN_NONE;
    PyObject *sorted = PyList_GetSlice(members, 0, n);
    if (sorted == NULL)
        return NULL;
    PyObject *result = NULL;
    PyObject **texts = n ? PyMem_Calloc((size_t)n, sizeof(PyObject *)) : NULL; /* dump_str's, where called */
    if (n && texts == NULL) {
        Py_DECREF(sorted);
        return PyErr_NoMemory();
    }
    if (PyList_Sort(sorted) < 0)
        goto done;
    n = PyList_GET_SIZE(sorted); /* a comparison cannot change it, but the list is the sorted one's */
    Py_ssize_t total = 2 + (n > 1 ? n - 1 : 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(sorted, i);
        if (plain_member(m)) {
            total += PyUnicode_GET_LENGTH(m) + 2;
            continue;
        }
        PyObject *text = PyObject_CallOneArg(self->dump_str, m);
        if (text == NULL)
            goto done;
        texts[i] = PyUnicode_AsUTF8String(text); /* a lone surrogate raises, as str.encode does */
        Py_DECREF(text);
        if (texts[i] == NULL)
            goto done;
        total += PyBytes_GET_SIZE(texts[i]);
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(result);
    *out++ = '[';
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i)
            *out++ = ',';
        if (texts[i] != NULL) {
            memcpy(out, PyBytes_AS_STRING(texts[i]), (size_t)PyBytes_GET_SIZE(texts[i]));
            out += PyBytes_GET_SIZE(texts[i]);
        } else {
            PyObject *m = PyList_GET_ITEM(sorted, i);
            Py_ssize_t len = PyUnicode_GET_LENGTH(m);
            *out++ = '"';
            memcpy(out, PyUnicode_1BYTE_DATA(m), (size_t)len);
            out += len;
            *out++ = '"';
        }
    }
    *out++ = ']';
    assert(out == PyBytes_AS_STRING(result) + total);
done:
    for (Py_ssize_t i = 0; texts != NULL && i < n; i++)
        Py_XDECREF(texts[i]);
    PyMem_Free(texts);
    Py_DECREF(sorted);
    return result;
}

/* The encoding of ``v`` (a new reference), as rowwriter._encode writes it. */
static PyObject *encode_value(RowWriter *self, Column *c, PyObject *v) {
    if (c->kind != KIND_CALL && PyDict_CheckExact(v) && PyDict_GET_SIZE(v) == 1) {
        PyObject *t;
        if (c->kind == KIND_S) {
            t = tagged(v, TAG_S);
            if (t != NULL && PyUnicode_CheckExact(t))
                return PyUnicode_AsUTF8String(t);
        } else if (c->kind == KIND_INT64) {
            t = tagged(v, TAG_N);
            if (t != NULL && ascii_digits(t, SAFE_INT64_DIGITS))
                return pack_int64(t);
        } else { /* KIND_AUTO: a one-entry dict has one tag, so the order of the tests is only speed */
            if ((t = tagged(v, TAG_S)) != NULL) {
                if (PyUnicode_CheckExact(t))
                    return PyUnicode_AsUTF8String(t);
            } else if (PyErr_Occurred()) {
                return NULL;
            } else if ((t = tagged(v, TAG_N)) != NULL) {
                if (plain_number(t))
                    return PyUnicode_AsASCIIString(t);
            } else if (PyErr_Occurred()) {
                return NULL;
            } else if ((t = tagged(v, TAG_BOOL)) != NULL) {
                if (PyBool_Check(t)) {
                    PyObject *b = t == Py_True ? self->true_byte : self->false_byte;
                    Py_INCREF(b);
                    return b;
                }
            } else if (PyErr_Occurred()) {
                return NULL;
            } else if ((t = tagged(v, TAG_SS)) != NULL) {
                if (PyList_CheckExact(t)) {
                    PyObject *s = string_set(self, t);
                    if (s != Py_None)
                        return s; /* the text, or NULL: its error */
                    Py_DECREF(s);
                }
            }
        }
        if (PyErr_Occurred())
            return NULL;
    }
    /* the encoder may run anything: ``v`` (borrowed from the image) is held for the call */
    Py_INCREF(v);
    PyObject *p = PyObject_CallOneArg(c->encode, v);
    Py_DECREF(v);
    return p;
}

static void release(PyObject **values, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(values[i]);
}

/* write(image, row_len, ts_field, prune_range) -> [count, size, [wire bytes], families] */
static PyObject *RowWriter_call(RowWriter *self, PyObject *args, PyObject *kwargs) {
    PyObject *image, *ts_field, *prune_range;
    Py_ssize_t row_len;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "write() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OnO!O:write", &image, &row_len, &PyBytes_Type, &ts_field, &prune_range))
        return NULL;
    if (!PyDict_CheckExact(image)) { /* a subclass's __getitem__ would be bypassed: the Python writer's then */
        PyErr_SetString(PyExc_TypeError, "write(): the image must be a dict");
        return NULL;
    }
    Py_ssize_t ts_len = PyBytes_GET_SIZE(ts_field);
    Py_ssize_t range_len = 0;
    if (self->prune) {
        if (!PyBytes_Check(prune_range)) {
            PyErr_SetString(PyExc_TypeError, "write(): a pruning writer needs the prune range's bytes");
            return NULL;
        }
        range_len = PyBytes_GET_SIZE(prune_range);
    }
    Py_ssize_t n = self->ncolumns;
    PyObject *stack[STACK_COLUMNS];
    PyObject **values = n <= STACK_COLUMNS ? stack : PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (values == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL, *wire = NULL;
    Py_ssize_t done = 0, total = 0, wire_len = 0;
    /* first pass: every value encoded, the row's length summed */
    for (; done < n; done++) {
        Column *c = &self->columns[done];
        PyObject *v = PyDict_GetItemWithError(image, c->name);
        if (v == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, c->name);
            goto fail;
        }
        PyObject *p = encode_value(self, c, v);
        if (p == NULL)
            goto fail;
        values[done] = p;
        if (!PyBytes_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "write(): an encoder returned something other than bytes");
            done++;
            goto fail;
        }
        Py_ssize_t vlen = PyBytes_GET_SIZE(p);
        Py_ssize_t flen = PyBytes_GET_SIZE(c->fields);
        wire_len += mutation_len(set_cell_body(flen, ts_len, vlen));
        if (self->prune)
            wire_len += mutation_len(flen + range_len);
        total += vlen;
    }
    /* second pass: the bytes, as transforms.wire.set_cell and delete_cells write them */
    wire = PyBytes_FromStringAndSize(NULL, wire_len);
    if (wire == NULL)
        goto fail;
    char *out = PyBytes_AS_STRING(wire);
    const char *ts = PyBytes_AS_STRING(ts_field);
    const char *range = self->prune ? PyBytes_AS_STRING(prune_range) : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Column *c = &self->columns[i];
        PyObject *p = values[i];
        Py_ssize_t vlen = PyBytes_GET_SIZE(p);
        Py_ssize_t flen = PyBytes_GET_SIZE(c->fields);
        out = put_mutation_head(out, (char)MUT_SET_CELL, set_cell_body(flen, ts_len, vlen), c->fields);
        memcpy(out, ts, (size_t)ts_len);
        out += ts_len;
        if (vlen) { /* proto3: an empty value is not written */
            *out++ = (char)SET_VALUE;
            out = put_varint(out, (uint64_t)vlen);
            memcpy(out, PyBytes_AS_STRING(p), (size_t)vlen);
            out += vlen;
        }
        if (self->prune) {
            out = put_mutation_head(out, (char)MUT_DELETE_FROM_COLUMN, flen + range_len, c->fields);
            memcpy(out, range, (size_t)range_len);
            out += range_len;
        }
    }
    assert(out == PyBytes_AS_STRING(wire) + wire_len);
    {
        PyObject *size = PyLong_FromSsize_t(row_len + self->fixed + total);
        PyObject *pieces = PyList_New(1);
        PyObject *families = PySequence_List(self->families);
        result = PyList_New(4);
        if (size == NULL || pieces == NULL || families == NULL || result == NULL) {
            Py_XDECREF(size);
            Py_XDECREF(pieces);
            Py_XDECREF(families);
            Py_CLEAR(result);
            goto fail;
        }
        PyList_SET_ITEM(pieces, 0, wire); /* steals it */
        wire = NULL;
        Py_INCREF(self->count);
        PyList_SET_ITEM(result, 0, self->count);
        PyList_SET_ITEM(result, 1, size);
        PyList_SET_ITEM(result, 2, pieces);
        PyList_SET_ITEM(result, 3, families);
    }
fail:
    Py_XDECREF(wire);
    release(values, done);
    if (values != stack)
        PyMem_Free(values);
    return result;
}

static void RowWriter_dealloc(RowWriter *self) {
    PyObject_GC_UnTrack(self);
    if (self->columns != NULL) {
        for (Py_ssize_t i = 0; i < self->ncolumns; i++) {
            Py_XDECREF(self->columns[i].name);
            Py_XDECREF(self->columns[i].encode);
            Py_XDECREF(self->columns[i].fields);
        }
        PyMem_Free(self->columns);
    }
    Py_XDECREF(self->count);
    Py_XDECREF(self->families);
    Py_XDECREF(self->dump_str);
    Py_XDECREF(self->true_byte);
    Py_XDECREF(self->false_byte);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int RowWriter_traverse(RowWriter *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; self->columns != NULL && i < self->ncolumns; i++) {
        Py_VISIT(self->columns[i].encode);
    }
    Py_VISIT(self->families);
    Py_VISIT(self->dump_str);
    return 0;
}

/* The references a cycle could run through (the callables), dropped when the
 * collector breaks one; a writer so cleared is never called again. */
static int RowWriter_clear(RowWriter *self) {
    for (Py_ssize_t i = 0; self->columns != NULL && i < self->ncolumns; i++) {
        Py_CLEAR(self->columns[i].encode);
    }
    Py_CLEAR(self->dump_str);
    return 0;
}

/* RowWriter(columns, prune, count, fixed, families, dump_str, true_byte, false_byte)
 * columns: ((attribute, kind, encoder, fields), ...) in the row's order. */
static PyObject *RowWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *columns, *count, *families, *dump_str, *true_byte, *false_byte;
    int prune;
    Py_ssize_t fixed;
    static char *names[] = {"columns", "prune", "count", "fixed", "families", "dump_str", "true_byte",
                            "false_byte", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!pO!nO!OO!O!:RowWriter", names, &PyTuple_Type, &columns,
                                     &prune, &PyLong_Type, &count, &fixed, &PyTuple_Type, &families, &dump_str,
                                     &PyBytes_Type, &true_byte, &PyBytes_Type, &false_byte))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(columns);
    RowWriter *self = (RowWriter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->columns = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Column));
    if (self->columns == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->ncolumns = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *spec = PyTuple_GET_ITEM(columns, i);
        PyObject *name, *encode, *fields;
        int kind;
        if (!PyArg_ParseTuple(spec, "O!iOO!:RowWriter column", &PyUnicode_Type, &name, &kind, &encode,
                              &PyBytes_Type, &fields)) {
            Py_DECREF(self);
            return NULL;
        }
        if (kind < KIND_CALL || kind > KIND_INT64 || !PyCallable_Check(encode)) {
            PyErr_Format(PyExc_ValueError, "RowWriter column %zd: unknown kind %d or an encoder not callable",
                         i, kind);
            Py_DECREF(self);
            return NULL;
        }
        Py_INCREF(name);
        Py_INCREF(encode);
        Py_INCREF(fields);
        self->columns[i] = (Column){name, kind, encode, fields};
    }
    self->prune = prune;
    Py_INCREF(count);
    self->count = count;
    self->fixed = fixed;
    Py_INCREF(families);
    self->families = families;
    if (!PyCallable_Check(dump_str)) {
        PyErr_SetString(PyExc_TypeError, "RowWriter: dump_str must be callable");
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(dump_str);
    self->dump_str = dump_str;
    Py_INCREF(true_byte);
    self->true_byte = true_byte;
    Py_INCREF(false_byte);
    self->false_byte = false_byte;
    return (PyObject *)self;
}

static PyTypeObject RowWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddb2bt.transforms.rowwriter_c.RowWriter",
    .tp_doc = "write(image, row_len, ts_field, prune_range) -> [count, size, [wire bytes], families]: "
              "one plain row's mutations (transforms/rowwriter.py).",
    .tp_basicsize = sizeof(RowWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = RowWriter_new,
    .tp_dealloc = (destructor)RowWriter_dealloc,
    .tp_traverse = (traverseproc)RowWriter_traverse,
    .tp_clear = (inquiry)RowWriter_clear,
    .tp_call = (ternaryfunc)RowWriter_call,
};

/* encoders_c.c, compiled into this module (pyproject.toml) */
PyObject *typed_map_json(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *encode_mutations(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* decoders_c.c */
PyObject *mutate_rows_statuses(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef functions[] = {
    {"typed_map_json", (PyCFunction)(void (*)(void))typed_map_json, METH_FASTCALL,
     "typed_map_json(dump_str, image) -> bytes | None: attrs.canonical_typed_json({'M': image}) in UTF-8, or None "
     "for an image of other shapes (the reference then decides; transforms/encoders_c.c)."},
    {"encode_mutations", (PyCFunction)(void (*)(void))encode_mutations, METH_FASTCALL,
     "encode_mutations(set_cell_type, delete_cells_type, mutations, field) -> bytes | None: "
     "transforms.wire.encode_mutations(mutations, field), or None where a mutation is not of the shapes written "
     "in C (transforms/encoders_c.c)."},
    {"mutate_rows_statuses", (PyCFunction)(void (*)(void))mutate_rows_statuses, METH_FASTCALL,
     "mutate_rows_statuses(data, statuses, ok, failed) -> int | None: each entry of the serialized "
     "MutateRowsResponse ``data`` set in ``statuses`` (``ok``, or ``failed(code, message)``); None where the "
     "protobuf library must read the bytes (transforms/decoders_c.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rowwriter_c",
    "The mapping's C: the plain row writer (transforms/rowwriter.py), "
    "the ordering guard's encoders (transforms/encoders_c.c) and MutateRows' statuses (transforms/decoders_c.c).", -1, functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_rowwriter_c(void) {
    if (PyType_Ready(&RowWriterType) < 0)
        return NULL;
    TAG_S = PyUnicode_InternFromString("S");
    TAG_N = PyUnicode_InternFromString("N");
    TAG_BOOL = PyUnicode_InternFromString("BOOL");
    TAG_SS = PyUnicode_InternFromString("SS");
    if (!TAG_S || !TAG_N || !TAG_BOOL || !TAG_SS)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RowWriterType);
    if (PyModule_AddObject(m, "RowWriter", (PyObject *)&RowWriterType) < 0) {
        Py_DECREF(&RowWriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
