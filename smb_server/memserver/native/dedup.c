/* The exactly-once table: the recent mutating requests of each client, by sequence
 * number (the rules are in smb_server/memserver/dedup.py's docstring).
 *
 * Why native: a native request loop (several threads, without the interpreter lock)
 * and the Python request paths consult and update the same table, so its storage and
 * operations are C (structs under one pthread mutex, waits on a condition variable)
 * and the Python types DedupTable and Entry are thin faces over them. The C API and
 * its rules are in native.h.
 *
 * Storage: every entry is in one hash table by (client, seq) (chained through the
 * entries themselves, so a begin is O(1)) and in its client's list, oldest first (the
 * window forgets the oldest finished ones). Clients are in a hash table by id and in a
 * list, least recently seen first (beyond max_clients the first is forgotten, with its
 * entries). An entry's life is its reference count: the table's (while filed), each C
 * caller's, and its Python face's.
 *
 * Locks: the table's mutex guards the structure and an entry's owned/done/status/body
 * changes; it is held for short steps only, never while waiting for the interpreter
 * lock and never while running Python (an allocation of a Python object can run a
 * collection, which runs finalizers, which may call this table): Python objects are
 * built before taking it or after releasing it. Taking it while holding the interpreter
 * lock is fine for that reason. Fields read without the mutex (owned, done, status,
 * applied, refs) are accessed atomically. An entry's face pointer is touched only with
 * the interpreter lock.
 */
#include "native.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

struct dd_client;

struct dd_entry {
    int refs;                        /* atomic: the table's, each caller's, the face's */
    int owned, done;                 /* atomic reads; changed under the table's lock */
    int status;                      /* set once, just before done */
    int64_t applied;                 /* atomic: the owner's progress (export reads it) */
    char *body;                      /* malloc'd (NULL when empty): the owner's until */
    size_t nbody;                    /*   done, then frozen */
    uint64_t client, seq;
    int64_t what[DD_WHAT_MAX];
    int nwhat;
    /* the table's links, under its lock; cl is NULL once the table dropped the entry */
    struct dd_client *cl;
    struct dd_entry *older, *newer;  /* the client's entries */
    struct dd_entry *hnext;          /* the (client, seq) hash chain */
    PyObject *face;                  /* borrowed: the live Python Entry, if any (GIL) */
};

struct dd_client {
    uint64_t id;
    struct dd_client *hnext;              /* the id hash chain */
    struct dd_client *older, *newer;      /* least recently seen first */
    struct dd_entry *oldest, *newest;
    size_t n;
};

struct dd_table {
    pthread_mutex_t mu;
    pthread_cond_t cond;                  /* an attempt ended: waiters look again */
    int waiting;                          /* broadcast only when someone waits */
    size_t window, max_clients;
    struct dd_entry **ebuckets;           /* power-of-two sizes: the mask picks a chain */
    size_t emask, nentries;
    struct dd_client **cbuckets;
    size_t cmask, nclients;
    struct dd_client *lru_oldest, *lru_newest;
    uint64_t trim_visits;                 /* entries the window's trim looked at (tests) */
};

/* ---- entries ---------------------------------------------------------------- */

static struct dd_entry *entry_new(uint64_t client, uint64_t seq, const int64_t *what, int nwhat)
{
    struct dd_entry *e = calloc(1, sizeof *e);
    if (e == NULL)
        return NULL;
    e->refs = 1;                          /* the caller's, handed to the table by file() */
    e->client = client;
    e->seq = seq;
    e->nwhat = nwhat;
    if (nwhat)
        memcpy(e->what, what, (size_t)nwhat * sizeof *what);
    return e;
}

void dd_entry_incref(struct dd_entry *e)
{
    __atomic_add_fetch(&e->refs, 1, __ATOMIC_RELAXED);
}

