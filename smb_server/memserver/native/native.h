/* The memory server's native part (module smb_server.memserver._native): what a
 * request's hot path needs without the interpreter. Each file registers its types on
 * the module; module.c puts them together. */
#ifndef SMB_SERVER_NATIVE_H
#define SMB_SERVER_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

int dedup_register(PyObject *module);    /* dedup.c: the exactly-once table */
int chunks_register(PyObject *module);   /* chunks.c: the extent lock and a chunk's round step */

#endif
