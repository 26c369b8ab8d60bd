/* Native fast path for epp.prefix.hasher: the chained chunk hash in one C loop.
 *
 * Computes exactly what the pure-Python loop computes (h_i = XXH3_64(chunk_i, seed=h_(i-1))
 * over the UTF-8 bytes of fixed-size *character* chunks), without one Python call per chunk.
 * Links against the system's libxxhash (the same XXH3 the `xxhash` package bundles); when it
 * cannot be built, epp falls back to the pure-Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

uint64_t XXH3_64bits_withSeed(const void *data, size_t len, uint64_t seed);

static inline const unsigned char *
skip_chars(const unsigned char *p, const unsigned char *end, Py_ssize_t count)
{
    while (count-- > 0 && p < end) {
        unsigned char c = *p;
        p += (c < 0x80) ? 1 : ((c >> 5) == 0x6) ? 2 : ((c >> 4) == 0xE) ? 3 : 4;
    }
    return p;
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
    Py_ssize_t n = (PyUnicode_GET_LENGTH(text) - start) / block;
    if (max_chunks > 0) {
        Py_ssize_t limit = max_chunks - start / block;
        if (limit < n)
            n = limit;
    }
    if (n <= 0)
        return PyList_New(0);
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 == NULL)
        return NULL;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    uint64_t h = (uint64_t)seed;
    if (PyUnicode_IS_ASCII(text)) {
        const char *p = utf8 + start;
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
    const unsigned char *end = (const unsigned char *)utf8 + size;
    const unsigned char *p = skip_chars((const unsigned char *)utf8, end, start);
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *q = skip_chars(p, end, block);
        h = XXH3_64bits_withSeed(p, (size_t)(q - p), h);
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
        p = q;
    }
    return out;
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
