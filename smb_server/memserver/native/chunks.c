/* An extent's lock, and a collective chunk's round step under it.
 *
 * Mutex is the lock of an extent (smb_server/memserver/extent.py, ``Extent.lock``): a
 * pthread mutex, so that native code running without the interpreter (a chunk's step
 * here, the request loops to come) and Python code serialize on the same lock. Taken
 * from Python it is first tried without letting the interpreter go (the common,
 * uncontended case costs no thread switch); when it is held, the interpreter is
 * released while waiting, so the holder, which may need the interpreter to finish, is
 * never blocked by the waiter.
 *
 * push_step applies one push of a collective's chunk (smb_server/memserver/collective_ops.py)
 * in one call: under the extent's lock it reads the slot's count word, admits the push
 * by the round rules (smb_protocol/_rounds.h), stores or adds the chunk (widening a
 * 16-bit push into its float32 slot) with smb_protocol._native's kernels, and stores
 * the new count word after the sum (a pull reads the word without the lock, then the
 * sum). The interpreter is released for the whole step: the lock's wait, the bytes
 * work and the count. pull_count counts a pull under the lock the same way.
 */
#include "native.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_native.h"
#include "_rounds.h"

static const struct smb_kernels *kernels;   /* smb_protocol._native's, imported once */

/* -- Mutex ------------------------------------------------------------------------ */

/* The mutex itself is reference counted apart from its Python object: native code that
 * keeps using it after the object may have gone (a connection's sends from other
 * threads, serve.c) holds a reference (smb_mutex_hold). */
struct smb_mutex {
    atomic_int refs;
    pthread_mutex_t mu;   /* error-checking: a release by another thread, or a second take by
                           * the holder, is refused (RuntimeError) instead of undefined */
};

typedef struct {
    PyObject_HEAD
    struct smb_mutex *m;
} MutexObject;

struct smb_mutex *smb_mutex_hold(PyObject *obj)
{
    struct smb_mutex *m = ((MutexObject *)obj)->m;
    atomic_fetch_add(&m->refs, 1);
    return m;
}

void smb_mutex_drop(struct smb_mutex *m)
{
    if (m != NULL && atomic_fetch_sub(&m->refs, 1) == 1) {
        pthread_mutex_destroy(&m->mu);
        free(m);
    }
}

static PyObject *mutex_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"recursive", NULL};
    int recursive = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:Mutex", names, &recursive))
        return NULL;
    MutexObject *self = (MutexObject *)type->tp_alloc(type, 0);
    if (self != NULL && (self->m = calloc(1, sizeof *self->m)) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    if (self != NULL) {
        atomic_init(&self->m->refs, 1);
        pthread_mutexattr_t attr;
        pthread_mutexattr_init(&attr);
        /* a recursive one: a connection's send lock, taken again by the thread that holds it */
        pthread_mutexattr_settype(&attr, recursive ? PTHREAD_MUTEX_RECURSIVE : PTHREAD_MUTEX_ERRORCHECK);
        pthread_mutex_init(&self->m->mu, &attr);
        pthread_mutexattr_destroy(&attr);
    }
    return (PyObject *)self;
}

static void mutex_dealloc(MutexObject *self)
{
    smb_mutex_drop(self->m);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int held_by_caller(int rc)
{
    if (rc != EDEADLK)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "this thread holds the extent's lock already");
    return 1;
}

/* Take ``mu`` with the interpreter held by the caller: tried first, then waited for
 * with the interpreter released (``timeout`` < 0: without end). 1 taken, 0 not, -1
 * with RuntimeError set (the caller holds it already). */
static int lock_taking(pthread_mutex_t *mu, double timeout)
{
    int rc = pthread_mutex_trylock(mu);
    if (rc == 0)
        return 1;
    if (timeout == 0)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    if (timeout < 0) {
        rc = pthread_mutex_lock(mu);
    } else {
        struct timespec end;
        clock_gettime(CLOCK_REALTIME, &end);   /* timedlock counts on the realtime clock */
        double whole = (double)(time_t)timeout;
        end.tv_sec += (time_t)timeout;
        end.tv_nsec += (long)((timeout - whole) * 1e9);
        if (end.tv_nsec >= 1000000000L) {
            end.tv_sec += 1;
            end.tv_nsec -= 1000000000L;
        }
        rc = pthread_mutex_timedlock(mu, &end);
    }
    Py_END_ALLOW_THREADS
    return rc == 0 ? 1 : held_by_caller(rc) ? -1 : 0;
}

static PyObject *mutex_acquire(MutexObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    if (!blocking)
        timeout = 0;
    int taken = lock_taking(&self->m->mu, timeout);
    return taken < 0 ? NULL : PyBool_FromLong(taken);
}

static PyObject *mutex_enter(MutexObject *self, PyObject *Py_UNUSED(args))
{
    return lock_taking(&self->m->mu, -1) < 0 ? NULL : Py_NewRef(self);
}

