/* The exactly-once table (see smb_server/memserver/dedup.py). */
#include "native.h"

int dedup_register(PyObject *module)
{
    (void)module;
    return 0;
}
