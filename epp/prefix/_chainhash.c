/* Native fast path for epp.prefix.hasher: the chained chunk hash in one C loop.
 *
 * Computes exactly what the pure-Python loop computes (h_i = XXH3_64(chunk_i, seed=h_(i-1))
 * over the UTF-8 bytes of fixed-size *character* chunks), without one Python call per chunk
 * and without a UTF-8 copy of the whole text: an ASCII str's storage is its UTF-8, any other
 * is encoded one chunk at a time into a small buffer (code point offsets are chunk bounds).
 * Links against the system's libxxhash (the same XXH3 the `xxhash` package bundles); when it
 * cannot be built, epp falls back to the pure-Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

uint64_t XXH3_64bits_withSeed(const void *data, size_t len, uint64_t seed);

/* UTF-8 of ``n`` code points of a canonical str's storage (``kind`` 1, 2 or 4 bytes per
 * code point) into ``out`` (room for 4 * n bytes); returns the bytes written, or -1 at a
 * lone surrogate (not encodable). Runs of ASCII move a 64-bit word per step. */
static Py_ssize_t
encode_utf8(int kind, const void *data, Py_ssize_t at, Py_ssize_t n, unsigned char *out)
{
    unsigned char *o = out;
    Py_ssize_t i = 0;
    if (kind == PyUnicode_1BYTE_KIND) {
        const unsigned char *s = (const unsigned char *)data + at;
        while (i < n) {
            if (n - i >= 8) {
                uint64_t w;
                memcpy(&w, s + i, 8);
                if ((w & 0x8080808080808080ULL) == 0) {
                    memcpy(o, &w, 8);
                    o += 8;
                    i += 8;
                    continue;
                }
            }
            Py_UCS4 c = s[i++];
            if (c < 0x80) {
                *o++ = (unsigned char)c;
            } else {
                *o++ = (unsigned char)(0xC0 | (c >> 6));
                *o++ = (unsigned char)(0x80 | (c & 0x3F));
            }
        }
        return o - out;
    }
    if (kind == PyUnicode_2BYTE_KIND) {
        const Py_UCS2 *s = (const Py_UCS2 *)data + at;
        while (i < n) {
            if (n - i >= 4) {
                uint64_t w;
                memcpy(&w, s + i, 8);
                if ((w & 0xFF80FF80FF80FF80ULL) == 0) {
                    o[0] = (unsigned char)s[i];
                    o[1] = (unsigned char)s[i + 1];
                    o[2] = (unsigned char)s[i + 2];
                    o[3] = (unsigned char)s[i + 3];
                    o += 4;
                    i += 4;
                    continue;
                }
            }
            Py_UCS4 c = s[i++];
            if (c < 0x80) {
                *o++ = (unsigned char)c;
            } else if (c < 0x800) {
                *o++ = (unsigned char)(0xC0 | (c >> 6));
                *o++ = (unsigned char)(0x80 | (c & 0x3F));
            } else if (c >= 0xD800 && c <= 0xDFFF) {
                return -1;
            } else {
                *o++ = (unsigned char)(0xE0 | (c >> 12));
                *o++ = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
                *o++ = (unsigned char)(0x80 | (c & 0x3F));
            }
        }
        return o - out;
    }
    const Py_UCS4 *s = (const Py_UCS4 *)data + at;
    while (i < n) {
        Py_UCS4 c = s[i++];
        if (c < 0x80) {
            *o++ = (unsigned char)c;
        } else if (c < 0x800) {
            *o++ = (unsigned char)(0xC0 | (c >> 6));
            *o++ = (unsigned char)(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            if (c >= 0xD800 && c <= 0xDFFF)
                return -1;
            *o++ = (unsigned char)(0xE0 | (c >> 12));
            *o++ = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
            *o++ = (unsigned char)(0x80 | (c & 0x3F));
        } else {
            *o++ = (unsigned char)(0xF0 | (c >> 18));
            *o++ = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
            *o++ = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
            *o++ = (unsigned char)(0x80 | (c & 0x3F));
        }
    }
    return o - out;
}

static PyObject *
chain_hashes(PyObject *self, PyObject *args)
{
    PyObject *text;
    Py_ssize_t block, start, max_chunks;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "UnKnn", &text, &block, &seed, &start, &max_chunks))
        return NULL;
    if (block <= 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_chars must be positive, start_char >= 0");
        return NULL;
    }
    if (block > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "block_chars is too large");
        return NULL;
    }
    Py_ssize_t n = (PyUnicode_GET_LENGTH(text) - start) / block;
    if (max_chunks > 0) {
        Py_ssize_t limit = max_chunks - start / block;
        if (limit < n)
            n = limit;
    }
    if (n <= 0)
        return PyList_New(0);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    uint64_t h = (uint64_t)seed;
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    if (PyUnicode_IS_ASCII(text)) {  /* the storage is the UTF-8 */
        const char *p = (const char *)data + start;
        for (Py_ssize_t i = 0; i < n; i++, p += block) {
            h = XXH3_64bits_withSeed(p, (size_t)block, h);
            PyObject *v = PyLong_FromUnsignedLongLong(h);
            if (v == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, i, v);
        }
        return out;
    }
    /* Each chunk encoded on its own from the str's storage: no UTF-8 copy of the whole
     * text is made (or cached on the str), and chunk boundaries are code point offsets. */
    unsigned char stack[1024];
    unsigned char *buf = stack;
    if (4 * block > (Py_ssize_t)sizeof(stack)) {
        buf = PyMem_Malloc((size_t)(4 * block));
        if (buf == NULL) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t at = start;
    for (Py_ssize_t i = 0; i < n; i++, at += block) {
        Py_ssize_t len = encode_utf8(kind, data, at, block, buf);
        if (len < 0) {  /* a lone surrogate: let the codec raise its UnicodeEncodeError */
            PyObject *chunk = PyUnicode_Substring(text, at, at + block);
            if (chunk != NULL) {
                PyObject *encoded = PyUnicode_AsUTF8String(chunk);
                Py_XDECREF(encoded);
                Py_DECREF(chunk);
            }
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "text is not encodable as UTF-8");
            goto fail;
        }
        h = XXH3_64bits_withSeed(buf, (size_t)len, h);
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    if (buf != stack)
        PyMem_Free(buf);
    return out;
fail:
    if (buf != stack)
        PyMem_Free(buf);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_hashes", chain_hashes, METH_VARARGS,
     "chain_hashes(text, block_chars, seed, start_char, max_chunks) -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chainhash", "Chained XXH3 chunk hashing (native).", -1, methods,
};

PyMODINIT_FUNC
PyInit__chainhash(void)
{
    return PyModule_Create(&module);
}