static PyObject *mutex_release(MutexObject *self, PyObject *Py_UNUSED(args))
{
    if (pthread_mutex_unlock(&self->m->mu) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "release of an extent lock this thread does not hold");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *mutex_exit(MutexObject *self, PyObject *Py_UNUSED(args))
{
    return mutex_release(self, NULL);
}

static PyObject *mutex_locked(MutexObject *self, PyObject *Py_UNUSED(args))
{
    int rc = pthread_mutex_trylock(&self->m->mu);
    if (rc == 0)
        pthread_mutex_unlock(&self->m->mu);
    return PyBool_FromLong(rc != 0);
}

static PyMethodDef mutex_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))mutex_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1)\n--\n\nTake the lock; False when not taken in time."},
    {"release", (PyCFunction)mutex_release, METH_NOARGS, "Let the lock go (the thread that took it)."},
    {"locked", (PyCFunction)mutex_locked, METH_NOARGS, "Whether the lock is held."},
    {"__enter__", (PyCFunction)mutex_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)mutex_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_server.memserver._native.Mutex",
    .tp_doc = "Mutex(recursive=False)\n--\n\nA lock shared by Python and native code (a pthread "
              "mutex; the interpreter is released while a taker waits): an extent's, or with "
              "recursive a connection's send lock. Released by the thread that took it.",
    .tp_basicsize = sizeof(MutexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = mutex_new,
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_methods = mutex_methods,
};

/* -- the chunk's steps ------------------------------------------------------------ */

/* The count word at ``word`` of ``data``, checked to lie inside and be aligned. */
static int64_t *count_at(Py_buffer *data, long long word)
{
    if (word < 0 || word % 8 || word > data->len - 8) {
        PyErr_Format(PyExc_ValueError, "count word at %lld outside %zd bytes or misaligned", word, data->len);
        return NULL;
    }
    return (int64_t *)((char *)data->buf + word);
}

/* the collective pushes that took their step (chunk_push) in this process, admitted or
 * not, and those of them that found the extent's lock held (by another push of the
 * chunk, or anything else under that lock): at most these could have been summed in
 * one pass with another push (push_counts; docs/benchmarks.md, "Summing several
 * pushes in one pass") */
static atomic_llong pushes, pushes_waited;

/* One push under the extent's lock ``mu``, run without the interpreter: the count word
 * at ``count`` admits it (*step, the word found in *old, *value as round_admit_push's);
 * an admitted push stores (R_START) or adds ``nbytes`` of ``src`` into ``dst``, widened
 * from 16 bits where ``wire_code`` says, then stores the new word. Types and bounds
 * are the caller's to check. Returns 0, or the lock's error (nothing done). */
int chunk_push(pthread_mutex_t *mu, int64_t *count, void *dst, const void *src, ptrdiff_t nbytes,
               int slot_code, int wire_code, int64_t parties, int64_t round, int root,
               int *step, int64_t *old, int64_t *value)
{
    int rc = pthread_mutex_trylock(mu), waited = rc == EBUSY;
    if (waited)
        rc = pthread_mutex_lock(mu);
    if (rc != 0)
        return rc;
    atomic_fetch_add_explicit(&pushes, 1, memory_order_relaxed);
    if (waited)
        atomic_fetch_add_explicit(&pushes_waited, 1, memory_order_relaxed);
    *old = __atomic_load_n(count, __ATOMIC_ACQUIRE);
    *step = round_admit_push(*old, parties, round, root, value);
    if (*step == R_START || *step == R_JOIN) {
        ptrdiff_t n = nbytes / kernels->item_size(wire_code ? wire_code : slot_code);
        if (wire_code)
            kernels->widen(dst, src, *step == R_JOIN ? 1.0 : 0.0, wire_code, n);
        else if (*step == R_START)
            memcpy(dst, src, (size_t)nbytes);
        else
            kernels->add(dst, src, 0.0, slot_code, n);
        __atomic_store_n(count, *value, __ATOMIC_RELEASE);   /* after the sum: pulls read without the lock */
    }
    pthread_mutex_unlock(mu);
    return 0;
}

PyDoc_STRVAR(push_step_doc,
"push_step(lock, data, word, slot, src, slot_code, wire_code, parties, round, root)\n--\n\n"
"One push of a collective's chunk into extent memory ``data`` (a writable buffer): under\n"
"``lock`` (a Mutex), the count word at byte ``word`` admits the push of ``round`` for\n"
"``parties`` (``root``: a broadcast root's); an admitted push stores (the round's first)\n"
"or adds ``src`` into the slot at byte ``slot`` (``wire_code`` not 0: 16-bit elements\n"
"widened into the float32 slot), then the new count word is stored. Returns\n"
"``(step, old, value)``: step R_START/R_JOIN (value the new word), R_WAIT (nothing\n"
"done; value the word to wait for) or a negative refusal code (nothing done; see\n"
"smb_protocol/rounds.py). The interpreter is released for the whole step.");

