/* The answers of a pipelined REDUCE stream, read without the interpreter lock
 * (module smb_client.transports._answers; its Python side is stream.py).
 *
 * A stream's receiving thread took each answer in several Python steps: the header
 * (a receive, a parse), a look-up of what it answers, and for a sum the payload into the
 * caller's buffers (a receive per piece, the low-water mark set and reset around it).
 * Those steps were most of a worker's Python per chunk. Here one call takes one answer
 * whole where it is one of the two kinds a collective's chunk gets: a push that took
 * effect (PUSHED: its 8-byte body is read and dropped) and a sum for a request whose
 * buffers were registered (expect()): the payload goes straight into them. Any other
 * answer (an error, a HELLO's, a stray one, a sum of the wrong length) comes back with
 * only its header read, for Python to handle as before.
 *
 * The reader works on its own duplicate of the socket's descriptor, closed only by
 * close() (the receiving thread's, as it ends): a descriptor the connection closed
 * meanwhile may be reused by a new connection, which the duplicate never reads. A
 * shutdown of the socket (the stream's way to fail a connection) ends a read at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_lowat.h"

#define HEADER 16              /* wire.RESPONSE: <HBBIQ magic, status, kind, req_id, length */
#define MAGIC 0x5342           /* wire.MAGIC */
#define KIND_FINAL 0
#define KIND_PUSHED 1
#define PUSHED_BODY_MAX 64     /* a PUSHED answer's body (the count word) is read and dropped */
#define BUCKETS 64
#define IOV_MAX_READ 512

typedef struct entry {
    uint32_t req_id;
    Py_ssize_t nbuf;
    Py_ssize_t nbytes;
    Py_buffer *bufs;
    struct entry *next;
} entry;

typedef struct {
    PyObject_HEAD
    int fd;                    /* the duplicate; -1 once closed */
    pthread_mutex_t mu;        /* the table: expect() and forget() run beside a receive() */
    entry *table[BUCKETS];
    Py_ssize_t count;
} Answers;

static void entry_free(entry *e)
{
    for (Py_ssize_t i = 0; i < e->nbuf; i++)
        PyBuffer_Release(&e->bufs[i]);
    PyMem_Free(e->bufs);
    PyMem_Free(e);
}

/* where the table links to req_id's entry (*at NULL: none); under mu */
static entry **find(Answers *self, uint32_t req_id)
{
    entry **at = &self->table[req_id % BUCKETS];
    while (*at && (*at)->req_id != req_id)
        at = &(*at)->next;
    return at;
}

/* the entry ``at`` links to, taken out of the table (NULL: none); under mu */
static entry *unlink_at(Answers *self, entry **at)
{
    entry *e = *at;
    if (e != NULL) {
        *at = e->next;
        self->count--;
    }
    return e;
}

/* the entry of req_id, taken out of the table (NULL: none); under mu */
static entry *take(Answers *self, uint32_t req_id)
{
    return unlink_at(self, find(self, req_id));
}

