/* MutateRows' answers in C: every entry's status, read from the response's
 * wire bytes instead of through the protobuf library's objects.
 *
 * Walking a 1,000-entry MutateRowsResponse through the library (an Entry
 * object and a Status object per entry, three attribute reads) costs this
 * process ~1.3 us an entry, about as much as the request's own encoding and a
 * few per cent of a change's whole CPU on the live path; read here, ~0.05 us.
 *
 * Nothing is decided here that the reference does not decide (the sink's
 * loop, pipeline/clients/bigtable/writer.py: ``statuses[e.index] = ok if
 * e.status.code == 0 else failed(e.status.code, e.status.message)`` for each
 * entry in order). Only the shape a server sends for a batch without
 * details is read: entries (field 1) only, each of an index (field 1,
 * varint) and a status (field 2: a code = 1, varint, and a message = 2),
 * each at most once, the index within ``statuses``. Anything else gives None
 * and the caller walks the same bytes through the library instead (entries
 * already set here are then set again, to the same or the reference's value):
 * any other field, even one the library knows (a status's details, the
 * response's rate_limit_info: their contents are the library's to check),
 * bytes that are not well formed, a field of another wire type, an index or
 * status given twice (the library would merge them), an index out of range,
 * a code past int32, a message that is not UTF-8. So where this answers, the
 * library reads the bytes to the same statuses.
 * tests/unit/sink/test_response_statuses.py holds the two equal, on any
 * response and on damaged bytes.
 *
 * Compiled into the rowwriter_c module (pyproject.toml), under the same
 * switch (DDB2BT_ROW_WRITER=python turns it off).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Wire types (protobuf encoding): the ones a field read here has. */
#define WT_VARINT 0
#define WT_LEN 2
/* MutateRowsResponse.entries = 1; Entry.index = 1, Entry.status = 2;
 * google.rpc.Status.code = 1, .message = 2. */
#define RESPONSE_ENTRIES 1
#define ENTRY_INDEX 1
#define ENTRY_STATUS 2
#define STATUS_CODE 1
#define STATUS_MESSAGE 2
/* A varint is at most 10 bytes (64 bits, 7 a byte). */
#define MAX_VARINT_BYTES 10

typedef struct {
    const unsigned char *p, *end;
} Reader;

