/* Native per-endpoint chunk LRU for epp.prefix.index (optional; same behaviour as the
 * pure-Python store in epp/prefix/lru.py, checked by the same model-based tests).
 *
 * An open-addressing hash table (linear probing, backward-shift deletion) from 64-bit chunk
 * hash to a node; nodes sit in a doubly-linked list from the oldest use to the youngest.
 * Recording a chain walks it deepest chunk first, moving held chunks to the young end and
 * appending new ones, evicting the oldest node first whenever the store is full. No Python
 * objects are allocated per chunk: an entry costs a 24-byte node plus 8 bytes of table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t key;
    double stamp;
    int32_t prev; /* node 0 is the sentinel: N[0].next = oldest, N[0].prev = youngest */
    int32_t next;
} Node; /* one cache line holds what a lookup and a move touch */

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity; /* most live entries */
    Py_ssize_t size;     /* live entries */
    Py_ssize_t alloc;    /* nodes allocated, excluding the sentinel 0 */
    Py_ssize_t top;      /* highest node index handed out */
    int32_t free_head;   /* recycled nodes, linked through next[]; 0 = none */
    Node *nodes;
    int32_t *slots; /* 0 = empty, else a node index */
    size_t tmask;   /* table size - 1 (a power of two, at least twice alloc) */
} Lru;

static inline size_t
mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

/* >= 0: the slot holding key; < 0: -(empty slot) - 1 where it would go. */
static inline Py_ssize_t
find_slot(const Lru *s, uint64_t key)
{
    size_t i = mix(key) & s->tmask;
    for (;;) {
        int32_t n = s->slots[i];
        if (n == 0)
            return -(Py_ssize_t)i - 1;
        if (s->nodes[n].key == key)
            return (Py_ssize_t)i;
        i = (i + 1) & s->tmask;
    }
}

static void
delete_slot(Lru *s, size_t i)
{
    size_t j = i;
    for (;;) {
        j = (j + 1) & s->tmask;
        int32_t n = s->slots[j];
        if (n == 0)
            break;
        size_t h = mix(s->nodes[n].key) & s->tmask;
        /* the entry at j may move to the hole at i unless its home lies cyclically in (i, j] */
        int movable = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
        if (movable) {
            s->slots[i] = n;
            i = j;
        }
    }
    s->slots[i] = 0;
}

static inline void
unlink_node(Lru *s, int32_t n)
{
    s->nodes[s->nodes[n].prev].next = s->nodes[n].next;
    s->nodes[s->nodes[n].next].prev = s->nodes[n].prev;
}

static inline void
append_young(Lru *s, int32_t n)
{
    int32_t last = s->nodes[0].prev;
    s->nodes[last].next = n;
    s->nodes[n].prev = last;
    s->nodes[n].next = 0;
    s->nodes[0].prev = n;
}

static void
evict_node(Lru *s, int32_t n)
{
    Py_ssize_t slot = find_slot(s, s->nodes[n].key);
    if (slot >= 0)
        delete_slot(s, (size_t)slot);
    unlink_node(s, n);
    s->nodes[n].next = s->free_head;
    s->free_head = n;
    s->size--;
}

