/* A UCX tag receive whose copy-out also hashes: each fragment UCX hands over is copied into
 * the destination and folded into the xxh3-64 of the piece (layer chunk) it belongs to while it
 * is still in cache, instead of hashing the whole payload again once it has landed.
 *
 * It uses UCX's generic datatype: UCX calls unpack(offset, src, length) for each fragment of a
 * matched message. Fragments that arrive out of order are still copied, but the digests are
 * then left to the caller (digests is None). Everything here runs on the thread that
 * progresses the worker; the completion callback touches no Python object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <ucp/api/ucp.h>
#define XXH_INLINE_ALL
#include <xxhash.h>
#if XXH_VERSION_NUMBER < 800
#error "xxhash >= 0.8 needed: XXH3's output is stable from 0.8.0 on (the python xxhash the daemon uses)"
#endif

typedef struct {
    char *dst;
    size_t size, piece;
    size_t next;        /* the next offset expected in order */
    int in_order;
    XXH3_state_t xs;
    size_t fill;        /* bytes of the current piece hashed so far */
    size_t ndig, maxdig;
    uint64_t *dig;
    int done;
    ucs_status_t status;
    size_t length;      /* bytes the sender sent (on success) */
    void *req;
    Py_buffer view;
} rstate;

static int is_done(rstate *st)
{
    return __atomic_load_n(&st->done, __ATOMIC_ACQUIRE);
}

static ucp_datatype_t fused_dt;
static int dt_ready;

static void *start_pack(void *context, const void *buffer, size_t count) { return NULL; }
static void *start_unpack(void *context, void *buffer, size_t count) { return buffer; }
static size_t packed_size(void *state) { return ((rstate *)state)->size; }
static size_t pack(void *state, size_t offset, void *dest, size_t max_length) { return 0; }
static void finish(void *state) {}

static ucs_status_t unpack(void *state, size_t offset, const void *src, size_t length)
{
    rstate *st = state;
    if (offset > st->size || length > st->size - offset)
        return UCS_ERR_MESSAGE_TRUNCATED;
    char *p = st->dst + offset;
    memcpy(p, src, length);
    if (!st->in_order)
        return UCS_OK;
    if (offset != st->next) {
        st->in_order = 0;
        return UCS_OK;
    }
    st->next += length;
    while (length) {
        size_t take = st->piece - st->fill;
        if (take > length)
            take = length;
        XXH3_64bits_update(&st->xs, p, take);
        st->fill += take;
        p += take;
        length -= take;
        if (st->fill == st->piece) {
            if (st->ndig < st->maxdig)
                st->dig[st->ndig++] = XXH3_64bits_digest(&st->xs);
            XXH3_64bits_reset(&st->xs);
            st->fill = 0;
        }
    }
    return UCS_OK;
}

static ucp_generic_dt_ops_t ops = {start_pack, start_unpack, packed_size, pack, unpack, finish};

/* States whose Python object went away before UCX let go of them; released with the GIL. */
static rstate **grave;
static size_t ngrave, capgrave;

static void free_state(rstate *st)
{
    PyBuffer_Release(&st->view);
    PyMem_RawFree(st->dig);
    free(st);
}

static void reap(void)
{
    size_t keep = 0;
    for (size_t i = 0; i < ngrave; i++) {
        if (is_done(grave[i]))
            free_state(grave[i]);
        else
            grave[keep++] = grave[i];
    }
    ngrave = keep;
}

static void recv_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data)
{
    rstate *st = user_data;
    st->status = status;
    if (status == UCS_OK)
        st->length = info->length;
    st->req = NULL;
    ucp_request_free(request);
    /* last, with release order: a thread that sees done may free st (Recv_dealloc) */
    __atomic_store_n(&st->done, 1, __ATOMIC_RELEASE);
}


typedef struct {
    PyObject_HEAD
    rstate *st;
    ucp_worker_h worker;
} Recv;

static void Recv_dealloc(Recv *self)
{
    rstate *st = self->st;
    if (st) {
        if (is_done(st)) {
            free_state(st);
        } else {
            /* UCX still owns it. No UCX call here: the last reference may go on any thread
             * (the cyclic GC), and only the worker's thread may touch the worker. The owner
             * cancels what it still has posted (ucx.py's teardown); the state is kept, and
             * freed by the next Recv posted once UCX has completed it. */
            if (ngrave == capgrave) {
                size_t cap = capgrave ? 2 * capgrave : 16;
                rstate **g = PyMem_RawRealloc(grave, cap * sizeof *g);
                if (g) {
                    grave = g;
                    capgrave = cap;
                }
            }
            if (ngrave < capgrave)
                grave[ngrave++] = st;  /* else leaked: better than a use after free */
        }
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Recv_init(Recv *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"worker", "buffer", "tag", "mask", "piece", NULL};
    unsigned long long worker, tag, mask;
    Py_buffer view;
    Py_ssize_t piece;
    if (self->st) {
        PyErr_SetString(PyExc_RuntimeError, "Recv already posted");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Kw*KKn", names, &worker, &view, &tag, &mask, &piece))
        return -1;
    reap();
    if (piece <= 0 || view.len == 0 || view.len % piece) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "a %zd-byte buffer is not whole pieces of %zd bytes", view.len, piece);
        return -1;
    }
    if (!PyBuffer_IsContiguous(&view, 'C')) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "buffer must be contiguous");
        return -1;
    }
    /* XXH3_state_t must be 64-byte aligned (its vector code loads it aligned) */
    rstate *st = aligned_alloc(64, (sizeof *st + 63) & ~(size_t)63);
    if (st) {
        memset(st, 0, sizeof *st);
        st->dig = PyMem_RawMalloc((view.len / piece) * sizeof(uint64_t));
    }
    if (!st || !st->dig) {
        free(st);
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    st->view = view;
    st->dst = view.buf;
    st->size = view.len;
    st->piece = piece;
    st->maxdig = view.len / piece;
    st->in_order = 1;
    XXH3_64bits_reset(&st->xs);
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_DATATYPE |
                     UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = recv_cb;
    p.datatype = fused_dt;
    p.user_data = st;
    void *req = ucp_tag_recv_nbx((ucp_worker_h)(uintptr_t)worker, st, st->size, tag, mask, &p);
    if (UCS_PTR_IS_ERR(req)) {
        ucs_status_t s = UCS_PTR_STATUS(req);
        free_state(st);
        PyErr_Format(PyExc_RuntimeError, "ucp_tag_recv_nbx: %s", ucs_status_string(s));
        return -1;
    }
    if (!is_done(st))  /* UCX may complete it inside the call, and then it freed req */
        st->req = req;
    self->st = st;
    self->worker = (ucp_worker_h)(uintptr_t)worker;
    return 0;
}

