/* A tcp connection's REDUCE requests served without the interpreter.
 *
 * A collective's chunk request (REDUCE: a push, then its round's sum) is the one
 * request a memory server sees thousands of times a second, and in Python each costs
 * some 270 interpreter calls and the interpreter lock's hand-overs between a
 * connection's threads (docs/benchmarks.md, "The server path"), so one server used about
 * one core. Here a connection's own thread reads its frames in C, with the interpreter
 * released: a REDUCE that needs nothing unusual is served whole (its exactly-once entries
 * in the node's table, dedup.c; its push with chunks.c's step under the extent's lock;
 * PUSHED; its sum sent by whichever push completes the round), and anything else comes
 * back to Python as an event (the frame's header, an error to answer, a sum to deliver
 * the Python way), which serves it as before. Several connections' threads run here at
 * once, on as many cores.
 *
 * What is native and what stays Python (smb_server/memserver/tcp_plane.py):
 *   - Conn: one per plain tcp connection (TLS streams stay Python). serve() reads the
 *     next frame's header; a REDUCE of an extent this connection registered (Python
 *     served one of its REDUCEs, so its ticket was checked; the ticket's expiry is
 *     kept and looked at), of any chunk types (16-bit pushes widened, answers narrowed), with
 *     sane fields and a fresh exactly-once number, is served here. Every other frame,
 *     and every REDUCE whose number was seen before, returns its header to Python.
 *   - ExtentHandle: an extent's memory, lock and state for native code, with a count of
 *     native users; Python blocks it while a move or replication role makes its
 *     mutations go another way, and closes it (waiting for the users) before the
 *     memory goes.
 *   - Parked sums: a REDUCE whose push did not complete its round owes its sum; it is
 *     parked here by chunk round, and the push that completes the round (native or
 *     Python, any connection) sends every parked sum of the round from its own thread.
 *     A parked sum whose deadline passes, whose extent went or that cannot be sent the
 *     simple way (its pull's number seen before, the round not as expected) is handed
 *     back to its connection's Python, which serves it as a pull.
 */
#include "native.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sock_diag.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_native.h"
#include "_lowat.h"
#include "_rounds.h"

/* -- wire (smb_protocol/wire.py) ------------------------------------------------------ */
#define MAGIC 0x5342
#define HEADER_BYTES 72           /* REQUEST: <HBBIQQQqqdQQ */
#define ANSWER_BYTES 16           /* RESPONSE: <HBBIQ */
#define OP_PULL 14
#define OP_REDUCE 16
#define KIND_FINAL 0
#define KIND_PUSHED 1
#define MAX_CHUNK (4 << 20)
#define WORD_BITS 48
#define ROOT_BIT (INT64_C(1) << 62)
#define MAX_PARTIES ((1 << 15) - 1)

/* events serve() returns (tcp_plane.py reads them) */
enum {
    EV_PYTHON = 0,     /* the header is in the caller's buffer: Python serves the frame */
    EV_TICK = 1,       /* nothing came within the tick */
    EV_EOF = 2,        /* the peer closed between frames */
    EV_DROP = 3,       /* (reason, message): the connection cannot go on */
    EV_REFUSED = 4,    /* (req_id, code, old word, word, parties, round, root): a push the rules refused */
    EV_ABSENT = 5,     /* (req_id, extent, word, value, timeout): a push waited in vain */
    EV_NOT_OPEN = 6,   /* (req_id, extent, state): the extent went or its mutations go another way */
    EV_HAND_BACK = 7,  /* (req_id, extent, offset, length, client, seq, word, parties, round, dtype, left) */
};
enum { DROP_PROTOCOL = 0, DROP_FRAME_LATE = 1, DROP_DEAD_PEER = 2, DROP_BROKEN = 3 };
enum { XT_OPEN = 0, XT_BLOCKED = 1, XT_DEAD = 2 };

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static const struct smb_kernels *kernels;

/* A chunk request's types (its dtype byte, smb_protocol/chunk_types.py): the slot's, the
 * wire's (0: pushed in the slot's type) and the answer's, with their element sizes. */
struct chunk_types {
    int slot, wire, answer;
    ptrdiff_t sent_item, slot_item, answer_item;
};

/* Decode ``code``: 1, or 0 for a byte the native loop leaves to Python (it refuses what
 * names no types, with its own message). */
static int chunk_types(int code, struct chunk_types *t)
{
    int slot = code & 0x0F, wire = (code >> 4) & 0x07, full = (code & 0x80) != 0;
    if (wire == 0 ? full || slot < T_F32 || slot > T_I64 : slot != T_F32 || (wire != T_F16 && wire != T_BF16))
        return 0;
    t->slot = slot;
    t->wire = wire;
    t->answer = wire && !full ? wire : slot;
    t->slot_item = kernels->item_size(slot);
    t->sent_item = kernels->item_size(wire ? wire : slot);
    t->answer_item = kernels->item_size(t->answer);
    return 1;
}

/* -- extents -------------------------------------------------------------------------- */

struct xt {
    atomic_int refs;          /* the Python handle's, each registration's, each parked sum's */
    atomic_int state;         /* XT_OPEN, XT_BLOCKED, XT_DEAD */
    atomic_int users;         /* native operations on its memory right now */
    int64_t extent_id;
    char *base;               /* the data (valid while not XT_DEAD and users counted) */
    int64_t length;
    pthread_mutex_t *mu;      /* the extent's lock (held by reference: lock) */
    struct smb_mutex *lock;
};

static void xt_decref(struct xt *x)
{
    if (x != NULL && atomic_fetch_sub(&x->refs, 1) == 1) {
        smb_mutex_drop(x->lock);
        free(x);
    }
}

/* Count a native user of the extent's memory: 1 while it is open, else 0 (not counted). */
static int xt_use(struct xt *x)
{
    atomic_fetch_add(&x->users, 1);
    if (atomic_load(&x->state) == XT_OPEN)
        return 1;
    atomic_fetch_sub(&x->users, 1);
    return 0;
}

static void xt_unuse(struct xt *x) { atomic_fetch_sub(&x->users, 1); }

typedef struct {
    PyObject_HEAD
    struct xt *x;
    PyObject *lock;           /* the Mutex */
    Py_buffer view;           /* the data, held until close */
    int has_view;
} HandleObject;

