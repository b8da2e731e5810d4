/* The module smb_server.memserver._native: the types of dedup.c, chunks.c and serve.c. */
#include "native.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "smb_server.memserver._native",
    "The memory server's native part: its exactly-once table, the extents' locks, a "
    "collective chunk's round step and the tcp connections' REDUCE service "
    "(docs/architecture.md, \"Native code\").",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (dedup_register(m) < 0 || chunks_register(m) < 0 || serve_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