static PyObject *Recv_completed(Recv *self, void *c)
{
    return PyBool_FromLong(self->st && is_done(self->st));
}

static PyObject *Recv_status(Recv *self, void *c)
{
    if (!self->st || !is_done(self->st))
        Py_RETURN_NONE;
    if (self->st->status == UCS_OK)
        return PyUnicode_FromString("");
    return PyUnicode_FromString(ucs_status_string(self->st->status));
}

static PyObject *Recv_length(Recv *self, void *c)
{
    return PyLong_FromSize_t(self->st && is_done(self->st) ? self->st->length : 0);
}

static PyObject *Recv_digests(Recv *self, void *c)
{
    rstate *st = self->st;
    if (!st || !is_done(st) || st->status != UCS_OK || !st->in_order || st->ndig != st->maxdig)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(st->ndig);
    if (!out)
        return NULL;
    for (size_t i = 0; i < st->ndig; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(st->dig[i]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *Recv_check_error(Recv *self, PyObject *unused)
{
    if (!self->st || !is_done(self->st)) {
        PyErr_SetString(PyExc_RuntimeError, "receive not completed");
        return NULL;
    }
    if (self->st->status != UCS_OK) {
        PyErr_Format(PyExc_RuntimeError, "UCX receive failed: %s", ucs_status_string(self->st->status));
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Recv_cancel(Recv *self, PyObject *unused)
{
    if (self->st && !is_done(self->st) && self->st->req)
        ucp_request_cancel(self->worker, self->st->req);
    Py_RETURN_NONE;
}

static PyGetSetDef Recv_getset[] = {
    {"completed", (getter)Recv_completed, NULL, "UCX completed the receive (well or not)", NULL},
    {"status", (getter)Recv_status, NULL, "None while pending; '' on success; else UCX's reason", NULL},
    {"length", (getter)Recv_length, NULL, "bytes the sender sent", NULL},
    {"digests", (getter)Recv_digests, NULL, "xxh3-64 of each piece, or None", NULL},
    {NULL}
};

static PyMethodDef Recv_methods[] = {
    {"cancel", (PyCFunction)Recv_cancel, METH_NOARGS, "ask UCX to cancel the receive (it then completes)"},
    {"check_error", (PyCFunction)Recv_check_error, METH_NOARGS, "raise RuntimeError unless it succeeded"},
    {NULL}
};

static PyTypeObject RecvType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_fused.Recv",
    .tp_basicsize = sizeof(Recv),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Recv(worker, buffer, tag, mask, piece): a tagged receive that hashes as it copies",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recv_init,
    .tp_dealloc = (destructor)Recv_dealloc,
    .tp_getset = Recv_getset,
    .tp_methods = Recv_methods,
};

static PyObject *transports(PyObject *mod, PyObject *arg)
{
    unsigned long long ep = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    ucp_transport_entry_t entries[64];
    ucp_ep_attr_t attr;
    memset(&attr, 0, sizeof attr);
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 64;
    attr.transports.entry_size = sizeof entries[0];
    ucs_status_t s = ucp_ep_query((ucp_ep_h)(uintptr_t)ep, &attr);
    if (s != UCS_OK)
        return PyErr_Format(PyExc_RuntimeError, "ucp_ep_query: %s", ucs_status_string(s));
    PyObject *out = PyList_New(0);
    for (unsigned i = 0; out && i < attr.transports.num_entries; i++) {
        PyObject *t = Py_BuildValue("(ss)", entries[i].transport_name ? entries[i].transport_name : "",
                                    entries[i].device_name ? entries[i].device_name : "");
        if (!t || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(t);
    }
    return out;
}

static PyMethodDef mod_methods[] = {
    {"transports", transports, METH_O, "transports(ep_handle): the (transport, device) of each lane UCX chose"},
    {NULL}
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit__fused(void)
{
    if (!dt_ready) {
        ucs_status_t s = ucp_dt_create_generic(&ops, NULL, &fused_dt);
        if (s != UCS_OK) {
            PyErr_Format(PyExc_ImportError, "ucp_dt_create_generic: %s", ucs_status_string(s));
            return NULL;
        }
        dt_ready = 1;
    }
    if (PyType_Ready(&RecvType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m)
        return NULL;
    Py_INCREF(&RecvType);
    if (PyModule_AddObject(m, "Recv", (PyObject *)&RecvType) < 0) {
        Py_DECREF(&RecvType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
