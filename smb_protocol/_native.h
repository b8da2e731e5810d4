/* The elementwise kernels of _native.c as other native modules call them (the memory
 * server's, smb_server/memserver/native): a table of function pointers, published by
 * smb_protocol._native as the capsule KERNELS_CAPSULE. Every function runs without the
 * interpreter: the caller has checked types and lengths. */
#ifndef SMB_PROTOCOL_NATIVE_H
#define SMB_PROTOCOL_NATIVE_H

#include <stddef.h>

#define KERNELS_CAPSULE "smb_protocol._native.kernels"

/* element type codes: smb_protocol.dtypes.DType's */
enum { T_F32 = 1, T_F16 = 2, T_BF16 = 3, T_F64 = 4, T_I32 = 5, T_I64 = 6 };

typedef void (*smb_pair_op)(void *d, const void *s, double alpha, int code, ptrdiff_t n);

struct smb_kernels {
    /* d += s, n elements of type code */
    smb_pair_op add;
    /* the 16-bit s (code: T_F16 or T_BF16) widened into float32 d, stored (alpha 0) or
     * added (alpha not 0) */
    smb_pair_op widen;
    /* the element size of a type code (0: unknown) */
    ptrdiff_t (*item_size)(int code);
    /* float32 s rounded once into the 16-bit d (code: T_F16 or T_BF16) */
    smb_pair_op narrow;
};

#endif