/* 0 and the value, or -1 (truncated or over 10 bytes): never raises. */
static int read_varint(Reader *r, uint64_t *out) {
    uint64_t value = 0;
    for (int i = 0; i < MAX_VARINT_BYTES; i++) {
        if (r->p >= r->end)
            return -1;
        unsigned char byte = *r->p++;
        value |= (uint64_t)(byte & 0x7f) << (7 * i);
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* A length-delimited field's body as a sub-reader, or -1. */
static int read_len(Reader *r, Reader *body) {
    uint64_t len;
    if (read_varint(r, &len) < 0 || len > (uint64_t)(r->end - r->p))
        return -1;
    body->p = r->p;
    body->end = r->p + len;
    r->p += len;
    return 0;
}

/* A key is a 32-bit varint: the library refuses one written in more bytes
 * (even with zeros: 0x84 0x80 0x80 0x80 0x80 0x00 is 4 in six bytes). */
#define MAX_KEY_BYTES 5

/* Read a field's key: -1 where truncated, past 32 bits, written in more than
 * MAX_KEY_BYTES or of field number 0 (each refused by the library). */
static int read_key(Reader *r, uint64_t *field, int *wt) {
    uint64_t key;
    const unsigned char *start = r->p;
    if (read_varint(r, &key) < 0 || r->p - start > MAX_KEY_BYTES || key > UINT32_MAX || (key >> 3) == 0)
        return -1;
    *field = key >> 3;
    *wt = (int)(key & 7);
    return 0;
}

/* One Status: code and message (borrowed bytes), or -1. */
static int read_status(Reader *r, uint64_t *code, const unsigned char **msg, Py_ssize_t *msg_len) {
    int seen_code = 0, seen_message = 0;
    *code = 0;
    *msg = NULL;
    *msg_len = 0;
    while (r->p < r->end) {
        uint64_t field;
        int wt;
        if (read_key(r, &field, &wt) < 0)
            return -1;
        if (field == STATUS_CODE) {
            if (wt != WT_VARINT || seen_code++ || read_varint(r, code) < 0)
                return -1;
        } else if (field == STATUS_MESSAGE) {
            Reader body;
            if (wt != WT_LEN || seen_message++ || read_len(r, &body) < 0)
                return -1;
            *msg = body.p;
            *msg_len = body.end - body.p;
        } else {  /* details, or a field to come: the library's */
            return -1;
        }
    }
    return *code <= INT32_MAX ? 0 : -1;
}

/* mutate_rows_statuses(data, statuses, ok, failed) -> int | None: the number of
 * entries read, each set in ``statuses``; None where the reference must read
 * the bytes (see the top of this file). Raises only what ``failed`` raises, or
 * on memory. */
PyObject *mutate_rows_statuses(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "mutate_rows_statuses(data, statuses, ok, failed)");
        return NULL;
    }
    PyObject *data = args[0], *statuses = args[1], *ok = args[2], *failed = args[3];
    if (!PyBytes_CheckExact(data) || !PyList_CheckExact(statuses))
        Py_RETURN_NONE;
    Reader r = {(const unsigned char *)PyBytes_AS_STRING(data),
                (const unsigned char *)PyBytes_AS_STRING(data) + PyBytes_GET_SIZE(data)};
    Py_ssize_t n = PyList_GET_SIZE(statuses), count = 0;
    while (r.p < r.end) {
        uint64_t top;
        int wt;
        if (read_key(&r, &top, &wt) < 0)
            Py_RETURN_NONE;
        Reader entry;
        /* rate_limit_info, or a field to come: the library's */
        if (top != RESPONSE_ENTRIES || wt != WT_LEN || read_len(&r, &entry) < 0)
            Py_RETURN_NONE;
        uint64_t index = 0, code = 0;
        const unsigned char *msg = NULL;
        Py_ssize_t msg_len = 0;
        int seen_index = 0, seen_status = 0;
        while (entry.p < entry.end) {
            uint64_t field;
            int ewt;
            if (read_key(&entry, &field, &ewt) < 0)
                Py_RETURN_NONE;
            if (field == ENTRY_INDEX) {
                if (ewt != WT_VARINT || seen_index++ || read_varint(&entry, &index) < 0)
                    Py_RETURN_NONE;
            } else if (field == ENTRY_STATUS) {
                Reader status;
                if (ewt != WT_LEN || seen_status++ || read_len(&entry, &status) < 0 ||
                    read_status(&status, &code, &msg, &msg_len) < 0)
                    Py_RETURN_NONE;
            } else {
                Py_RETURN_NONE;
            }
        }
        /* uint64: a negative int64 index is huge here, so out of range too */
        if (index >= (uint64_t)n)
            Py_RETURN_NONE;
        /* The message is checked even where it is not kept (an OK entry's, in
         * practice empty): the library refuses a string that is not UTF-8. */
        PyObject *text = PyUnicode_DecodeUTF8(msg_len ? (const char *)msg : "", msg_len, NULL);
        if (text == NULL) {
            PyErr_Clear();  /* not UTF-8: the library decides what that is */
            Py_RETURN_NONE;
        }
        PyObject *value;
        if (code == 0) {
            Py_DECREF(text);
            value = Py_NewRef(ok);
        } else {
            PyObject *code_obj = PyLong_FromUnsignedLongLong(code);
            if (code_obj == NULL) {
                Py_DECREF(text);
                return NULL;
            }
            PyObject *call_args[2] = {code_obj, text};
            value = PyObject_Vectorcall(failed, call_args, 2, NULL);
            Py_DECREF(code_obj);
            Py_DECREF(text);
            if (value == NULL)
                return NULL;
        }
        /* Steals the reference; checks the bound again (``failed`` is Python
         * and could have changed the list). */
        if (PyList_SetItem(statuses, (Py_ssize_t)index, value) < 0)
            return NULL;
        count++;
    }
    return PyLong_FromSsize_t(count);
}