static int Answers_init(Answers *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", NULL};
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &fd))
        return -1;
    if (self->fd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Answers is initialised once");
        return -1;
    }
    self->fd = dup(fd);
    if (self->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *Answers_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    Answers *self = (Answers *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fd = -1;
    pthread_mutex_init(&self->mu, NULL);
    return (PyObject *)self;
}

static void forget_all(Answers *self)
{
    entry *all[BUCKETS];
    pthread_mutex_lock(&self->mu);
    memcpy(all, self->table, sizeof all);
    memset(self->table, 0, sizeof self->table);
    self->count = 0;
    pthread_mutex_unlock(&self->mu);
    for (int b = 0; b < BUCKETS; b++) {
        while (all[b]) {
            entry *e = all[b];
            all[b] = e->next;
            entry_free(e);
        }
    }
}

static void Answers_dealloc(Answers *self)
{
    forget_all(self);
    if (self->fd >= 0)
        close(self->fd);
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(expect_doc,
"expect(req_id, into)\n--\n\n"
"Register the writable buffers ``into`` (in order) for the sum that answers request\n"
"``req_id``: receive() fills them when that sum comes with their total length. Held\n"
"until then, or until forget() or forget_all().");

static PyObject *Answers_expect(Answers *self, PyObject *args)
{
    unsigned long req_id;
    PyObject *into;
    if (!PyArg_ParseTuple(args, "kO", &req_id, &into))
        return NULL;
    PyObject *seq = PySequence_Fast(into, "into must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    entry *e = PyMem_Calloc(1, sizeof *e);
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof *bufs);
    if (e == NULL || bufs == NULL) {
        PyMem_Free(e);
        PyMem_Free(bufs);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    e->req_id = (uint32_t)req_id;
    e->bufs = bufs;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &bufs[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            entry_free(e);
            Py_DECREF(seq);
            return NULL;
        }
        e->nbuf = i + 1;
        e->nbytes += bufs[i].len;
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&self->mu);
    entry *old = take(self, e->req_id);
    entry **head = &self->table[e->req_id % BUCKETS];
    e->next = *head;
    *head = e;
    self->count++;
    pthread_mutex_unlock(&self->mu);
    if (old != NULL)
        entry_free(old);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(forget_doc,
"forget(req_id) -> bool\n--\n\n"
"Drop the buffers registered for ``req_id`` (its request ended otherwise: an error\n"
"answer); whether there were any.");

static PyObject *Answers_forget(Answers *self, PyObject *args)
{
    unsigned long req_id;
    if (!PyArg_ParseTuple(args, "k", &req_id))
        return NULL;
    pthread_mutex_lock(&self->mu);
    entry *e = take(self, (uint32_t)req_id);
    pthread_mutex_unlock(&self->mu);
    if (e == NULL)
        Py_RETURN_FALSE;
    entry_free(e);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(forget_all_doc,
"forget_all()\n--\n\n"
"Drop every registered buffer (the connection is done for).");

static PyObject *Answers_forget_all(Answers *self, PyObject *Py_UNUSED(args))
{
    forget_all(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(close_doc,
"close()\n--\n\n"
"Close the reader's descriptor and drop every registered buffer; only the thread that\n"
"receives may call it (a receive on a closed reader raises OSError EBADF).");

static PyObject *Answers_close(Answers *self, PyObject *Py_UNUSED(args))
{
    forget_all(self);
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    Py_RETURN_NONE;
}

static int set_lowat(int fd, int want)
{
    return setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want);
}

/* Fill iov[0..n) from fd: 0, or -1 with errno set (0: the peer closed). A payload is
 * waited for with the low-water mark set (_lowat.h) and a poll, and taken without
 * sleeping inside the receive. */
static int read_all(int fd, struct iovec *iov, int n)
{
    size_t left = 0;
    for (int i = 0; i < n; i++)
        left += iov[i].iov_len;
    int lowat = 1, rc = 0;
    while (left) {
        int want = lowat_for(left);
        if (want != lowat && set_lowat(fd, want) == 0)
            lowat = want;
        ssize_t got;
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = n < IOV_MAX_READ ? n : IOV_MAX_READ;
        if (lowat > 1) {
            got = recvmsg(fd, &msg, MSG_DONTWAIT);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                struct pollfd p = {.fd = fd, .events = POLLIN};
                if (poll(&p, 1, -1) < 0 && errno != EINTR) {
                    rc = -1;
                    break;
                }
                continue;
            }
        } else {
            got = recvmsg(fd, &msg, 0);
        }
        if (got < 0) {
            if (errno == EINTR)
                continue;
            rc = -1;
            break;
        }
        if (got == 0) {
            errno = 0;
            rc = -1;
            break;
        }
        left -= (size_t)got;
        while (got > 0 && n > 0) {   /* drop what came from the front of iov */
            if ((size_t)got >= iov->iov_len) {
                got -= (ssize_t)iov->iov_len;
                iov++;
                n--;
            } else {
                iov->iov_base = (char *)iov->iov_base + got;
                iov->iov_len -= (size_t)got;
                got = 0;
            }
        }
    }
    if (lowat != 1) {
        int saved = errno;
        set_lowat(fd, 1);
        errno = saved;
    }
    return rc;
}

static PyObject *read_failed(int err)
{
    if (err == 0) {
        PyErr_SetString(PyExc_ConnectionResetError, "connection closed by peer");
        return NULL;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(receive_doc,
"receive() -> (header, taken)\n--\n\n"
"Read the next answer's header (``header``: its 16 bytes). ``taken``: True when the\n"
"answer was taken whole here: a PUSHED answer (OK, its short body read and dropped)\n"
"or a sum (OK) of exactly the length registered for its request, now in the buffers\n"
"expect() registered (which are then dropped). False: only the header was read, its\n"
"body (``length`` bytes) is the caller's to read. OSError for a failed read\n"
"(ConnectionResetError: the peer closed the connection).");

static PyObject *Answers_receive(Answers *self, PyObject *Py_UNUSED(args))
{
    if (self->fd < 0) {
        errno = EBADF;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    unsigned char h[HEADER];
    unsigned char body[PUSHED_BODY_MAX];
    entry *e = NULL;
    int taken = 0, rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov = {h, HEADER};
    rc = read_all(self->fd, &iov, 1);
    uint16_t magic;
    memcpy(&magic, h, 2);
    if (rc == 0 && magic == MAGIC) {   /* a bad header is the caller's to refuse */
        uint8_t status = h[2], kind = h[3];
        uint32_t req_id;
        uint64_t length;
        memcpy(&req_id, h + 4, 4);     /* little-endian, as the wire is (x86, arm64) */
        memcpy(&length, h + 8, 8);
        if (status == 0 && kind == KIND_PUSHED && length <= PUSHED_BODY_MAX) {
            struct iovec b = {body, (size_t)length};
            rc = length ? read_all(self->fd, &b, 1) : 0;
            taken = 1;
        } else if (status == 0 && kind == KIND_FINAL) {
            pthread_mutex_lock(&self->mu);
            entry **at = find(self, req_id);
            if (*at && (uint64_t)(*at)->nbytes == length)
                e = unlink_at(self, at);
            pthread_mutex_unlock(&self->mu);
            if (e != NULL) {
                struct iovec stack[16];
                struct iovec *v = e->nbuf <= 16 ? stack : malloc(sizeof *v * (size_t)e->nbuf);
                if (v == NULL) {
                    rc = -1;
                    errno = ENOMEM;
                } else {
                    int m = 0;
                    for (Py_ssize_t i = 0; i < e->nbuf; i++)
                        if (e->bufs[i].len) {
                            v[m].iov_base = e->bufs[i].buf;
                            v[m].iov_len = (size_t)e->bufs[i].len;
                            m++;
                        }
                    rc = read_all(self->fd, v, m);
                    if (v != stack)
                        free(v);
                }
                taken = 1;
            }
        }
    }
    err = errno;
    Py_END_ALLOW_THREADS
    if (e != NULL)
        entry_free(e);
    if (rc != 0)
        return read_failed(err);
    return Py_BuildValue("(y#O)", (const char *)h, (Py_ssize_t)HEADER, taken ? Py_True : Py_False);
}

static PyObject *Answers_expected(Answers *self, PyObject *Py_UNUSED(args))
{
    pthread_mutex_lock(&self->mu);
    Py_ssize_t n = self->count;
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef Answers_methods[] = {
    {"expect", (PyCFunction)Answers_expect, METH_VARARGS, expect_doc},
    {"forget", (PyCFunction)Answers_forget, METH_VARARGS, forget_doc},
    {"forget_all", (PyCFunction)Answers_forget_all, METH_NOARGS, forget_all_doc},
    {"receive", (PyCFunction)Answers_receive, METH_NOARGS, receive_doc},
    {"close", (PyCFunction)Answers_close, METH_NOARGS, close_doc},
    {"expected", (PyCFunction)Answers_expected, METH_NOARGS,
     "expected() -> int\n--\n\nRequests whose buffers are registered."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Answers_doc,
"Answers(fd)\n--\n\n"
"The reader of one stream connection's answers (on a duplicate of ``fd``): see the\n"
"module's notes.");

static PyTypeObject AnswersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_client.transports._answers.Answers",
    .tp_basicsize = sizeof(Answers),
    .tp_dealloc = (destructor)Answers_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Answers_doc,
    .tp_methods = Answers_methods,
    .tp_init = (initproc)Answers_init,
    .tp_new = Answers_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_answers",
    "A pipelined REDUCE stream's answers read without the interpreter lock (see answers.c).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__answers(void)
{
    if (PyType_Ready(&AnswersType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AnswersType);
    if (PyModule_AddObject(m, "Answers", (PyObject *)&AnswersType) < 0) {
        Py_DECREF(&AnswersType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