static PyTypeObject HandleType;

static PyObject *handle_new(PyTypeObject *type, PyObject *args, PyObject *Py_UNUSED(kw))
{
    long long extent_id;
    PyObject *data, *lock;
    if (!PyArg_ParseTuple(args, "LOO!", &extent_id, &data, smb_mutex_type, &lock))
        return NULL;
    HandleObject *self = (HandleObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyObject_GetBuffer(data, &self->view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->has_view = 1;
    self->x = calloc(1, sizeof *self->x);
    if (self->x == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    atomic_init(&self->x->refs, 1);
    atomic_init(&self->x->state, XT_OPEN);
    atomic_init(&self->x->users, 0);
    self->x->extent_id = extent_id;
    self->x->base = self->view.buf;
    self->x->length = self->view.len;
    self->x->lock = smb_mutex_hold(lock);
    self->x->mu = smb_mutex_of(self->x->lock);
    self->lock = Py_NewRef(lock);
    return (PyObject *)self;
}

/* Wait until no native user is on the extent; False after ``timeout`` seconds (<0: never). */
static int xt_drain(struct xt *x, double timeout)
{
    double end = mono_now() + timeout;
    struct timespec nap = {0, 100000};   /* users stay for a step or a send: short */
    while (atomic_load(&x->users) > 0) {
        if (timeout >= 0 && mono_now() >= end)
            return 0;
        nanosleep(&nap, NULL);
    }
    return 1;
}

static PyObject *handle_set_state(HandleObject *self, int state, double timeout)
{
    if (self->x == NULL || atomic_load(&self->x->state) == XT_DEAD)
        Py_RETURN_TRUE;   /* closed: nothing runs on it */
    atomic_store(&self->x->state, state);
    if (state == XT_OPEN)
        Py_RETURN_TRUE;
    int drained;
    Py_BEGIN_ALLOW_THREADS
    drained = xt_drain(self->x, timeout);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(drained);
}

static PyObject *handle_block(HandleObject *self, PyObject *args)
{
    double timeout = -1;
    if (!PyArg_ParseTuple(args, "|d", &timeout))
        return NULL;
    return handle_set_state(self, XT_BLOCKED, timeout);
}

static PyObject *handle_open(HandleObject *self, PyObject *Py_UNUSED(args))
{
    return handle_set_state(self, XT_OPEN, 0);
}

static PyObject *handle_close(HandleObject *self, PyObject *Py_UNUSED(args))
{
    if (self->x != NULL) {
        atomic_store(&self->x->state, XT_DEAD);
        Py_BEGIN_ALLOW_THREADS
        xt_drain(self->x, -1);
        Py_END_ALLOW_THREADS
    }
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *handle_users(HandleObject *self, PyObject *Py_UNUSED(args))
{
    return PyLong_FromLong(self->x ? atomic_load(&self->x->users) : 0);
}

static void handle_dealloc(HandleObject *self)
{
    if (self->x != NULL) {
        atomic_store(&self->x->state, XT_DEAD);   /* parked sums that hold it see it gone */
        Py_BEGIN_ALLOW_THREADS
        xt_drain(self->x, -1);                    /* and none is on its memory */
        Py_END_ALLOW_THREADS
    }
    if (self->has_view)
        PyBuffer_Release(&self->view);
    xt_decref(self->x);
    Py_XDECREF(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef handle_methods[] = {
    {"block", (PyCFunction)handle_block, METH_VARARGS,
     "block(timeout=-1)\n--\n\nNative requests leave the extent to Python (a move or a replication "
     "role began); waits until none runs on it. False when some still did after timeout seconds."},
    {"open", (PyCFunction)handle_open, METH_NOARGS, "Native requests may serve the extent again."},
    {"close", (PyCFunction)handle_close, METH_NOARGS,
     "The extent goes: no native request touches it from now on (waits for those that do)."},
    {"users", (PyCFunction)handle_users, METH_NOARGS, "Native operations on its memory now."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_server.memserver._native.ExtentHandle",
    .tp_doc = "ExtentHandle(extent_id, data, lock)\n--\n\nAn extent's memory and lock as native "
              "request loops use them (serve.c).",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = handle_new,
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_methods = handle_methods,
};

/* -- connections and parked sums -------------------------------------------------------- */

struct owed {
    struct owed *next;
    struct conn *owner;       /* referenced */
    struct xt *x;             /* referenced */
    uint32_t req_id;
    uint64_t client, seq;     /* the pull's number (the push's + 1; 0: not tracked) */
    int64_t offset, length, word, parties, round;   /* length: the bytes pushed (the pull's) */
    int dtype;                /* the chunk's types (dtype byte) */
    double deadline;          /* monotonic */
    int tried;                /* the owner's own thread tried to send it (next: Python's turn) */
};

struct event {
    struct event *next;
    int kind;
    struct owed *owed;        /* EV_HAND_BACK */
};

#define MAX_REGISTERED 64
#define LOOK_EVERY 0.05       /* seconds between looks at a connection's parked sums (waiters.RECHECK) */

struct conn {
    atomic_int refs;          /* the Python object's, each parked sum's */
    atomic_int ended;
    int fd;
    int evfd;                 /* wakes serve() for a handed-back sum */
    pthread_mutex_t *send_mu; /* the connection's send lock (a recursive Mutex, shared with Python) */
    struct smb_mutex *send_lock;   /* ... held by reference */
    struct dd_table *dd;
    double frame_timeout;
    /* handed-back sums, for serve() to return */
    pthread_mutex_t q_mu;
    struct event *q_head, *q_tail;
    /* extents Python registered: id, handle, the ticket's expiry (wall clock); serve's thread only */
    int n_reg;
    struct { int64_t extent_id; struct xt *x; double expires; } reg[MAX_REGISTERED];
    unsigned char *buf;       /* a push's payload */
    double next_look;         /* when serve() looks at this connection's parked sums again */
    /* counters Python adds to the plane's statistics (serve's thread writes them) */
    uint64_t operations, bytes_accumulated, bytes_read, errors, requests;
    uint64_t waits;           /* polls for a frame's bytes (read_all) */
    double busy;              /* seconds from header to answer, summed */
};

static void conn_decref(struct conn *c)
{
    if (c == NULL || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    struct event *e = c->q_head;
    while (e != NULL) {
        struct event *next = e->next;
        free(e);
        e = next;
    }
    for (int i = 0; i < c->n_reg; i++)
        xt_decref(c->reg[i].x);
    if (c->evfd >= 0)
        close(c->evfd);
    smb_mutex_drop(c->send_lock);
    pthread_mutex_destroy(&c->q_mu);
    free(c->buf);
    free(c);
}

static void owed_free(struct owed *o)
{
    conn_decref(o->owner);
    xt_decref(o->x);
    free(o);
}

/* Parked sums by chunk round (extent, word, round), one lock for all. */
#define PARK_BUCKETS 1024
static pthread_mutex_t park_mu = PTHREAD_MUTEX_INITIALIZER;
static struct owed *parked[PARK_BUCKETS];
static atomic_long parked_count;

static size_t park_bucket(const struct xt *x, int64_t word, int64_t round)
{
    uint64_t h = (uint64_t)(uintptr_t)x * 0x9E3779B97F4A7C15ULL ^ (uint64_t)word * 0xC2B2AE3D27D4EB4FULL
                 ^ (uint64_t)round * 0x165667B19E3779F9ULL;
    return (size_t)(h >> 40) % PARK_BUCKETS;
}

static void park(struct owed *o)
{
    size_t b = park_bucket(o->x, o->word, o->round);
    pthread_mutex_lock(&park_mu);
    o->next = parked[b];
    parked[b] = o;
    atomic_fetch_add(&parked_count, 1);
    pthread_mutex_unlock(&park_mu);
}

/* Move the sums of the list at ``head`` that ``match`` (with ``arg``) onto ``taken``;
 * returns the new ``taken``. Under park_mu. */
static struct owed *unlink_matching(struct owed **head, int (*match)(const struct owed *, const void *),
                                    const void *arg, struct owed *taken)
{
    for (struct owed **p = head; *p != NULL;) {
        struct owed *o = *p;
        if (match(o, arg)) {
            *p = o->next;
            o->next = taken;
            taken = o;
            atomic_fetch_sub(&parked_count, 1);
        } else {
            p = &o->next;
        }
    }
    return taken;
}

struct round_key { const struct xt *x; int64_t word, round; };

static int of_round(const struct owed *o, const void *arg)
{
    const struct round_key *k = arg;
    return o->x == k->x && o->word == k->word && o->round == k->round;
}

/* Every parked sum of the round, taken out (a list through ->next). */
static struct owed *take_round(const struct xt *x, int64_t word, int64_t round)
{
    struct round_key key = {x, word, round};
    pthread_mutex_lock(&park_mu);
    struct owed *taken = unlink_matching(&parked[park_bucket(x, word, round)], of_round, &key, NULL);
    pthread_mutex_unlock(&park_mu);
    return taken;
}

/* Take ``o`` back out: 1, or 0 once someone else took it. */
static int reclaim(struct owed *o)
{
    size_t b = park_bucket(o->x, o->word, o->round);
    int found = 0;
    pthread_mutex_lock(&park_mu);
    for (struct owed **p = &parked[b]; *p != NULL; p = &(*p)->next) {
        if (*p == o) {
            *p = o->next;
            found = 1;
            atomic_fetch_sub(&parked_count, 1);
            break;
        }
    }
    pthread_mutex_unlock(&park_mu);
    return found;
}

struct overdue { const struct conn *c; int all; double now; };

static int is_overdue(const struct owed *o, const void *arg)
{
    const struct overdue *d = arg;
    return o->owner == d->c && (d->all || d->now >= o->deadline || atomic_load(&o->x->state) != XT_OPEN);
}

/* The parked sums of ``c`` that are overdue (deadline passed, extent gone or blocked, or
 * ``all``: the connection ends), taken out (a list through ->next). */
static struct owed *take_overdue(struct conn *c, int all)
{
    struct owed *taken = NULL;
    if (atomic_load(&parked_count) == 0)
        return NULL;
    struct overdue d = {c, all, mono_now()};
    pthread_mutex_lock(&park_mu);
    for (size_t b = 0; b < PARK_BUCKETS; b++)
        taken = unlink_matching(&parked[b], is_overdue, &d, taken);
    pthread_mutex_unlock(&park_mu);
    return taken;
}

/* Hand ``o`` back to its connection's Python (serve() returns it); dropped when the
 * connection ended (its client asks again on a new one). */
static void hand_back(struct owed *o)
{
    struct conn *c = o->owner;
    struct event *e = malloc(sizeof *e);
    if (atomic_load(&c->ended) || e == NULL) {
        free(e);
        owed_free(o);
        return;
    }
    e->next = NULL;
    e->kind = EV_HAND_BACK;
    e->owed = o;
    pthread_mutex_lock(&c->q_mu);
    if (c->q_tail != NULL)
        c->q_tail->next = e;
    else
        c->q_head = e;
    c->q_tail = e;
    pthread_mutex_unlock(&c->q_mu);
    uint64_t one = 1;
    ssize_t n = write(c->evfd, &one, sizeof one);
    (void)n;   /* a full eventfd counter still wakes the reader */
}

/* An owned exactly-once entry given up part way (NULL: none): a retry runs it. */
static void entry_drop(struct dd_table *t, struct dd_entry *e)
{
    if (e != NULL) {
        dd_interrupt(t, e);
        dd_entry_decref(e);
    }
}

/* -- sending ------------------------------------------------------------------------------- */

/* Send all of ``iov`` on ``fd`` (non-blocking), waiting for room until ``deadline``
 * (monotonic). 0, or -1 (the connection is broken or the peer too slow). */
static int send_all(int fd, struct iovec *iov, int n, int more, double deadline)
{
    while (n > 0) {
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n;
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT | (more ? MSG_MORE : 0));
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -1;
            double left = deadline - mono_now();
            if (left <= 0)
                return -1;
            struct pollfd p = {fd, POLLOUT, 0};
            int ms = left > 1.0 ? 1000 : (int)(left * 1000) + 1;
            if (poll(&p, 1, ms) < 0 && errno != EINTR)
                return -1;
            continue;
        }
        while (n > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

static void pack_answer(unsigned char *out, int status, int kind, uint32_t req_id, uint64_t length)
{
    uint16_t magic = MAGIC;
    memcpy(out, &magic, 2);
    out[2] = (unsigned char)status;
    out[3] = (unsigned char)kind;
    memcpy(out + 4, &req_id, 4);
    memcpy(out + 8, &length, 8);
}

/* The connection could not take an answer: it ends (its reading thread sees the socket
 * shut and returns; the client asks again on a new connection). */
static void conn_break(struct conn *c)
{
    if (!atomic_exchange(&c->ended, 1))
        shutdown(c->fd, SHUT_RDWR);
}

/* Bytes the socket's send buffer has room for now (its size less what its queued bytes
 * take in the kernel, buffers' overhead included: SO_MEMINFO); 0 when unknown. */
static long room(int fd)
{
    uint32_t info[SK_MEMINFO_VARS] = {0};
    socklen_t n = sizeof info;
    if (getsockopt(fd, SOL_SOCKET, SO_MEMINFO, info, &n) < 0 || n < sizeof info)
        return 0;
    return (long)info[SK_MEMINFO_SNDBUF] - (long)info[SK_MEMINFO_WMEM_QUEUED];
}

/* Send a whole answer frame on ``c`` under its send lock: 0, -1 (``c`` broke), or with
 * ``at_once`` (sent from another connection's thread) 1 when it would have to wait for
 * the lock or for room (nothing sent: the caller hands the frame to ``c``'s own thread). */
static int conn_send(struct conn *c, struct iovec *iov, int n, int more, int at_once)
{
    int rc = -1;
    if (!at_once) {
        pthread_mutex_lock(c->send_mu);
    } else if (pthread_mutex_trylock(c->send_mu) != 0) {
        return 1;
    }
    if (!atomic_load(&c->ended)) {
        size_t bytes = 0;
        for (int i = 0; i < n; i++)
            bytes += iov[i].iov_len;
        if (at_once && room(c->fd) < (long)(2 * bytes)) {   /* a buffer's overhead: about 40 % on loopback */
            rc = 1;
        } else {
            rc = send_all(c->fd, iov, n, more, mono_now() + c->frame_timeout);
            if (rc < 0)
                conn_break(c);
        }
    }
    pthread_mutex_unlock(c->send_mu);
    return rc;
}

/* A buffer of ``n`` bytes for a sum narrowed on this thread (kept for its next one);
 * NULL when memory is short. */
static void *narrowing(ptrdiff_t n)
{
    static __thread void *buf;
    static __thread ptrdiff_t size;
    if (n > size) {
        void *bigger = realloc(buf, (size_t)n);
        if (bigger == NULL)
            return NULL;
        buf = bigger;
        size = n;
    }
    return buf;
}

/* A round's sum rounded once to its 16-bit wire type, for every sum the completing
 * thread sends of that round (deliver): the narrowing buffer of this thread, valid
 * while ``x`` is set and for the sums of the same slot bytes and types only. The slot
 * cannot change meanwhile: its next round needs every pull of this one counted, and
 * each is counted after its sum went out (or, handed back, is Python's to count). */
struct narrowed {
    const struct xt *x;
    int64_t offset, n;
    int wire;
    const void *sum;
};

/* Serve the sum ``o`` owes, the simple way: its pull's number fresh, the round's sum
 * ready, the extent open: the slot's bytes go out under the owner's send lock, then
 * the pull is counted (under the extent's lock) and its entry finished. Anything else
 * is handed back to the owner's Python, and so is a sum for another connection than
 * ``self`` (the calling thread's; NULL: none) that cannot go out at once: the owner's
 * send lock is held or its socket full (a client that stopped reading must not hold up
 * the thread that completes the rounds). A sum answered in a 16-bit type is narrowed
 * once per ``shared`` (NULL: for this sum alone). Takes ``o``. */
static void deliver(struct owed *o, struct conn *self, struct narrowed *shared)
{
    struct conn *c = o->owner;
    struct xt *x = o->x;
    if (atomic_load(&c->ended)) {
        owed_free(o);
        return;
    }
    struct chunk_types t;
    if (!chunk_types(o->dtype, &t) || o->length % t.sent_item || !xt_use(x)) {
        hand_back(o);
        return;
    }
    struct dd_entry *entry = NULL;
    if (o->seq) {
        int64_t what[5] = {OP_PULL, x->extent_id, o->offset, o->length, o->word};
        if (dd_begin(c->dd, o->client, o->seq, what, 5, 0, &entry) != DD_FRESH) {
            dd_entry_decref(entry);
            xt_unuse(x);
            hand_back(o);
            return;
        }
    }
    int64_t *count = (int64_t *)(x->base + o->word), value;
    if (round_admit_pull(__atomic_load_n(count, __ATOMIC_ACQUIRE), o->parties, o->round, &value) != R_GO) {
        entry_drop(c->dd, entry);
        xt_unuse(x);
        hand_back(o);
        return;
    }
    ptrdiff_t n = o->length / t.sent_item;
    void *sum = x->base + o->offset;
    if (t.answer != t.slot) {   /* rounded once to the wire type, here (the same bytes as Python's) */
        if (shared != NULL && shared->x == x && shared->offset == o->offset && shared->n == n
            && shared->wire == t.wire) {
            sum = (void *)shared->sum;
        } else if ((sum = narrowing(n * t.answer_item)) == NULL) {
            entry_drop(c->dd, entry);
            xt_unuse(x);
            hand_back(o);
            return;
        } else {
            kernels->narrow(sum, x->base + o->offset, 0.0, t.wire, n);
            if (shared != NULL)   /* the buffer now holds this sum (a former one is gone) */
                *shared = (struct narrowed){x, o->offset, n, t.wire, sum};
        }
    }
    unsigned char head[ANSWER_BYTES];
    pack_answer(head, 0, KIND_FINAL, o->req_id, (uint64_t)(n * t.answer_item));
    struct iovec iov[2] = {{head, ANSWER_BYTES}, {sum, (size_t)(n * t.answer_item)}};
    int sent = conn_send(c, iov, 2, 0, c != self);
    if (sent != 0) {
        entry_drop(c->dd, entry);
        xt_unuse(x);
        if (sent > 0)
            hand_back(o);
        else
            owed_free(o);
        return;
    }
    __atomic_fetch_add(&c->bytes_read, (uint64_t)(n * t.answer_item), __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->operations, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(x->mu);
    chunk_pull_counted(count);
    pthread_mutex_unlock(x->mu);
    if (entry != NULL) {
        dd_finish(c->dd, entry, 0, NULL, 0);
        dd_entry_decref(entry);
    }
    xt_unuse(x);
    owed_free(o);
}

/* The round (x, word, round) is complete: send every sum parked for it (from the
 * thread of ``self``, NULL: of no connection), 16-bit ones narrowed once in
 * ``shared`` (which may hold the round's already). */
static void complete_round(struct xt *x, int64_t word, int64_t round, struct conn *self,
                           struct narrowed *shared)
{
    struct owed *o = take_round(x, word, round);
    while (o != NULL) {
        struct owed *next = o->next;
        deliver(o, self, shared);
        o = next;
    }
}

/* Park the sum ``o`` owes until its round completes; sent at once (from here) when the
 * round completed meanwhile. Takes ``o``. */
static void owe(struct owed *o)
{
    int64_t *count = (int64_t *)(o->x->base + o->word), value;
    park(o);
    /* a push that completed the round before the sum was parked did not see it */
    if (xt_use(o->x)) {
        int ready = round_admit_pull(__atomic_load_n(count, __ATOMIC_ACQUIRE), o->parties, o->round, &value)
                    != R_WAIT;
        xt_unuse(o->x);
        if (ready && reclaim(o))
            deliver(o, o->owner, NULL);   /* owe runs on the owner's thread */
    }
}

/* -- the Conn object -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    struct conn *c;
    PyObject *send_lock, *table;
} ConnObject;

static PyObject *conn_new(PyTypeObject *type, PyObject *args, PyObject *Py_UNUSED(kw))
{
    int fd;
    PyObject *send_lock, *table;
    double frame_timeout;
    if (!PyArg_ParseTuple(args, "iO!Od", &fd, smb_mutex_type, &send_lock, &table, &frame_timeout))
        return NULL;
    struct dd_table *dd = dd_table_of(table);
    if (dd == NULL)
        return NULL;
    ConnObject *self = (ConnObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    struct conn *c = calloc(1, sizeof *c);
    if (c == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    c->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->evfd < 0) {
        free(c);
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    atomic_init(&c->refs, 1);
    atomic_init(&c->ended, 0);
    pthread_mutex_init(&c->q_mu, NULL);
    c->fd = fd;
    c->send_lock = smb_mutex_hold(send_lock);
    c->send_mu = smb_mutex_of(c->send_lock);
    c->dd = dd;
    c->frame_timeout = frame_timeout;
    self->c = c;
    self->send_lock = Py_NewRef(send_lock);
    self->table = Py_NewRef(table);
    return (PyObject *)self;
}

/* The connection ends: nothing is sent on it from now on (a sender holds the send lock
 * while it sends, so once this took it none is mid-frame), and its parked sums go. */
static void conn_end(struct conn *c)
{
    pthread_mutex_lock(c->send_mu);
    atomic_store(&c->ended, 1);
    pthread_mutex_unlock(c->send_mu);
    struct owed *o = take_overdue(c, 1);
    while (o != NULL) {
        struct owed *next = o->next;
        owed_free(o);
        o = next;
    }
}

static PyObject *conn_py_end(ConnObject *self, PyObject *Py_UNUSED(args))
{
    Py_BEGIN_ALLOW_THREADS
    conn_end(self->c);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void conn_dealloc(ConnObject *self)
{
    if (self->c != NULL) {
        Py_BEGIN_ALLOW_THREADS
        conn_end(self->c);
        Py_END_ALLOW_THREADS
        conn_decref(self->c);
    }
    Py_XDECREF(self->send_lock);
    Py_XDECREF(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *conn_register(ConnObject *self, PyObject *args)
{
    long long extent_id;
    HandleObject *h;
    double expires;
    if (!PyArg_ParseTuple(args, "LO!d", &extent_id, &HandleType, &h, &expires))
        return NULL;
    struct conn *c = self->c;
    int i;
    for (i = 0; i < c->n_reg && c->reg[i].extent_id != extent_id; i++)
        ;
    if (i == c->n_reg) {
        if (c->n_reg == MAX_REGISTERED) {   /* full: the oldest registration goes */
            xt_decref(c->reg[0].x);
            memmove(&c->reg[0], &c->reg[1], sizeof c->reg[0] * (MAX_REGISTERED - 1));
            i = --c->n_reg;
        }
        c->n_reg++;
    } else {
        xt_decref(c->reg[i].x);
    }
    atomic_fetch_add(&h->x->refs, 1);
    c->reg[i].extent_id = extent_id;
    c->reg[i].x = h->x;
    c->reg[i].expires = expires;
    Py_RETURN_NONE;
}

static PyObject *conn_owe(ConnObject *self, PyObject *args)
{
    HandleObject *h;
    unsigned int req_id;
    unsigned long long client, seq;
    long long offset, length, word, parties, round;
    int dtype;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!ILLKKLLLid", &HandleType, &h, &req_id, &offset, &length, &client, &seq,
                          &word, &parties, &round, &dtype, &timeout))
        return NULL;
    if (word < 0 || word + 8 > h->x->length || offset < 0 || length < 0 || offset + length > h->x->length) {
        PyErr_SetString(PyExc_ValueError, "a sum owed outside its extent");
        return NULL;
    }
    struct owed *o = calloc(1, sizeof *o);
    if (o == NULL)
        return PyErr_NoMemory();
    atomic_fetch_add(&self->c->refs, 1);
    atomic_fetch_add(&h->x->refs, 1);
    *o = (struct owed){NULL, self->c, h->x, req_id, client, seq, offset, length, word, parties, round, dtype,
                       mono_now() + timeout, 0};
    Py_BEGIN_ALLOW_THREADS
    owe(o);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_complete(PyObject *Py_UNUSED(mod), PyObject *args)
{
    HandleObject *h;
    long long word, round;
    if (!PyArg_ParseTuple(args, "O!LL", &HandleType, &h, &word, &round))
        return NULL;
    if (atomic_load(&parked_count) == 0)
        Py_RETURN_NONE;
    struct narrowed shared = {NULL, 0, 0, 0, NULL};
    Py_BEGIN_ALLOW_THREADS
    complete_round(h->x, word, round, NULL, &shared);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_parked(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(args))
{
    return PyLong_FromLong(atomic_load(&parked_count));
}

static PyObject *conn_counters(ConnObject *self, PyObject *Py_UNUSED(args))
{
    struct conn *c = self->c;
    PyObject *out = Py_BuildValue("KKKKKdK", (unsigned long long)__atomic_exchange_n(&c->operations, 0, __ATOMIC_RELAXED),
                                  (unsigned long long)__atomic_exchange_n(&c->bytes_accumulated, 0, __ATOMIC_RELAXED),
                                  (unsigned long long)__atomic_exchange_n(&c->bytes_read, 0, __ATOMIC_RELAXED),
                                  (unsigned long long)__atomic_exchange_n(&c->errors, 0, __ATOMIC_RELAXED),
                                  (unsigned long long)c->requests, c->busy,
                                  (unsigned long long)__atomic_exchange_n(&c->waits, 0, __ATOMIC_RELAXED));
    c->requests = 0;
    c->busy = 0;
    return out;
}

/* -- serving frames --------------------------------------------------------------------------- */

struct outcome {              /* what serve_frames ends with */
    int kind;
    int drop;                 /* EV_DROP: DROP_* */
    int64_t v[12];            /* the event's numbers */
    double d;                 /* a time, where the event has one */
    struct owed *owed;        /* EV_HAND_BACK */
};

/* A wait for a payload sets the socket's low-water mark (_lowat.h): the kernel then
 * wakes this thread once for the bytes still to come instead of once per few segments
 * (on a shaped 500 Mbit/s link a 512 KiB push came in about ten pieces, each a poll, a
 * wakeup and a recv); set back to one byte before the next header is read. */
static void set_lowat(struct conn *c, int *lowat, int want)
{
    if (want != *lowat && setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0)
        *lowat = want;
}

/* Read exactly ``n`` bytes by ``deadline`` (monotonic): 0, or the DROP_* reason. */
static int read_all(struct conn *c, unsigned char *p, size_t n, double deadline)
{
    int why = 0, lowat = 1;
    while (n > 0) {
        ssize_t got = recv(c->fd, p, n, MSG_DONTWAIT);
        if (got > 0) {
            p += got;
            n -= (size_t)got;
            continue;
        }
        if (got == 0) {
            why = DROP_BROKEN;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno == ETIMEDOUT || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            why = errno == ETIMEDOUT ? DROP_DEAD_PEER : DROP_BROKEN;
            break;
        }
        double left = deadline - mono_now();
        if (left <= 0) {
            why = DROP_FRAME_LATE;
            break;
        }
        set_lowat(c, &lowat, lowat_for(n));
        struct pollfd p1 = {c->fd, POLLIN, 0};
        int ms = left > 1.0 ? 1000 : (int)(left * 1000) + 1;
        __atomic_add_fetch(&c->waits, 1, __ATOMIC_RELAXED);
        if (poll(&p1, 1, ms) < 0 && errno != EINTR) {
            why = DROP_BROKEN;
            break;
        }
    }
    set_lowat(c, &lowat, 1);
    return why;
}

static struct xt *registered(struct conn *c, int64_t extent_id)
{
    for (int i = 0; i < c->n_reg; i++)
        if (c->reg[i].extent_id == extent_id)
            return c->reg[i].expires > wall_now() ? c->reg[i].x : NULL;
    return NULL;
}

/* Serve one REDUCE whose header is ``h`` and which ``x`` holds, natively. Returns 1
 * when it was served (or failed the connection: out->kind set to EV_DROP), 0 when it is
 * Python's (nothing read past the header), or 2 with an event in ``out`` to return. */
static int reduce(struct conn *c, const unsigned char *h, struct xt *x, double frame_deadline,
                  double started, struct outcome *out)
{
    uint32_t req_id = get_u32(h + 4);
    int dtype = h[3];
    int64_t offset = (int64_t)get_u64(h + 16), length = (int64_t)get_u64(h + 24);
    int64_t arg0 = (int64_t)get_u64(h + 32), arg1 = (int64_t)get_u64(h + 40);
    double timeout;
    memcpy(&timeout, h + 48, 8);
    uint64_t client = get_u64(h + 56), seq = get_u64(h + 64);
    int64_t word = arg0 & ((INT64_C(1) << WORD_BITS) - 1), parties = arg0 >> WORD_BITS;
    int64_t round = arg1 & (ROOT_BIT - 1);
    int root = (arg1 & ROOT_BIT) != 0;
    struct chunk_types t;
    /* whatever Python would refuse or treat specially stays Python's */
    if (!chunk_types(dtype, &t) || arg0 < 0 || arg1 < 0 || parties < 1 || parties > MAX_PARTIES
        || length < 0 || length % t.sent_item || !(timeout >= 0) || round > ROUND_LIMIT)
        return 0;
    int64_t n = length / t.sent_item, span = n * t.slot_item;   /* elements; the slot's bytes */
    if (span > MAX_CHUNK || offset < 0 || offset % t.slot_item || offset > x->length - span || word % 8
        || word > x->length - 8 || (word < offset + span && offset < word + 8))
        return 0;
    struct dd_entry *entry = NULL;
    if (seq) {
        int64_t what[5] = {OP_REDUCE, x->extent_id, offset, length, dtype};
        if (dd_begin(c->dd, client, seq, what, 5, 0, &entry) != DD_FRESH) {
            dd_entry_decref(entry);   /* a repeat, or its first attempt still runs: Python's */
            return 0;
        }
    }
    if (c->buf == NULL && (c->buf = malloc(MAX_CHUNK)) == NULL) {
        entry_drop(c->dd, entry);
        return 0;
    }
    int why = read_all(c, c->buf, (size_t)length, frame_deadline);
    if (why) {
        entry_drop(c->dd, entry);
        out->kind = EV_DROP;
        out->drop = why;
        return 1;
    }
    double deadline = mono_now() + timeout;
    int64_t old = 0, value = 0;
    int step;
    struct timespec nap = {0, 50000};
    for (;;) {
        if (!xt_use(x)) {
            out->kind = EV_NOT_OPEN;
            out->v[1] = x->extent_id;
            out->v[2] = atomic_load(&x->state);
            goto refused;
        }
        int rc = chunk_push(x->mu, (int64_t *)(x->base + word), x->base + offset, c->buf, length, t.slot, t.wire,
                            parties, round, root, &step, &old, &value);
        xt_unuse(x);
        if (rc == 0 && step != R_WAIT)
            break;
        /* the slot's previous round is still being pulled: look again shortly, while
         * the client is there (a peer that left, or a plane closing its socket, ends it;
         * so does a lock error, which this thread, holding no lock, cannot get) */
        struct pollfd gone = {c->fd, POLLRDHUP, 0};
        if (rc != 0 || atomic_load(&c->ended)
            || (poll(&gone, 1, 0) > 0 && gone.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            entry_drop(c->dd, entry);
            out->kind = EV_DROP;
            out->drop = DROP_BROKEN;
            return 1;
        }
        if (mono_now() >= deadline) {
            out->kind = EV_ABSENT;
            out->v[1] = x->extent_id;
            out->v[2] = word;
            out->v[3] = value;
            out->d = timeout;
            goto refused;
        }
        nanosleep(&nap, NULL);
        if (nap.tv_nsec < 1000000)
            nap.tv_nsec *= 2;
    }
    if (step < 0) {
        out->kind = EV_REFUSED;
        out->v[1] = step;
        out->v[2] = old;
        out->v[3] = word;
        out->v[4] = parties;
        out->v[5] = round;
        out->v[6] = root;
        goto refused;
    }
    c->bytes_accumulated += (uint64_t)length;
    c->operations++;
    if (entry != NULL) {
        dd_entry_set_applied(entry, length > 1 ? length : 1);
        dd_finish(c->dd, entry, 0, (const char *)&old, 8);
        dd_entry_decref(entry);
    }
    int last = round_held(value) == round && round_arrivals(value) >= parties;
    unsigned char head[ANSWER_BYTES];
    pack_answer(head, 0, KIND_PUSHED, req_id, 8);
    struct iovec iov[2] = {{head, ANSWER_BYTES}, {&old, 8}};
    if (conn_send(c, iov, 2, last, 0) < 0) {
        out->kind = EV_DROP;
        out->drop = DROP_BROKEN;
        return 1;
    }
    struct owed *o = calloc(1, sizeof *o);
    if (o == NULL) {   /* cannot owe it: the connection ends, its client asks again */
        conn_break(c);
        out->kind = EV_DROP;
        out->drop = DROP_BROKEN;
        return 1;
    }
    atomic_fetch_add(&c->refs, 1);
    atomic_fetch_add(&x->refs, 1);
    *o = (struct owed){NULL, c, x, req_id, client, seq ? seq + 1 : 0, offset, length, word, parties, round, dtype,
                       deadline, 0};
    c->requests++;
    c->busy += mono_now() - started;
    if (last) {   /* its own sum right behind PUSHED, then every sum the round owes */
        struct narrowed shared = {NULL, 0, 0, 0, NULL};
        deliver(o, c, &shared);
        complete_round(x, word, round, c, &shared);
    } else {
        owe(o);
    }
    return 1;
refused:
    entry_drop(c->dd, entry);
    c->errors++;
    out->v[0] = req_id;
    return 2;
}

/* Serve frames until one needs Python, the tick passes with nothing, or something
 * happens that Python must see. The header of a frame for Python is left in ``header``. */
static void serve_frames(struct conn *c, unsigned char *header, double tick, struct outcome *out)
{
    double tick_end = mono_now() + tick;
    for (;;) {
        /* a sum handed back: sent from here, this connection's own thread, which may
         * wait for its socket's room (another connection's thread could not); one this
         * thread could not send either, or parked past its time: Python answers it */
        pthread_mutex_lock(&c->q_mu);
        struct event *e = c->q_head;
        if (e != NULL && (c->q_head = e->next) == NULL)
            c->q_tail = NULL;
        pthread_mutex_unlock(&c->q_mu);
        if (e != NULL) {
            struct owed *o = e->owed;
            free(e);
            if (!o->tried && mono_now() < o->deadline) {
                o->tried = 1;
                deliver(o, c, NULL);   /* takes it: sent, or handed back again, tried */
                continue;
            }
            out->kind = EV_HAND_BACK;
            out->owed = o;
            return;
        }
        struct owed *late = NULL;
        if (atomic_load(&parked_count) && mono_now() >= c->next_look) {
            c->next_look = mono_now() + LOOK_EVERY;
            late = take_overdue(c, 0);
        }
        if (late != NULL) {
            while (late != NULL) {
                struct owed *next = late->next;
                hand_back(late);
                late = next;
            }
            continue;
        }
        /* the next header: its first byte starts the frame's deadline */
        size_t got = 0;
        ssize_t n = recv(c->fd, header, HEADER_BYTES, MSG_DONTWAIT);
        if (n == 0) {
            out->kind = EV_EOF;
            return;
        }
        if (n < 0) {
            if (errno == ETIMEDOUT) {
                out->kind = EV_DROP;
                out->drop = DROP_DEAD_PEER;
                return;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                out->kind = EV_DROP;
                out->drop = DROP_BROKEN;
                return;
            }
            double left = tick_end - mono_now();
            if (left <= 0) {
                out->kind = EV_TICK;
                return;
            }
            struct pollfd p[2] = {{c->fd, POLLIN, 0}, {c->evfd, POLLIN, 0}};
            int ms = (int)(left * 1000) + 1;
            if (atomic_load(&parked_count) && ms > LOOK_EVERY * 1000)
                ms = LOOK_EVERY * 1000;   /* parked sums' deadlines are looked at this often */
            if (poll(p, 2, ms) > 0 && (p[1].revents & POLLIN)) {
                uint64_t drained;
                ssize_t r = read(c->evfd, &drained, sizeof drained);
                (void)r;
            }
            continue;
        }
        got = (size_t)n;
        double started = mono_now(), frame_deadline = started + c->frame_timeout;
        if (got < HEADER_BYTES) {
            int why = read_all(c, header + got, HEADER_BYTES - got, frame_deadline);
            if (why) {
                out->kind = EV_DROP;
                out->drop = why == DROP_BROKEN ? DROP_PROTOCOL : why;   /* truncated header */
                out->v[0] = (int64_t)got;
                return;
            }
        }
        uint16_t magic;
        memcpy(&magic, header, 2);
        struct xt *x;
        if (magic != MAGIC || header[2] != OP_REDUCE || (x = registered(c, (int64_t)get_u64(header + 8))) == NULL
            || atomic_load(&x->state) != XT_OPEN) {
            out->kind = EV_PYTHON;
            return;
        }
        int served = reduce(c, header, x, frame_deadline, started, out);
        if (served == 0) {
            out->kind = EV_PYTHON;
            return;
        }
        if (served == 2 || out->kind == EV_DROP)
            return;
        if (mono_now() >= tick_end) {   /* busy: Python still looks in every tick */
            out->kind = EV_TICK;
            return;
        }
    }
}

static PyObject *conn_serve(ConnObject *self, PyObject *args)
{
    Py_buffer header;
    double tick;
    if (!PyArg_ParseTuple(args, "w*d", &header, &tick))
        return NULL;
    if (header.len != HEADER_BYTES) {
        PyBuffer_Release(&header);
        PyErr_Format(PyExc_ValueError, "a header buffer is %d bytes", HEADER_BYTES);
        return NULL;
    }
    struct outcome out;
    memset(&out, 0, sizeof out);
    Py_BEGIN_ALLOW_THREADS
    serve_frames(self->c, header.buf, tick, &out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&header);
    if (out.kind == EV_HAND_BACK) {
        struct owed *o = out.owed;
        double left = o->deadline - mono_now();
        PyObject *r = Py_BuildValue("(iILLLKKLLLid)", EV_HAND_BACK, o->req_id, (long long)o->x->extent_id,
                                    (long long)o->offset, (long long)o->length, (unsigned long long)o->client,
                                    (unsigned long long)o->seq, (long long)o->word, (long long)o->parties,
                                    (long long)o->round, o->dtype, left);
        Py_BEGIN_ALLOW_THREADS
        owed_free(o);
        Py_END_ALLOW_THREADS
        return r;
    }
    switch (out.kind) {
    case EV_DROP:
        return Py_BuildValue("(iiL)", EV_DROP, out.drop, (long long)out.v[0]);
    case EV_REFUSED:
        return Py_BuildValue("(iLLLLLLL)", EV_REFUSED, out.v[0], out.v[1], out.v[2], out.v[3], out.v[4], out.v[5],
                             out.v[6]);
    case EV_ABSENT:
        return Py_BuildValue("(iLLLLd)", EV_ABSENT, out.v[0], out.v[1], out.v[2], out.v[3], out.d);
    case EV_NOT_OPEN:
        return Py_BuildValue("(iLLL)", EV_NOT_OPEN, out.v[0], out.v[1], out.v[2]);
    default:
        return Py_BuildValue("(i)", out.kind);
    }
}

static PyMethodDef conn_methods[] = {
    {"serve", (PyCFunction)conn_serve, METH_VARARGS,
     "serve(header, tick)\n--\n\nServe frames natively until one is Python's (its header is left in "
     "header), tick seconds pass with none, or an event comes up; returns the event as a tuple "
     "(its first item, EV_*, says which)."},
    {"register", (PyCFunction)conn_register, METH_VARARGS,
     "register(extent_id, handle, expires)\n--\n\nThis connection's ticket lets it write the extent "
     "until expires (time.time()): its REDUCEs may be served natively."},
    {"owe", (PyCFunction)conn_owe, METH_VARARGS,
     "owe(handle, req_id, offset, length, client, seq, word, parties, round, dtype, timeout)\n--\n\n"
     "Park the sum a REDUCE served by Python owes, until the push that completes its round sends it "
     "(at once, from here, when it completed already)."},
    {"end", (PyCFunction)conn_py_end, METH_NOARGS,
     "The connection ends: nothing is sent on it from now on; its parked sums are dropped."},
    {"counters", (PyCFunction)conn_counters, METH_NOARGS,
     "(operations, bytes_accumulated, bytes_read, errors, requests, busy seconds, waits for a frame's "
     "bytes) since the last call."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smb_server.memserver._native.Conn",
    .tp_doc = "Conn(fd, send_lock, table, frame_timeout)\n--\n\nA tcp connection's native REDUCE "
              "service (serve.c): fd is the non-blocking socket (not owned), send_lock the connection's "
              "recursive Mutex, table the node's DedupTable.",
    .tp_basicsize = sizeof(ConnObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = conn_new,
    .tp_dealloc = (destructor)conn_dealloc,
    .tp_methods = conn_methods,
};

static PyMethodDef serve_functions[] = {
    {"complete", py_complete, METH_VARARGS,
     "complete(handle, word, round)\n--\n\nA push served by Python completed the round: send every "
     "sum parked for it."},
    {"parked", py_parked, METH_NOARGS, "Sums parked now (all connections)."},
    {NULL, NULL, 0, NULL},
};

int serve_register(PyObject *module)
{
    kernels = PyCapsule_Import(KERNELS_CAPSULE, 0);   /* chunks_register imported its module */
    if (kernels == NULL || PyType_Ready(&HandleType) < 0 || PyType_Ready(&ConnType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "ExtentHandle", (PyObject *)&HandleType) < 0
        || PyModule_AddObjectRef(module, "Conn", (PyObject *)&ConnType) < 0
        || PyModule_AddFunctions(module, serve_functions) < 0)
        return -1;
    static const struct { const char *name; int value; } names[] = {
        {"EV_PYTHON", EV_PYTHON}, {"EV_TICK", EV_TICK}, {"EV_EOF", EV_EOF}, {"EV_DROP", EV_DROP},
        {"EV_REFUSED", EV_REFUSED}, {"EV_ABSENT", EV_ABSENT}, {"EV_NOT_OPEN", EV_NOT_OPEN},
        {"EV_HAND_BACK", EV_HAND_BACK}, {"DROP_PROTOCOL", DROP_PROTOCOL}, {"DROP_FRAME_LATE", DROP_FRAME_LATE},
        {"DROP_DEAD_PEER", DROP_DEAD_PEER}, {"DROP_BROKEN", DROP_BROKEN}, {"XT_OPEN", XT_OPEN},
        {"XT_BLOCKED", XT_BLOCKED}, {"XT_DEAD", XT_DEAD},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (PyModule_AddIntConstant(module, names[i].name, names[i].value) < 0)
            return -1;
    return 0;
}
