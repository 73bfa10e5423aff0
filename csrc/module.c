/*
 * module.c - makes the C core an importable extension (ump._ucore).
 *
 * The hooks are called through their addresses (numpy_allocator, ctypes), so
 * the module holds no functions: it exports what ump.h defines that Python
 * needs to call them - the kinds, providers, flags, limits and status codes,
 * and the fields and size of each statistics struct - so that ump/_core.py
 * builds its constants and ctypes mirrors from the header instead of copying
 * them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cudadrv.h"
#include "ump.h"

struct constant {
    const char *name;
    long value;
};

#define CONSTANT(name) {#name, (long)(name)},
#define ERROR_CONSTANT(name, value) CONSTANT(name)

static const struct constant constants[] = {
    {"ABI_VERSION", UMP_ABI_VERSION},
    CONSTANT(UMP_ALIGN)
    CONSTANT(UMP_MAX_ARENAS)
    CONSTANT(UMP_MAX_POOLS)
    CONSTANT(UMP_PROVIDER_HOST)
    CONSTANT(UMP_PROVIDER_MANAGED)
    CONSTANT(UMP_PROVIDER_PINNED)
    CONSTANT(UMP_PROVIDER_DEVICE)
    CONSTANT(UMP_ARENA_ADVISE_HOST)
    CONSTANT(UMP_ARENA_CUPY)
    CONSTANT(UMP_OK)
    UMP_ERRORS(ERROR_CONSTANT)
    /* CUDA's statuses reach Python unchanged; this is the one it acts on. */
    CONSTANT(CUDA_ERROR_OUT_OF_MEMORY)
};

/* The names Python gives the kinds (ump.kind_of, Options.kind). */
static const struct constant kinds[] = {
    {"host", UMP_KIND_HOST},
    {"system", UMP_KIND_SYSTEM},
    {"managed", UMP_KIND_MANAGED},
    {"pinned", UMP_KIND_PINNED},
    {"device", UMP_KIND_DEVICE},
};

#define FIELD_NAME(name) #name,
static const char *const stats_fields[] = {UMP_STATS_FIELDS(FIELD_NAME)};
static const char *const vmm_stats_fields[] = {UMP_VMM_STATS_FIELDS(FIELD_NAME)};

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
        PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, name);
    }
    int rc = PyModule_AddObjectRef(m, fields_attr, tuple);
    Py_DECREF(tuple);
    if (rc < 0)
        return -1;
    return PyModule_AddIntConstant(m, size_attr, (long)size);
}

static int add_kinds(PyObject *m)
{
    PyObject *dict = PyDict_New();
    if (!dict)
        return -1;
    for (size_t i = 0; i < COUNT(kinds); i++) {
        PyObject *value = PyLong_FromLong(kinds[i].value);
        int rc = value ? PyDict_SetItemString(dict, kinds[i].name, value) : -1;
        Py_XDECREF(value);
        if (rc < 0) {
            Py_DECREF(dict);
            return -1;
        }
    }
    int rc = PyModule_AddObjectRef(m, "KINDS", dict);
    Py_DECREF(dict);
    return rc;
}

static int exec_module(PyObject *m)
{
    for (size_t i = 0; i < COUNT(constants); i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0)
            return -1;
    if (add_kinds(m) < 0)
        return -1;
    if (add_struct(m, "STATS_FIELDS", "STATS_SIZE", stats_fields, COUNT(stats_fields),
                   sizeof(ump_stats_t)) < 0)
        return -1;
    return add_struct(m, "VMM_STATS_FIELDS", "VMM_STATS_SIZE", vmm_stats_fields,
                      COUNT(vmm_stats_fields), sizeof(ump_vmm_stats_t));
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ucore",
    .m_doc = "ump's C core: NEP 49 hooks, arenas and the pointer registry.",
    .m_size = -1,
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