void dd_entry_decref(struct dd_entry *e)
{
    /* acq_rel: whoever frees sees every other holder's writes */
    if (e != NULL && __atomic_sub_fetch(&e->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        free(e->body);
        free(e);
    }
}

int dd_entry_owned(const struct dd_entry *e) { return LOAD(&e->owned); }
int dd_entry_done(const struct dd_entry *e) { return LOAD(&e->done); }
int dd_entry_status(const struct dd_entry *e) { return LOAD(&e->status); }
int64_t dd_entry_applied(const struct dd_entry *e) { return __atomic_load_n(&e->applied, __ATOMIC_RELAXED); }
void dd_entry_set_applied(struct dd_entry *e, int64_t applied) { __atomic_store_n(&e->applied, applied, __ATOMIC_RELAXED); }
uint64_t dd_entry_client(const struct dd_entry *e) { return e->client; }
uint64_t dd_entry_seq(const struct dd_entry *e) { return e->seq; }

const char *dd_entry_body(const struct dd_entry *e, size_t *n)
{
    *n = e->nbody;
    return e->body;
}

int dd_entry_what(const struct dd_entry *e, int64_t what[DD_WHAT_MAX])
{
    memcpy(what, e->what, sizeof e->what);
    return e->nwhat;
}

static int same_what(const struct dd_entry *e, const int64_t *what, int nwhat)
{
    return e->nwhat == nwhat && (nwhat == 0 || memcmp(e->what, what, (size_t)nwhat * sizeof *what) == 0);
}

/* ---- hash tables -------------------------------------------------------------- */

static inline uint64_t mix(uint64_t x)   /* splitmix64's finalizer: ids and seqs are not random */
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline size_t entry_slot(const struct dd_table *t, uint64_t client, uint64_t seq)
{
    return (size_t)mix(client ^ mix(seq)) & t->emask;
}

static inline size_t client_slot(const struct dd_table *t, uint64_t id)
{
    return (size_t)mix(id) & t->cmask;
}

/* Double a chain table once it holds more than one item per chain. A failed
 * allocation keeps the old one (longer chains, still right). */
static void grow_entries(struct dd_table *t)
{
    size_t n = (t->emask + 1) * 2;
    struct dd_entry **b = calloc(n, sizeof *b);
    if (b == NULL)
        return;
    size_t old = t->emask + 1;
    t->emask = n - 1;
    for (size_t i = 0; i < old; i++)
        for (struct dd_entry *e = t->ebuckets[i], *next; e != NULL; e = next) {
            next = e->hnext;
            size_t s = entry_slot(t, e->client, e->seq);
            e->hnext = b[s];
            b[s] = e;
        }
    free(t->ebuckets);
    t->ebuckets = b;
}

static void grow_clients(struct dd_table *t)
{
    size_t n = (t->cmask + 1) * 2;
    struct dd_client **b = calloc(n, sizeof *b);
    if (b == NULL)
        return;
    size_t old = t->cmask + 1;
    t->cmask = n - 1;
    for (size_t i = 0; i < old; i++)
        for (struct dd_client *c = t->cbuckets[i], *next; c != NULL; c = next) {
            next = c->hnext;
            size_t s = client_slot(t, c->id);
            c->hnext = b[s];
            b[s] = c;
        }
    free(t->cbuckets);
    t->cbuckets = b;
}

static struct dd_entry *find_entry(const struct dd_table *t, uint64_t client, uint64_t seq)
{
    struct dd_entry *e = t->ebuckets[entry_slot(t, client, seq)];
    while (e != NULL && (e->client != client || e->seq != seq))
        e = e->hnext;
    return e;
}

/* ---- the table's structure (all under its lock) ------------------------------ */

/* File a new entry as its client's newest: the table takes the caller's reference. */
static void file_entry(struct dd_table *t, struct dd_client *cl, struct dd_entry *e)
{
    size_t s = entry_slot(t, e->client, e->seq);
    e->hnext = t->ebuckets[s];
    t->ebuckets[s] = e;
    e->cl = cl;
    e->older = cl->newest;
    e->newer = NULL;
    if (cl->newest != NULL)
        cl->newest->newer = e;
    else
        cl->oldest = e;
    cl->newest = e;
    cl->n++;
    if (++t->nentries > t->emask + 1)
        grow_entries(t);
}

/* Unfile an entry and drop the table's reference (a caller's or a face's may remain). */
static void drop_entry(struct dd_table *t, struct dd_entry *e)
{
    struct dd_entry **p = &t->ebuckets[entry_slot(t, e->client, e->seq)];
    while (*p != e)
        p = &(*p)->hnext;
    *p = e->hnext;
    struct dd_client *cl = e->cl;
    if (e->older != NULL)
        e->older->newer = e->newer;
    else
        cl->oldest = e->newer;
    if (e->newer != NULL)
        e->newer->older = e->older;
    else
        cl->newest = e->older;
    cl->n--;
    t->nentries--;
    e->cl = NULL;
    e->older = e->newer = e->hnext = NULL;
    dd_entry_decref(e);
}

static void lru_unlink(struct dd_table *t, struct dd_client *cl)
{
    if (cl->older != NULL)
        cl->older->newer = cl->newer;
    else
        t->lru_oldest = cl->newer;
    if (cl->newer != NULL)
        cl->newer->older = cl->older;
    else
        t->lru_newest = cl->older;
}

static void lru_append(struct dd_table *t, struct dd_client *cl)
{
    cl->older = t->lru_newest;
    cl->newer = NULL;
    if (t->lru_newest != NULL)
        t->lru_newest->newer = cl;
    else
        t->lru_oldest = cl;
    t->lru_newest = cl;
}

/* Seen now: the client becomes the last to be forgotten. */
static void touch_client(struct dd_table *t, struct dd_client *cl)
{
    if (t->lru_newest != cl) {
        lru_unlink(t, cl);
        lru_append(t, cl);
    }
}

/* Forget a client and its entries (running ones too: their holders keep them). */
static void drop_client(struct dd_table *t, struct dd_client *cl)
{
    struct dd_client **p = &t->cbuckets[client_slot(t, cl->id)];
    while (*p != cl)
        p = &(*p)->hnext;
    *p = cl->hnext;
    lru_unlink(t, cl);
    t->nclients--;
    while (cl->oldest != NULL)
        drop_entry(t, cl->oldest);
    free(cl);
}

/* The client's record, made (as the most recently seen, forgetting the least recently
 * seen beyond max_clients) for a new one; NULL: out of memory. Does not touch an
 * existing client's place (seed() does not count as seeing it). */
static struct dd_client *get_client(struct dd_table *t, uint64_t id)
{
    struct dd_client *cl = t->cbuckets[client_slot(t, id)];
    while (cl != NULL && cl->id != id)
        cl = cl->hnext;
    if (cl != NULL)
        return cl;
    cl = calloc(1, sizeof *cl);
    if (cl == NULL)
        return NULL;
    cl->id = id;
    size_t s = client_slot(t, id);
    cl->hnext = t->cbuckets[s];
    t->cbuckets[s] = cl;
    lru_append(t, cl);
    if (++t->nclients > t->cmask + 1)
        grow_clients(t);
    while (t->nclients > t->max_clients)   /* max_clients >= 1: never the new one */
        drop_client(t, t->lru_oldest);
    return cl;
}

/* Forget the oldest finished entries beyond the window (running and interrupted ones
 * are kept). Looks from the oldest on and stops once it found enough: one or a few
 * entries per request, not the whole window (this runs under the table's lock). */
static void trim(struct dd_table *t, struct dd_client *cl)
{
    if (cl->n <= t->window)
        return;
    size_t extra = cl->n - t->window;
    for (struct dd_entry *e = cl->oldest, *newer; e != NULL && extra > 0; e = newer) {
        newer = e->newer;
        t->trim_visits++;
        if (e->done) {
            drop_entry(t, e);
            extra--;
        }
    }
}

static void wake(struct dd_table *t)
{
    if (t->waiting)
        pthread_cond_broadcast(&t->cond);
}

/* One look at (client, seq), under the lock: DD_FRESH or DD_DONE with a reference in
 * *out, DD_MISMATCH (the filed what in seen/nseen when given), DD_NOMEM, or
 * DD_TIMEOUT meaning "another attempt runs" (the caller waits or gives up). */
static int look(struct dd_table *t, uint64_t client, uint64_t seq, const int64_t *what, int nwhat,
                struct dd_entry **out, int64_t *seen, int *nseen)
{
    struct dd_client *cl = get_client(t, client);
    if (cl == NULL)
        return DD_NOMEM;
    touch_client(t, cl);
    struct dd_entry *e = find_entry(t, client, seq);
    if (e == NULL) {
        if ((e = entry_new(client, seq, what, nwhat)) == NULL)
            return DD_NOMEM;
        e->owned = 1;
        file_entry(t, cl, e);
        trim(t, cl);                   /* never the new entry: it runs */
        dd_entry_incref(e);
        *out = e;
        return DD_FRESH;
    }
    if (!same_what(e, what, nwhat)) {
        if (seen != NULL) {
            memcpy(seen, e->what, sizeof e->what);
            *nseen = e->nwhat;
        }
        return DD_MISMATCH;
    }
    if (e->done) {
        dd_entry_incref(e);
        *out = e;
        return DD_DONE;
    }
    if (!e->owned) {                   /* interrupted: the caller resumes it */
        STORE(&e->owned, 1);
        dd_entry_incref(e);
        *out = e;
        return DD_FRESH;
    }
    return DD_TIMEOUT;
}

/* dd_begin, with the filed what of a mismatch for the Python face's message. */
static int begin(struct dd_table *t, uint64_t client, uint64_t seq, const int64_t *what, int nwhat,
                 double timeout, struct dd_entry **out, int64_t *seen, int *nseen)
{
    *out = NULL;
    if (nwhat < 0 || nwhat > DD_WHAT_MAX)
        return DD_INVALID;
    int forever = timeout < 0, rc;
    struct timespec deadline = {0, 0};
    if (!forever && timeout > 0) {
        if (timeout > 1e9)             /* ~32 years: keeps tv_sec from overflowing */
            timeout = 1e9;
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        time_t sec = (time_t)timeout;
        deadline.tv_sec += sec;
        deadline.tv_nsec += (long)((timeout - (double)sec) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&t->mu);
    for (;;) {
        rc = look(t, client, seq, what, nwhat, out, seen, nseen);
        if (rc != DD_TIMEOUT || !(forever || timeout > 0))   /* 0 or NaN: no wait */
            break;
        t->waiting++;
        int err = forever ? pthread_cond_wait(&t->cond, &t->mu)
                          : pthread_cond_timedwait(&t->cond, &t->mu, &deadline);
        t->waiting--;
        if (err == ETIMEDOUT) {        /* one last look: it may have ended just now */
            rc = look(t, client, seq, what, nwhat, out, seen, nseen);
            break;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int dd_begin(struct dd_table *t, uint64_t client, uint64_t seq, const int64_t *what, int nwhat,
             double timeout, struct dd_entry **out)
{
    return begin(t, client, seq, what, nwhat, timeout, out, NULL, NULL);
}

static int copy_body(const char *body, size_t n, char **out)
{
    *out = NULL;
    if (n == 0)
        return 0;
    if ((*out = malloc(n)) == NULL)
        return -1;
    memcpy(*out, body, n);
    return 0;
}

int dd_finish(struct dd_table *t, struct dd_entry *e, int status, const char *body, size_t n)
{
    char *copy;
    if (copy_body(body, n, &copy) < 0)   /* allocate outside the lock */
        return -1;
    pthread_mutex_lock(&t->mu);
    if (e->done) {
        pthread_mutex_unlock(&t->mu);
        free(copy);
        return 1;
    }
    char *old = e->body;
    e->body = copy;
    e->nbody = n;
    STORE(&e->status, status);
    STORE(&e->owned, 0);
    STORE(&e->done, 1);                /* release: a reader that sees done sees the answer */
    wake(t);
    pthread_mutex_unlock(&t->mu);
    free(old);
    return 0;
}

void dd_interrupt(struct dd_table *t, struct dd_entry *e)
{
    pthread_mutex_lock(&t->mu);
    STORE(&e->owned, 0);
    wake(t);
    pthread_mutex_unlock(&t->mu);
}

int dd_entry_set_body(struct dd_table *t, struct dd_entry *e, const char *body, size_t n)
{
    char *copy;
    if (copy_body(body, n, &copy) < 0)
        return -1;
    pthread_mutex_lock(&t->mu);
    if (e->done) {                     /* a finished entry's body is its answer */
        pthread_mutex_unlock(&t->mu);
        free(copy);
        return -1;
    }
    char *old = e->body;
    e->body = copy;
    e->nbody = n;
    pthread_mutex_unlock(&t->mu);
    free(old);
    return 0;
}

static struct dd_table *table_new(void)
{
    struct dd_table *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->window = t->max_clients = 4096;
    t->emask = 63;
    t->cmask = 15;
    t->ebuckets = calloc(t->emask + 1, sizeof *t->ebuckets);
    t->cbuckets = calloc(t->cmask + 1, sizeof *t->cbuckets);
    pthread_condattr_t attr;
    int ok = t->ebuckets != NULL && t->cbuckets != NULL && pthread_condattr_init(&attr) == 0;
    if (ok) {
        /* waits are timed on the monotonic clock: a clock step neither cuts nor stretches them */
        ok = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0
             && pthread_cond_init(&t->cond, &attr) == 0;
        pthread_condattr_destroy(&attr);
        if (ok && pthread_mutex_init(&t->mu, NULL) != 0) {
            pthread_cond_destroy(&t->cond);
            ok = 0;
        }
    }
    if (!ok) {
        free(t->ebuckets);
        free(t->cbuckets);
        free(t);
        return NULL;
    }
    return t;
}

/* No one waits or holds the lock any more (the Python object is going). */
static void table_free(struct dd_table *t)
{
    while (t->lru_oldest != NULL)
        drop_client(t, t->lru_oldest);
    free(t->ebuckets);
    free(t->cbuckets);
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* ---- the Python faces ----------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    struct dd_table *t;
} TableObject;

typedef struct {
    PyObject_HEAD
    struct dd_entry *e;    /* a reference */
    PyObject *table;       /* the TableObject it came from: finish() goes through it */
} EntryObject;

static PyTypeObject TableType, EntryType;
static PyObject *str_finish, *zero, *empty;   /* "_finish", 0, b"" */

static struct dd_table *table_of_entry(EntryObject *f)
{
    return ((TableObject *)f->table)->t;
}

struct dd_table *dd_table_of(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &TableType)) {
        PyErr_Format(PyExc_TypeError, "a DedupTable is needed, not %.100s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((TableObject *)obj)->t;
}

/* Fast-call arguments, by position or keyword, into out[] (NULL: not given); -1 with
 * Python's TypeError for a wrong call. */
static int parse_args(const char *fn, const char *const *names, int nnames, int nrequired,
                      PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, nnames, nargs);
        return -1;
    }
    for (int i = 0; i < nnames; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < nnames && PyUnicode_CompareWithASCIIString(key, names[i]) != 0)
            i++;
        if (i == nnames) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < nrequired; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    return 0;
}

static int as_u64(PyObject *o, uint64_t *out)
{
    PyObject *n = PyNumber_Index(o);
    if (n == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int as_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int as_int(PyObject *o, int *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "status out of range");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int as_what(PyObject *o, int64_t *what, int *n)
{
    PyObject *seq = PySequence_Fast(o, "what must be a sequence of integers");
    if (seq == NULL)
        return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k > DD_WHAT_MAX) {
        PyErr_Format(PyExc_ValueError, "what holds at most %d integers, not %zd", DD_WHAT_MAX, k);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++)
        if (as_i64(PySequence_Fast_GET_ITEM(seq, i), &what[i]) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    *n = (int)k;
    Py_DECREF(seq);
    return 0;
}

static PyObject *what_tuple(const int64_t *what, int n)
{
    PyObject *tup = PyTuple_New(n);
    if (tup == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(what[i]);
        if (v == NULL) {
            Py_DECREF(tup);
            return NULL;
        }
        PyTuple_SET_ITEM(tup, i, v);
    }
    return tup;
}

/* The one face of an entry, made if it has none; takes over the caller's reference
 * on e (with the interpreter lock). */
static PyObject *face_of(PyObject *table, struct dd_entry *e)
{
    if (e->face == NULL) {
        EntryObject *f = PyObject_GC_New(EntryObject, &EntryType);
        if (f == NULL) {
            dd_entry_decref(e);
            return NULL;
        }
        f->e = NULL;
        f->table = NULL;
        if (e->face != NULL)      /* the allocation ran a collection, whose Python made one */
            Py_DECREF(f);
        else {
            f->e = e;             /* the caller's reference becomes the face's */
            f->table = Py_NewRef(table);
            e->face = (PyObject *)f;
            PyObject_GC_Track(f);
            return (PyObject *)f;
        }
    }
    PyObject *face = Py_NewRef(e->face);
    dd_entry_decref(e);           /* the face holds its own */
    return face;
}

/* ---- Entry ---- */

static void Entry_dealloc(EntryObject *f)
{
    PyObject_GC_UnTrack(f);
    if (f->e != NULL) {
        if (f->e->face == (PyObject *)f)
            f->e->face = NULL;
        dd_entry_decref(f->e);
    }
    Py_XDECREF(f->table);
    PyObject_GC_Del(f);
}

/* an entry refers to its table, whose __dict__ (a Python subclass's) may refer to it */
static int Entry_traverse(EntryObject *f, visitproc visit, void *arg)
{
    Py_VISIT(f->table);
    return 0;
}

static PyObject *Entry_get_owned(EntryObject *f, void *c) { (void)c; return PyBool_FromLong(dd_entry_owned(f->e)); }
static PyObject *Entry_get_done(EntryObject *f, void *c) { (void)c; return PyBool_FromLong(dd_entry_done(f->e)); }
static PyObject *Entry_get_status(EntryObject *f, void *c) { (void)c; return PyLong_FromLong(dd_entry_status(f->e)); }
static PyObject *Entry_get_applied(EntryObject *f, void *c) { (void)c; return PyLong_FromLongLong(dd_entry_applied(f->e)); }
static PyObject *Entry_get_what(EntryObject *f, void *c) { (void)c; return what_tuple(f->e->what, f->e->nwhat); }

static int Entry_set_applied(EntryObject *f, PyObject *v, void *c)
{
    (void)c;
    int64_t applied;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete applied");
        return -1;
    }
    if (as_i64(v, &applied) < 0)
        return -1;
    dd_entry_set_applied(f->e, applied);
    return 0;
}

static PyObject *Entry_get_body(EntryObject *f, void *c)
{
    (void)c;
    struct dd_entry *e = f->e;
    if (dd_entry_done(e))              /* final: no lock needed */
        return PyBytes_FromStringAndSize(e->body, (Py_ssize_t)e->nbody);
    /* an owner (a C thread, maybe) may change it: copy it under the lock, make the
     * bytes object after */
    struct dd_table *t = table_of_entry(f);
    char *copy;
    size_t n;
    pthread_mutex_lock(&t->mu);
    n = e->nbody;
    int failed = copy_body(e->body, n, &copy);
    pthread_mutex_unlock(&t->mu);
    if (failed)
        return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(copy, (Py_ssize_t)n);
    free(copy);
    return out;
}

static int Entry_set_body(EntryObject *f, PyObject *v, void *c)
{
    (void)c;
    Py_buffer view;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete body");
        return -1;
    }
    if (PyObject_GetBuffer(v, &view, PyBUF_SIMPLE) < 0)
        return -1;
    int rc = dd_entry_set_body(table_of_entry(f), f->e, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (rc < 0) {
        if (dd_entry_done(f->e))
            PyErr_SetString(PyExc_AttributeError, "a finished entry's body is its answer: it cannot change");
        else
            PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *Entry_repr(EntryObject *f)
{
    PyObject *what = Entry_get_what(f, NULL), *body = what ? Entry_get_body(f, NULL) : NULL, *out = NULL;
    if (body != NULL)
        out = PyUnicode_FromFormat("Entry(owned=%s, done=%s, what=%R, applied=%lld, status=%d, body=%R)",
                                   dd_entry_owned(f->e) ? "True" : "False",
                                   dd_entry_done(f->e) ? "True" : "False", what,
                                   (long long)dd_entry_applied(f->e), dd_entry_status(f->e), body);
    Py_XDECREF(what);
    Py_XDECREF(body);
    return out;
}

/* finish(status=0, body=b""): through the table's _finish, looked up each time (as
 * the Python class did), so that a test may wrap it on the table. */
static PyObject *Entry_finish(EntryObject *f, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"status", "body"};
    PyObject *a[2];
    if (parse_args("finish", names, 2, 0, args, nargs, kwnames, a) < 0)
        return NULL;
    PyObject *call[4] = {f->table, (PyObject *)f, a[0] ? a[0] : zero, a[1] ? a[1] : empty};
    return PyObject_VectorcallMethod(str_finish, call, 4, NULL);
}

static PyGetSetDef Entry_getset[] = {
    {"owned", (getter)Entry_get_owned, NULL, "True while an attempt runs it", NULL},
    {"done", (getter)Entry_get_done, NULL, "True once finished: status and body are its answer", NULL},
    {"what", (getter)Entry_get_what, NULL, "the request it was filed for (a tuple of ints)", NULL},
    {"applied", (getter)Entry_get_applied, (setter)Entry_set_applied,
     "payload bytes that took effect (a retry resumes after them)", NULL},
    {"status", (getter)Entry_get_status, NULL, "the answer's status code", NULL},
    {"body", (getter)Entry_get_body, (setter)Entry_set_body,
     "the answer's body (set by its owner before finishing)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Entry_methods[] = {
    {"finish", (PyCFunction)(void (*)(void))Entry_finish, METH_FASTCALL | METH_KEYWORDS,
     "finish(status=0, body=b'')\n--\n\nThe attempt's answer: repeats get it, waiters wake."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_server.memserver._native.Entry",
    .tp_basicsize = sizeof(EntryObject),
    .tp_dealloc = (destructor)Entry_dealloc,
    .tp_repr = (reprfunc)Entry_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One request's state in a DedupTable: running (owned, not done), interrupted\n"
              "(neither; applied bytes took effect) or finished (status, body). Made by\n"
              "DedupTable.begin only; one object per entry while it is alive.",
    .tp_traverse = (traverseproc)Entry_traverse,
    .tp_methods = Entry_methods,
    .tp_getset = Entry_getset,
};

/* ---- DedupTable ---- */

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    TableObject *self = (TableObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if ((self->t = table_new()) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int Table_init(TableObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"window", "max_clients", NULL};
    Py_ssize_t window = 4096, max_clients = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|nn:DedupTable", names, &window, &max_clients))
        return -1;
    if (window < 1 || max_clients < 1) {
        PyErr_SetString(PyExc_ValueError, "window and max_clients must be positive");
        return -1;
    }
    pthread_mutex_lock(&self->t->mu);
    self->t->window = (size_t)window;
    self->t->max_clients = (size_t)max_clients;
    pthread_mutex_unlock(&self->t->mu);
    return 0;
}

static void Table_dealloc(TableObject *self)
{
    if (self->t != NULL)
        table_free(self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* begin(client, seq, timeout=None, what=()) -> (fresh, entry) */
static PyObject *Table_begin(TableObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"client", "seq", "timeout", "what"};
    PyObject *a[4];
    uint64_t client, seq;
    int64_t what[DD_WHAT_MAX], seen[DD_WHAT_MAX];
    int nwhat = 0, nseen = 0;
    double timeout = -1;               /* None: for ever */
    if (parse_args("begin", names, 4, 2, args, nargs, kwnames, a) < 0
        || as_u64(a[0], &client) < 0 || as_u64(a[1], &seq) < 0
        || (a[3] != NULL && as_what(a[3], what, &nwhat) < 0))
        return NULL;
    if (a[2] != NULL && a[2] != Py_None) {
        timeout = PyFloat_AsDouble(a[2]);
        if (timeout == -1 && PyErr_Occurred())
            return NULL;
        if (!(timeout > 0))            /* as threading's waits: 0 or less does not wait */
            timeout = 0;
    }
    struct dd_entry *e;
    /* a first look without waiting, keeping the interpreter lock (the usual case);
     * a wait gives it up, or the attempt waited for could never end */
    int rc = begin(self->t, client, seq, what, nwhat, 0, &e, seen, &nseen);
    if (rc == DD_TIMEOUT && timeout != 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = begin(self->t, client, seq, what, nwhat, timeout, &e, seen, &nseen);
        Py_END_ALLOW_THREADS
    }
    if (rc == DD_FRESH || rc == DD_DONE) {
        PyObject *face = face_of((PyObject *)self, e);
        if (face == NULL)
            return NULL;
        PyObject *out = PyTuple_Pack(2, rc == DD_FRESH ? Py_True : Py_False, face);
        Py_DECREF(face);
        return out;
    }
    char s[24], c[24];
    snprintf(s, sizeof s, "%" PRIu64, seq);
    snprintf(c, sizeof c, "0x%" PRIx64, client);
    if (rc == DD_TIMEOUT)
        PyErr_Format(PyExc_TimeoutError, "request %s of client %s is still running", s, c);
    else if (rc == DD_MISMATCH) {
        PyObject *was = what_tuple(seen, nseen), *now = a[3] != NULL ? Py_NewRef(a[3]) : PyTuple_New(0);
        if (was != NULL && now != NULL)
            PyErr_Format(PyExc_ValueError, "request %s of client %s was %S, now %S: "
                         "a sequence number names one request", s, c, was, now);
        Py_XDECREF(was);
        Py_XDECREF(now);
    } else
        PyErr_NoMemory();
    return NULL;
}

static EntryObject *entry_arg(PyObject *o)
{
    if (!PyObject_TypeCheck(o, &EntryType)) {
        PyErr_Format(PyExc_TypeError, "an Entry is needed, not %.100s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    return (EntryObject *)o;
}

/* _finish(entry, status, body): Entry.finish's work (on the entry's own table) */
static PyObject *Table_finish(TableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int status;
    Py_buffer view;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "_finish() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    EntryObject *f = entry_arg(args[0]);
    if (f == NULL || as_int(args[1], &status) < 0 || PyObject_GetBuffer(args[2], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = dd_finish(table_of_entry(f), f->e, status, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_interrupt(TableObject *self, PyObject *arg)
{
    (void)self;
    EntryObject *f = entry_arg(arg);
    if (f == NULL)
        return NULL;
    dd_interrupt(table_of_entry(f), f->e);
    Py_RETURN_NONE;
}

/* An extent id as the int64 a what holds; 0 with *none set for one no what can hold. */
static int as_extent(PyObject *o, int64_t *out, int *none)
{
    int overflow;
    *none = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *none = overflow != 0;
    *out = v;
    return 0;
}

static int of_extent(const struct dd_entry *e, int64_t extent)
{
    return e->nwhat == 5 && e->what[1] == extent;
}

struct record {              /* one exported entry, copied under the lock */
    uint64_t client, seq;
    int64_t what[DD_WHAT_MAX], applied;
    int nwhat, done, status;
    char *body;
    size_t nbody;
};

static void free_records(struct record *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(r[i].body);
    free(r);
}

static PyObject *Table_export(TableObject *self, PyObject *arg)
{
    int64_t extent;
    int none;
    if (as_extent(arg, &extent, &none) < 0)
        return NULL;
    struct dd_table *t = self->t;
    struct record *r = NULL;
    size_t n = 0, cap = 0;
    int failed = 0;
    pthread_mutex_lock(&t->mu);
    for (struct dd_client *cl = t->lru_oldest; cl != NULL && !none && !failed; cl = cl->newer)
        for (struct dd_entry *e = cl->oldest; e != NULL && !failed; e = e->newer) {
            if (!of_extent(e, extent) || !(e->done || (dd_entry_applied(e) && !e->owned)))
                continue;
            if (n == cap) {
                struct record *more = realloc(r, (cap = cap ? 2 * cap : 16) * sizeof *r);
                if (more == NULL) {
                    failed = 1;
                    break;
                }
                r = more;
            }
            struct record *x = &r[n];
            *x = (struct record){e->client, e->seq, {0}, dd_entry_applied(e), e->nwhat, e->done, e->status, NULL, e->nbody};
            memcpy(x->what, e->what, sizeof e->what);
            if (copy_body(e->body, e->nbody, &x->body) < 0)
                failed = 1;
            else
                n++;
        }
    pthread_mutex_unlock(&t->mu);
    if (failed) {
        free_records(r, n);
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        struct record *x = &r[i];
        PyObject *item = Py_BuildValue("(KKNLNiy#)", (unsigned long long)x->client, (unsigned long long)x->seq,
                                       what_tuple(x->what, x->nwhat), (long long)x->applied,
                                       PyBool_FromLong(x->done), x->status,
                                       x->body ? x->body : "", (Py_ssize_t)x->nbody);   /* y# of NULL is None */
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    free_records(r, n);
    return out;
}

static PyObject *Table_forget(TableObject *self, PyObject *arg)
{
    int64_t extent;
    int none;
    if (as_extent(arg, &extent, &none) < 0)
        return NULL;
    struct dd_table *t = self->t;
    size_t dropped = 0;
    pthread_mutex_lock(&t->mu);
    for (struct dd_client *cl = t->lru_oldest; cl != NULL && !none; cl = cl->newer)
        for (struct dd_entry *e = cl->oldest, *newer; e != NULL; e = newer) {
            newer = e->newer;
            if (of_extent(e, extent)) {
                drop_entry(t, e);
                dropped++;
            }
        }
    pthread_mutex_unlock(&t->mu);
    return PyLong_FromSize_t(dropped);
}

/* One handed-over record (client, seq, what, applied, done, status, body) filed
 * unless the table has its (client, seq): 1 taken, 0 not, -1 an error. */
static int seed_one(struct dd_table *t, PyObject *rec)
{
    PyObject *seq_ = PySequence_Fast(rec, "a record must be a sequence");
    if (seq_ == NULL)
        return -1;
    PyObject **f = PySequence_Fast_ITEMS(seq_);
    uint64_t client, seq;
    int64_t what[DD_WHAT_MAX], applied;
    int nwhat, done = 0, status, rc = -1;
    Py_buffer view;
    if (PySequence_Fast_GET_SIZE(seq_) != 7)
        PyErr_Format(PyExc_ValueError, "a record has 7 fields, not %zd", PySequence_Fast_GET_SIZE(seq_));
    else if (as_u64(f[0], &client) == 0 && as_u64(f[1], &seq) == 0 && as_what(f[2], what, &nwhat) == 0
             && as_i64(f[3], &applied) == 0 && (done = PyObject_IsTrue(f[4])) >= 0 && as_int(f[5], &status) == 0
             && PyObject_GetBuffer(f[6], &view, PyBUF_SIMPLE) == 0) {
        struct dd_entry *e = entry_new(client, seq, what, nwhat);
        if (e == NULL || copy_body(view.buf, (size_t)view.len, &e->body) < 0) {
            dd_entry_decref(e);
            PyErr_NoMemory();
        } else {
            e->nbody = (size_t)view.len;
            e->applied = applied;
            e->status = status;
            e->done = done;            /* owned stays 0: finished or interrupted as it was */
            pthread_mutex_lock(&t->mu);
            struct dd_client *cl = get_client(t, client);
            if (cl != NULL && find_entry(t, client, seq) == NULL) {
                file_entry(t, cl, e);
                trim(t, cl);
                e = NULL;
                rc = 1;
            } else
                rc = cl != NULL ? 0 : -1;
            pthread_mutex_unlock(&t->mu);
            dd_entry_decref(e);        /* not filed: freed */
            if (rc < 0)
                PyErr_NoMemory();
        }
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq_);
    return rc;
}

static PyObject *Table_seed(TableObject *self, PyObject *records)
{
    PyObject *it = PyObject_GetIter(records), *rec;
    if (it == NULL)
        return NULL;
    Py_ssize_t taken = 0;
    int failed = 0;
    /* one record at a time, each under the lock for its filing only: the iterator is
     * Python, which may not run under it */
    while (!failed && (rec = PyIter_Next(it)) != NULL) {
        int rc = seed_one(self->t, rec);
        Py_DECREF(rec);
        if (rc < 0)
            failed = 1;
        else
            taken += rc;
    }
    Py_DECREF(it);
    pthread_mutex_lock(&self->t->mu);
    wake(self->t);                     /* an interrupted entry arrived: a waiter may resume it */
    pthread_mutex_unlock(&self->t->mu);
    if (failed || PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(taken);
}

static Py_ssize_t Table_len(TableObject *self)
{
    pthread_mutex_lock(&self->t->mu);
    size_t n = self->t->nentries;
    pthread_mutex_unlock(&self->t->mu);
    return (Py_ssize_t)n;
}

static PyObject *Table_get_window(TableObject *self, void *c) { (void)c; return PyLong_FromSize_t(self->t->window); }
static PyObject *Table_get_max_clients(TableObject *self, void *c) { (void)c; return PyLong_FromSize_t(self->t->max_clients); }

static PyObject *Table_get_trim_visits(TableObject *self, void *c)
{
    (void)c;
    pthread_mutex_lock(&self->t->mu);
    uint64_t n = self->t->trim_visits;
    pthread_mutex_unlock(&self->t->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyGetSetDef Table_getset[] = {
    {"window", (getter)Table_get_window, NULL, "finished entries remembered per client", NULL},
    {"max_clients", (getter)Table_get_max_clients, NULL, "clients remembered", NULL},
    {"_trim_visits", (getter)Table_get_trim_visits, NULL, "entries the window's trims looked at", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Table_methods[] = {
    {"begin", (PyCFunction)(void (*)(void))Table_begin, METH_FASTCALL | METH_KEYWORDS,
     "begin(client, seq, timeout=None, what=())\n--\n\n(fresh, entry): see smb_server.memserver.dedup."},
    {"_finish", (PyCFunction)(void (*)(void))Table_finish, METH_FASTCALL,
     "_finish(entry, status, body)\n--\n\nEntry.finish's work."},
    {"interrupt", (PyCFunction)Table_interrupt, METH_O,
     "interrupt(entry)\n--\n\nThe attempt stopped part way (entry.applied bytes in effect): a retry resumes it."},
    {"export", (PyCFunction)Table_export, METH_O,
     "export(extent_id)\n--\n\nThe records of the entries on extent_id that took effect."},
    {"forget", (PyCFunction)Table_forget, METH_O,
     "forget(extent_id)\n--\n\nDrop the entries of requests on extent_id; how many."},
    {"seed", (PyCFunction)Table_seed, METH_O,
     "seed(records)\n--\n\nFile handed-over records the table does not have; how many."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_server.memserver._native.DedupTable",
    .tp_basicsize = sizeof(TableObject),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_as_sequence = &Table_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "DedupTable(window=4096, max_clients=4096)\n--\n\n"
              "The exactly-once table (smb_server.memserver.dedup.DedupTable adds once()).",
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_init = (initproc)Table_init,
    .tp_new = Table_new,
};

int dedup_register(PyObject *module)
{
    if (str_finish == NULL) {
        if ((str_finish = PyUnicode_InternFromString("_finish")) == NULL
            || (zero = PyLong_FromLong(0)) == NULL
            || (empty = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
            return -1;
    }
    if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&TableType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Entry", (PyObject *)&EntryType) < 0
        || PyModule_AddObjectRef(module, "DedupTable", (PyObject *)&TableType) < 0)
        return -1;
    return 0;
}
