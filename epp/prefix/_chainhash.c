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
#include <string.h>

uint64_t XXH3_64bits_withSeed(const void *data, size_t len, uint64_t seed);

/* The position ``count`` characters after ``p`` (a character's lead byte, or ``end``).
 * Characters are counted by their lead bytes (every byte but 10xxxxxx continuations), eight
 * bytes at a time while the word holds fewer lead bytes than are left to skip; mostly-ASCII
 * text (most prompts, whatever their language's share) moves a word per step. */
static inline const unsigned char *
skip_chars(const unsigned char *p, const unsigned char *end, Py_ssize_t count)
{
    const uint64_t high = 0x8080808080808080ULL;
    while (end - p >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint64_t cont = w & ~(w << 1) & high;  /* bit 7 set in each continuation byte */
        Py_ssize_t leads = 8 - __builtin_popcountll(cont);
        if (leads >= count)
            break;
        count -= leads;
        p += 8;
    }
    for (; p < end; p++) {
        if ((*p & 0xC0) != 0x80) {
            if (count == 0)
                break;
            count--;
        }
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
