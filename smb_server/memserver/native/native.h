/* The memory server's native part (module smb_server.memserver._native): what a
 * request's hot path needs without the interpreter. Each file registers its types on
 * the module; module.c puts them together. */
#ifndef SMB_SERVER_NATIVE_H
#define SMB_SERVER_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

int dedup_register(PyObject *module);    /* dedup.c: the exactly-once table */
int chunks_register(PyObject *module);   /* chunks.c: the extent lock and a chunk's round step */
int serve_register(PyObject *module);    /* serve.c: a tcp connection's REDUCEs served natively */

/* chunks.c's Mutex for serve.c: its type, and its pthread mutex held by reference (with
 * the interpreter for hold; drop anywhere), so that it outlives its Python object. */
#include <pthread.h>
struct smb_mutex;
extern PyTypeObject *smb_mutex_type;
struct smb_mutex *smb_mutex_hold(PyObject *mutex);
void smb_mutex_drop(struct smb_mutex *m);
pthread_mutex_t *smb_mutex_of(struct smb_mutex *m);

/* chunks.c's steps of a collective chunk, for serve.c (without the interpreter): a push
 * under the extent's lock ``mu`` (0, or the lock's error), and a pull counted under it
 * (the caller holds it; returns the word before). */
#include <stddef.h>
#include <stdint.h>
int chunk_push(pthread_mutex_t *mu, int64_t *count, void *dst, const void *src, ptrdiff_t nbytes,
               int slot_code, int wire_code, int64_t parties, int64_t round, int root,
               int *step, int64_t *old, int64_t *value);
int64_t chunk_pull_counted(int64_t *count);

/* The exactly-once table of dedup.c, for C callers (a native request loop). Every
 * function below may run WITHOUT the interpreter lock unless it says otherwise; none
 * calls into Python. The table's mutex is internal: each function takes it for a short
 * step (never while waiting for the interpreter lock) and none returns holding it.
 *
 * Lifetimes: a struct dd_table lives as long as its Python DedupTable; a C caller
 * holds a reference on that object (taken with the interpreter lock) for as long as it
 * uses the table. A struct dd_entry is reference counted (atomically): the table holds
 * one while the entry is filed, each caller that got it from dd_begin holds one, and it
 * is freed when the last goes (dd_entry_decref). An entry the table dropped (a full
 * window, a forgotten client, forget()) stays valid for whoever holds a reference;
 * finishing or interrupting it then is harmless (it wakes waiters, nothing else).
 *
 * Ownership: dd_begin's DD_FRESH makes the caller the entry's owner: it runs the
 * request, may set applied and body, and must end with dd_finish or dd_interrupt
 * (with the same table). Once done, status and body never change (a second
 * dd_finish is ignored), so anyone holding a reference reads them without a lock. */
#include <stddef.h>
#include <stdint.h>

struct dd_table;
struct dd_entry;

#define DD_WHAT_MAX 5     /* a request's description: op, extent, offset, length, dtype */

enum {
    DD_FRESH = 1,         /* the caller owns the entry (new, or resumed after an interrupt) */
    DD_DONE = 0,          /* a repeat of a finished request: answer its status and body */
    DD_TIMEOUT = -1,      /* another attempt still runs after the timeout */
    DD_MISMATCH = -2,     /* the number was filed for another request (what differs) */
    DD_NOMEM = -3,        /* out of memory: nothing changed */
    DD_INVALID = -4,      /* nwhat outside 0..DD_WHAT_MAX */
};

/* Look up (client, seq), filing a new entry if it is not there. DD_FRESH and DD_DONE
 * set *out to the entry with a reference for the caller (dd_entry_decref it); other
 * codes set *out to NULL. Waits while another attempt runs: timeout seconds in all
 * (<0: for ever, 0: not at all), on CLOCK_MONOTONIC; a caller that holds the
 * interpreter lock must pass 0 (the attempt it waits for may need that lock to end). */
int dd_begin(struct dd_table *t, uint64_t client, uint64_t seq, const int64_t *what, int nwhat,
             double timeout, struct dd_entry **out);
/* The owner's answer (copied): 0, or 1 when the entry was already done (nothing
 * changes: the first answer stays), or -1 out of memory (nothing changes). Wakes the
 * waiters. The caller's reference stays its own. */
int dd_finish(struct dd_table *t, struct dd_entry *e, int status, const char *body, size_t n);
/* The owner stopped part way (applied says what took effect): a retry resumes it. */
void dd_interrupt(struct dd_table *t, struct dd_entry *e);
/* The owner's body before finishing (copied; what export hands over of an interrupted
 * entry): 0, or -1 when the entry is done or out of memory. */
int dd_entry_set_body(struct dd_table *t, struct dd_entry *e, const char *body, size_t n);

void dd_entry_incref(struct dd_entry *e);
void dd_entry_decref(struct dd_entry *e);   /* NULL: nothing */

int dd_entry_owned(const struct dd_entry *e);
int dd_entry_done(const struct dd_entry *e);        /* 1: status and body are final */
int dd_entry_status(const struct dd_entry *e);
/* the body: final once done; before, only its owner may read it */
const char *dd_entry_body(const struct dd_entry *e, size_t *n);
int64_t dd_entry_applied(const struct dd_entry *e);
void dd_entry_set_applied(struct dd_entry *e, int64_t applied);   /* the owner */
int dd_entry_what(const struct dd_entry *e, int64_t what[DD_WHAT_MAX]);   /* returns nwhat */
uint64_t dd_entry_client(const struct dd_entry *e);
uint64_t dd_entry_seq(const struct dd_entry *e);

/* The table of a DedupTable (or subclass) object, else NULL with a TypeError set.
 * With the interpreter lock. */
struct dd_table *dd_table_of(PyObject *obj);

#endif