static int
rehash(Lru *s, size_t tsize)
{
    int32_t *slots = PyMem_Calloc(tsize, sizeof(int32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(s->slots);
    s->slots = slots;
    s->tmask = tsize - 1;
    for (int32_t n = s->nodes[0].next; n != 0; n = s->nodes[n].next) {
        Py_ssize_t r = find_slot(s, s->nodes[n].key);
        s->slots[-r - 1] = n;
    }
    return 0;
}

static int
grow(Lru *s)
{
    Py_ssize_t alloc = s->alloc < 64 ? 64 : s->alloc * 2;
    if (alloc > INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "chunk store too large");
        return -1;
    }
    Node *nodes = PyMem_Realloc(s->nodes, ((size_t)alloc + 1) * sizeof(Node));
    if (nodes == NULL)
        return PyErr_NoMemory(), -1;
    s->nodes = nodes;
    s->alloc = alloc;
    size_t tsize = 16;
    while (tsize < (size_t)alloc * 2)
        tsize <<= 1;
    if (tsize - 1 > s->tmask)
        return rehash(s, tsize);
    return 0;
}

static int32_t
new_node(Lru *s)
{
    if (s->free_head != 0) {
        int32_t n = s->free_head;
        s->free_head = s->nodes[n].next;
        return n;
    }
    if (s->top == s->alloc && grow(s) < 0)
        return -1;
    return (int32_t)++s->top;
}

static int
key_of(PyObject *item, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}


/* An object made by LruChunks.__new__ without __init__ (or whose __init__ failed) has no
 * table: every method checks, so it raises instead of reading a NULL table. */
static int
ready(const Lru *s)
{
    if (s->nodes == NULL || s->slots == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LruChunks is not initialised (call __init__)");
        return 0;
    }
    return 1;
}

/* --- methods ----------------------------------------------------------------------- */

static PyObject *
Lru_record(Lru *s, PyObject *args)
{
    if (!ready(s))
        return NULL;
    PyObject *seq;
    double stamp;
    if (!PyArg_ParseTuple(args, "Od", &seq, &stamp))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "hashes must be a sequence of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > s->capacity)
        len = s->capacity; /* keep the leading chunks: the set stays prefix-closed */
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t stack_keys[512];
    uint64_t *keys = len <= 512 ? stack_keys : PyMem_Malloc((size_t)len * sizeof(uint64_t));
    if (keys == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < len; k++) {
        if (key_of(items[k], &keys[k]) < 0) {
            if (keys != stack_keys)
                PyMem_Free(keys);
            goto fail;
        }
    }
    Py_ssize_t evicted = 0;
    for (Py_ssize_t k = len - 1; k >= 0; k--) { /* deepest chunk first */
        uint64_t key = keys[k];
        /* the table and nodes are far larger than the caches: ask for the next chunks'
         * slot (two ahead) and node (one ahead) while this one is handled */
        if (k >= 2)
            __builtin_prefetch(&s->slots[mix(keys[k - 2]) & s->tmask]);
        if (k >= 1) {
            int32_t ahead = s->slots[mix(keys[k - 1]) & s->tmask];
            if (ahead != 0)
                __builtin_prefetch(&s->nodes[ahead]);
        }
        Py_ssize_t r = find_slot(s, key);
        if (r >= 0) {
            int32_t n = s->slots[r];
            s->nodes[n].stamp = stamp;
            unlink_node(s, n);
            append_young(s, n);
            continue;
        }
        if (s->size >= s->capacity) {
            evict_node(s, s->nodes[0].next);
            evicted++;
        }
        int32_t n = new_node(s);
        if (n < 0) {
            if (keys != stack_keys)
                PyMem_Free(keys);
            goto fail;
        }
        r = find_slot(s, key); /* eviction shifted slots; growth may have rebuilt the table */
        s->nodes[n].key = key;
        s->nodes[n].stamp = stamp;
        s->slots[-r - 1] = n;
        append_young(s, n);
        s->size++;
    }
    if (keys != stack_keys)
        PyMem_Free(keys);
    Py_DECREF(fast);
    return PyLong_FromSsize_t(evicted);
fail:
    Py_DECREF(fast);
    return NULL;
}

static PyObject *
Lru_held(Lru *s, PyObject *args)
{
    if (!ready(s))
        return NULL;
    PyObject *seq;
    double cutoff;
    if (!PyArg_ParseTuple(args, "Od", &seq, &cutoff))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "hashes must be a sequence of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t result = 0;
    uint64_t key;
#define FRESH(idx, out)                                                         \
    do {                                                                        \
        if (key_of(items[(idx)], &key) < 0) {                                   \
            Py_DECREF(fast);                                                    \
            return NULL;                                                        \
        }                                                                       \
        Py_ssize_t r_ = find_slot(s, key);                                      \
        (out) = r_ >= 0 && s->nodes[s->slots[r_]].stamp >= cutoff;                   \
    } while (0)
    if (n > 0) {
        int fresh;
        FRESH(0, fresh);
        if (fresh) {
            FRESH(n - 1, fresh);
            if (fresh) {
                result = n;
            }
            else {
                Py_ssize_t lo = 1, hi = n; /* chunk lo-1 held, chunk hi-1 not */
                while (hi - lo > 1) {
                    Py_ssize_t mid = (lo + hi) >> 1;
                    FRESH(mid - 1, fresh);
                    if (fresh)
                        lo = mid;
                    else
                        hi = mid;
                }
                result = lo;
            }
        }
    }
#undef FRESH
    Py_DECREF(fast);
    return PyLong_FromSsize_t(result);
}

static PyObject *
Lru_get(Lru *s, PyObject *item)
{
    if (!ready(s))
        return NULL;
    uint64_t key;
    if (key_of(item, &key) < 0)
        return NULL;
    Py_ssize_t r = find_slot(s, key);
    if (r < 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s->nodes[s->slots[r]].stamp);
}

static PyObject *
Lru_sweep(Lru *s, PyObject *args)
{
    if (!ready(s))
        return NULL;
    double cutoff;
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "d|n", &cutoff, &limit))
        return NULL;
    Py_ssize_t removed = 0;
    while (removed < limit && s->size > 0 && s->nodes[s->nodes[0].next].stamp < cutoff) {
        evict_node(s, s->nodes[0].next);
        removed++;
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *
Lru_evict_oldest(Lru *s, PyObject *arg)
{
    if (!ready(s))
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t removed = 0;
    while (removed < count && s->size > 0) {
        evict_node(s, s->nodes[0].next);
        removed++;
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *
Lru_set_capacity(Lru *s, PyObject *arg)
{
    if (!ready(s))
        return NULL;
    Py_ssize_t capacity = PyLong_AsSsize_t(arg);
    if (capacity == -1 && PyErr_Occurred())
        return NULL;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return NULL;
    }
    s->capacity = capacity;
    Py_ssize_t removed = 0;
    while (s->size > capacity) {
        evict_node(s, s->nodes[0].next);
        removed++;
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *
Lru_oldest_stamp(Lru *s, PyObject *Py_UNUSED(ignored))
{
    if (!ready(s))
        return NULL;
    if (s->size == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s->nodes[s->nodes[0].next].stamp);
}

static PyObject *
Lru_items(Lru *s, PyObject *args)
{
    if (!ready(s))
        return NULL;
    Py_ssize_t start = 0, count = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "|nn", &start, &count))
        return NULL;
    if (start < 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "start and count must be >= 0");
        return NULL;
    }
    Py_ssize_t len = start >= s->size ? 0 : s->size - start;
    if (count < len)
        len = count;
    PyObject *out = PyList_New(len);
    if (out == NULL)
        return NULL;
    if (len == 0)
        return out;
    /* walk to the start from the nearer end of the list */
    int32_t n;
    if (start <= s->size / 2) {
        n = s->nodes[0].next;
        for (Py_ssize_t k = 0; k < start; k++)
            n = s->nodes[n].next;
    }
    else {
        n = s->nodes[0].prev;
        for (Py_ssize_t k = s->size - 1; k > start; k--)
            n = s->nodes[n].prev;
    }
    for (Py_ssize_t i = 0; i < len; n = s->nodes[n].next, i++) {
        PyObject *pair = Py_BuildValue("(Kd)", (unsigned long long)s->nodes[n].key, s->nodes[n].stamp);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
}

static Py_ssize_t
Lru_len(Lru *s)
{
    return s->size;
}

static PyObject *
Lru_get_capacity(Lru *s, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(s->capacity);
}

static PyObject *
Lru_get_nbytes(Lru *s, void *Py_UNUSED(closure))
{
    size_t nodes = (size_t)(s->alloc + 1) * sizeof(Node);
    size_t table = (s->tmask + 1) * sizeof(int32_t);
    return PyLong_FromSize_t(sizeof(Lru) + nodes + table);
}

static int
Lru_init(Lru *s, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &capacity))
        return -1;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return -1;
    }
    if (s->nodes != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LruChunks is already initialised");
        return -1;
    }
    s->capacity = capacity;
    s->size = s->alloc = s->top = 0;
    s->free_head = 0;
    s->nodes = PyMem_Malloc(sizeof(Node));
    s->slots = PyMem_Calloc(16, sizeof(int32_t));
    if (!s->nodes || !s->slots) {
        PyMem_Free(s->nodes);
        PyMem_Free(s->slots);
        s->nodes = NULL;
        s->slots = NULL;
        PyErr_NoMemory();
        return -1;
    }
    s->tmask = 15;
    s->nodes[0].prev = s->nodes[0].next = 0;
    return grow(s);
}

