/*
 * module.c - makes the C core an importable extension (ump._ucore).
 *
 * The hooks are called through their addresses (numpy_allocator, ctypes), so
 * the module holds one function only, lookup(), which every hand-off between
 * NumPy and CuPy calls: through ctypes, with three out-parameters, it would
 * cost microseconds of a hand-off's budget. Otherwise it exports what ump.h
 * defines that Python needs to call the core - the kinds, providers, flags,
 * limits and status codes, the names of views and advice, and the fields and
 * size of each struct of uint64_t - so that ump/_core.py builds its constants and ctypes mirrors from
 * the header instead of copying them.
 */
/* Py_LIMITED_API comes from setup.py: the stable ABI of 3.10, one wheel for
 * every CPython since. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cudadrv.h"
#include "ump.h"

struct constant {
    const char *name;
    long value;
};

#define CONSTANT(name) {#name, (long)(name)},
#define LISTED_CONSTANT(name, value) CONSTANT(name)

static const struct constant constants[] = {
    {"ABI_VERSION", UMP_ABI_VERSION},
    CONSTANT(UMP_ALIGN)
    CONSTANT(UMP_MAX_ARENAS)
    CONSTANT(UMP_MAX_POOLS)
    CONSTANT(UMP_CHUNK_MIN)
    CONSTANT(UMP_VMM_MAX_BYTES)
    CONSTANT(UMP_VMM_MAX_RESERVE)
    CONSTANT(UMP_VMM_MAX_DEVICES)
    UMP_PROVIDERS(LISTED_CONSTANT)
    UMP_ARENA_FLAGS(LISTED_CONSTANT)
    CONSTANT(UMP_OK)
    UMP_ERRORS(LISTED_CONSTANT)
    /* CUDA's statuses reach Python unchanged; these are the ones it acts on. */
    CONSTANT(CUDA_ERROR_INVALID_VALUE)
    CONSTANT(CUDA_ERROR_OUT_OF_MEMORY)
};

/* Names Python gives values of C: the kinds (ump.kind_of, Options.kind),
 * the views (MappedMemory.kind) and cuMemAdvise's advice (ump.advise). */
#define LABELLED(name, value, label) {label, name},
static const struct constant kinds[] = {UMP_KINDS(LABELLED)};
static const struct constant view_kinds[] = {UMP_VIEW_KINDS(LABELLED)};
static const struct constant advice[] = {CU_MEM_ADVICES(LABELLED)};

#define FIELD_NAME(name) #name,
static const char *const stats_fields[] = {UMP_STATS_FIELDS(FIELD_NAME)};
static const char *const vmm_stats_fields[] = {UMP_VMM_STATS_FIELDS(FIELD_NAME)};
static const char *const vmm_view_times_fields[] = {UMP_VMM_VIEW_TIMES_FIELDS(FIELD_NAME)};
static const char *const device_fields[] = {UMP_DEVICE_FIELDS(FIELD_NAME)};

#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

/* A struct's field names, in order, and its size: what ump/_core.py checks
 * its ctypes mirror against. */
static int add_struct(PyObject *m, const char *fields_attr, const char *size_attr,
                      const char *const *names, size_t n, size_t size)
{
    PyObject *tuple = PyTuple_New((Py_ssize_t)n);
    if (!tuple)
        return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (!name) {
            Py_DECREF(tuple);
            return -1;
        }
        if (PyTuple_SetItem(tuple, (Py_ssize_t)i, name) < 0) { /* steals name */
            Py_DECREF(tuple);
            return -1;
        }
    }
    int rc = PyModule_AddObjectRef(m, fields_attr, tuple);
    Py_DECREF(tuple);
    if (rc < 0)
        return -1;
    return PyModule_AddIntConstant(m, size_attr, (long)size);
}

/* {name: value} of a labelled list, as attribute `attr`. */
static int add_labels(PyObject *m, const char *attr, const struct constant *labels, size_t n)
{
    PyObject *dict = PyDict_New();
    if (!dict)
        return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromLong(labels[i].value);
        int rc = value ? PyDict_SetItemString(dict, labels[i].name, value) : -1;
        Py_XDECREF(value);
        if (rc < 0) {
            Py_DECREF(dict);
            return -1;
        }
    }
    int rc = PyModule_AddObjectRef(m, attr, dict);
    Py_DECREF(dict);
    return rc;
}

/* lookup(ptr) -> (kind, base, size, owner), as ump_lookup() answers; a
 * number that is no address (negative, or past 64 bits) is in no block. */
static PyObject *lookup(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *index = PyNumber_Index(arg);
    if (!index)
        return NULL;
    unsigned long long p = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        return Py_BuildValue("(iKKi)", UMP_KIND_NONE, 0ULL, 0ULL, -1);
    }
    uintptr_t base = 0;
    uint64_t size = 0;
    int owner = -1, kind;
    /* The registry's locks are never held across a call that needs the GIL,
     * but a pool's may be held across a device synchronisation: let other
     * Python threads run meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    kind = ump_lookup((uintptr_t)p, &base, &size, &owner);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iKKi)", kind, (unsigned long long)base, (unsigned long long)size, owner);
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_O,
     "lookup(ptr) -> (kind, base, size, owner): the live ump block holding ptr"},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *m)
{
    for (size_t i = 0; i < COUNT(constants); i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0)
            return -1;
    if (add_labels(m, "KINDS", kinds, COUNT(kinds)) < 0 ||
        add_labels(m, "VIEW_KINDS", view_kinds, COUNT(view_kinds)) < 0 ||
        add_labels(m, "ADVICE", advice, COUNT(advice)) < 0)
        return -1;
    if (add_struct(m, "STATS_FIELDS", "STATS_SIZE", stats_fields, COUNT(stats_fields),
                   sizeof(ump_stats_t)) < 0)
        return -1;
    if (add_struct(m, "VMM_STATS_FIELDS", "VMM_STATS_SIZE", vmm_stats_fields,
                   COUNT(vmm_stats_fields), sizeof(ump_vmm_stats_t)) < 0)
        return -1;
    if (add_struct(m, "VMM_VIEW_TIMES_FIELDS", "VMM_VIEW_TIMES_SIZE", vmm_view_times_fields,
                   COUNT(vmm_view_times_fields), sizeof(ump_vmm_view_times_t)) < 0)
        return -1;
    return add_struct(m, "DEVICE_FIELDS", "DEVICE_SIZE", device_fields, COUNT(device_fields),
                      sizeof(ump_device_t));
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ucore",
    .m_doc = "ump's C core: NEP 49 hooks, arenas and the pointer registry.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__ucore(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && exec_module(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
