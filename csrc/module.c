/*
 * module.c - makes the C core an importable extension (ump._ucore).
 *
 * The hooks are called through their addresses (numpy_allocator, ctypes), so
 * the module itself only reports the ABI version the Python layer checks at
 * import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ump.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ucore",
    .m_doc = "ump's C core: NEP 49 hooks, arenas and the pointer registry.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__ucore(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI_VERSION", UMP_ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