static void
Lru_dealloc(Lru *s)
{
    PyMem_Free(s->nodes);
    PyMem_Free(s->slots);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Lru_methods[] = {
    {"record", (PyCFunction)Lru_record, METH_VARARGS,
     "record(hashes, stamp) -> evicted: the chain becomes the youngest, deepest chunk first"},
    {"held", (PyCFunction)Lru_held, METH_VARARGS,
     "held(hashes, cutoff) -> leading chunks held with a last use at or after cutoff"},
    {"get", (PyCFunction)Lru_get, METH_O, "get(hash) -> last use, or None"},
    {"sweep", (PyCFunction)Lru_sweep, METH_VARARGS,
     "sweep(cutoff[, limit]) -> entries removed (older than cutoff; at most limit)"},
    {"evict_oldest", (PyCFunction)Lru_evict_oldest, METH_O, "evict_oldest(n) -> entries removed"},
    {"set_capacity", (PyCFunction)Lru_set_capacity, METH_O, "set_capacity(n) -> entries evicted"},
    {"oldest_stamp", (PyCFunction)Lru_oldest_stamp, METH_NOARGS, "last use of the oldest entry"},
    {"items", (PyCFunction)Lru_items, METH_VARARGS,
     "items([start[, count]]) -> [(hash, last use)], oldest first, from position start"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lru_getset[] = {
    {"capacity", (getter)Lru_get_capacity, NULL, "most entries", NULL},
    {"nbytes", (getter)Lru_get_nbytes, NULL, "bytes allocated", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Lru_as_sequence = {
    .sq_length = (lenfunc)Lru_len,
};

static PyTypeObject LruType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.prefix._lru.LruChunks",
    .tp_doc = "One endpoint's chunk LRU (native).",
    .tp_basicsize = sizeof(Lru),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lru_init,
    .tp_dealloc = (destructor)Lru_dealloc,
    .tp_methods = Lru_methods,
    .tp_getset = Lru_getset,
    .tp_as_sequence = &Lru_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lru", "Native per-endpoint chunk LRU.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__lru(void)
{
    if (PyType_Ready(&LruType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LruType);
    if (PyModule_AddObject(m, "LruChunks", (PyObject *)&LruType) < 0) {
        Py_DECREF(&LruType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