static PyObject *py_push_step(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *lock;
    Py_buffer data, src;
    long long word, slot, parties, round;
    int slot_code, wire_code, root;
    if (!PyArg_ParseTuple(args, "O!w*LLy*iiLLp", &MutexType, &lock, &data, &word, &slot, &src,
                          &slot_code, &wire_code, &parties, &round, &root))
        return NULL;
    PyObject *result = NULL;
    int64_t *count = count_at(&data, word);
    ptrdiff_t item = kernels->item_size(wire_code ? wire_code : slot_code);
    ptrdiff_t n = item ? src.len / item : 0;
    ptrdiff_t span = wire_code ? n * 4 : src.len;
    if (count == NULL)
        goto done;
    if (!item || src.len % item || parties < 1 ||
        (wire_code && (slot_code != T_F32 || (wire_code != T_F16 && wire_code != T_BF16)))) {
        PyErr_Format(PyExc_ValueError, "a push of %zd bytes of type %d into a slot of type %d", src.len,
                     wire_code, slot_code);
        goto done;
    }
    if (slot < 0 || slot > data.len - span || (word < slot + span && slot < word + 8)) {
        PyErr_Format(PyExc_ValueError, "slot [%lld, +%zd) outside %zd bytes or over its count word", slot,
                     span, data.len);
        goto done;
    }
    int64_t old = 0, value = 0;
    int step = 0, rc;
    Py_BEGIN_ALLOW_THREADS
    rc = chunk_push(&((MutexObject *)lock)->m->mu, count, (char *)data.buf + slot, src.buf, src.len, slot_code,
                    wire_code, parties, round, root, &step, &old, &value);
    Py_END_ALLOW_THREADS
    if (rc == 0)
        result = Py_BuildValue("iLL", step, (long long)old, (long long)value);
    else if (!held_by_caller(rc))
        PyErr_Format(PyExc_RuntimeError, "an extent lock failed (errno %d)", rc);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&src);
    return result;
}

/* Count a pull on the count word ``count``, under the extent's lock (the caller's);
 * returns the word before. */
int64_t chunk_pull_counted(int64_t *count)
{
    int64_t old = __atomic_load_n(count, __ATOMIC_ACQUIRE);
    __atomic_store_n(count, (int64_t)((uint64_t)old + 1), __ATOMIC_RELEASE);
    return old;
}

PyDoc_STRVAR(pull_count_doc,
"pull_count(lock, data, word)\n--\n\n"
"Count a pull: add one to the count word at byte ``word`` of ``data`` under ``lock``;\n"
"returns the word before.");

static PyObject *py_pull_count(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *lock;
    Py_buffer data;
    long long word;
    if (!PyArg_ParseTuple(args, "O!w*L", &MutexType, &lock, &data, &word))
        return NULL;
    int64_t *count = count_at(&data, word);
    PyObject *result = NULL;
    if (count != NULL) {
        MutexObject *mu = (MutexObject *)lock;
        int64_t old;
        if (lock_taking(&mu->m->mu, -1) > 0) {
            old = chunk_pull_counted(count);
            pthread_mutex_unlock(&mu->m->mu);
            result = PyLong_FromLongLong(old);
        }
    }
    PyBuffer_Release(&data);
    return result;
}

PyDoc_STRVAR(push_counts_doc,
"push_counts()\n--\n\n"
"``(pushes, waited)``: the collective pushes that took their step in this process\n"
"(push_step and the native loop, admitted or not), and how many of them found their\n"
"extent's lock held and waited for it.");

static PyObject *py_push_counts(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args))
{
    return Py_BuildValue("LL", (long long)atomic_load(&pushes), (long long)atomic_load(&pushes_waited));
}

PyTypeObject *smb_mutex_type = &MutexType;

pthread_mutex_t *smb_mutex_of(struct smb_mutex *m)
{
    return &m->mu;
}

static PyMethodDef chunk_methods[] = {
    {"push_step", py_push_step, METH_VARARGS, push_step_doc},
    {"pull_count", py_pull_count, METH_VARARGS, pull_count_doc},
    {"push_counts", py_push_counts, METH_NOARGS, push_counts_doc},
    {NULL, NULL, 0, NULL},
};

int chunks_register(PyObject *module)
{
    /* PyCapsule_Import finds the capsule as an attribute: the module must be imported */
    PyObject *owner = PyImport_ImportModule("smb_protocol._native");
    if (owner == NULL)
        return -1;
    Py_DECREF(owner);   /* sys.modules keeps it, and with it the table */
    kernels = PyCapsule_Import(KERNELS_CAPSULE, 0);
    if (kernels == NULL || PyType_Ready(&MutexType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Mutex", (PyObject *)&MutexType) < 0 ||
        PyModule_AddFunctions(module, chunk_methods) < 0)
        return -1;
    static const struct { const char *name; int value; } steps[] = {
        {"R_START", R_START}, {"R_JOIN", R_JOIN}, {"R_WAIT", R_WAIT},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++)
        if (PyModule_AddIntConstant(module, steps[i].name, steps[i].value) < 0)
            return -1;
    return 0;
}
