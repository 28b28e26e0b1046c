/*
 * cached_client._gather: FastLoader's local read of one reply's members, in C.
 *
 * The Python path (cached_client/fast.py _Filling.receive, then local.py
 * LocalPayload.read_many) spends about 2.5 us of interpreter time per member: the
 * layout of each member in its extension's buffer, one memoryview slice per member
 * and per gap, and one XXH3 call per member after every run was read. Here one call
 * lays a reply's samples out (layout) and one reads them (read): the runs by preadv
 * straight into the ring's buffers, each member checked while it is still in cache,
 * without the GIL. docs/decisions.md, D32.
 *
 * The plan that layout returns is a bytes object of `struct place`, one per member in
 * order; read takes it with the buffers of its extensions. Either function's failure
 * modes are the Python path's: a short read or a failed checksum is returned (the
 * caller falls back to the socket), an OSError is raised.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#if defined(CACHED_X86_DISPATCH)
#include "xxh_x86dispatch.h"
#define MEMBER_HASH XXH3_64bits_dispatch
#else
#define XXH_INLINE_ALL
#include "xxhash.h"
#define MEMBER_HASH XXH3_64bits
#endif

/* As local.py: bytes between two members that one preadv still spans. */
#define MAX_GAP (64 << 10)
/* A run ends once it holds this many bytes, so that its members are still in the core's
 * L2 cache when they are checked: 0.73-0.75x a raw read against 0.58-0.64x with whole-shard
 * runs (4 MB shards of 100 KB members; D32). */
#define RUN_BYTES (256 << 10)

enum { HAS_OFFSET = 1, HAS_CHECKSUM = 2 };

struct place {
    uint32_t ext;      /* index into the extension list layout returns */
    uint32_t flags;    /* HAS_OFFSET, HAS_CHECKSUM */
    uint64_t at;       /* where in its extension's buffer */
    uint64_t size;
    uint64_t offset;   /* where in the shard file (local replies) */
    uint64_t checksum; /* XXH3-64 (local replies of a daemon that gives it) */
};

/* offsets.setdefault(ext, [0] * (n + 1)) */
static PyObject *offsets_of(PyObject *offsets, PyObject *ext, Py_ssize_t n) {
    PyObject *list = PyDict_GetItemWithError(offsets, ext);
    if (list != NULL || PyErr_Occurred())
        return list;
    list = PyList_New(n + 1);
    if (list == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(list);
        return NULL;
    }
    for (Py_ssize_t i = 0; i <= n; i++) {
        Py_INCREF(zero);
        PyList_SET_ITEM(list, i, zero);
    }
    Py_DECREF(zero);
    int failed = PyDict_SetItem(offsets, ext, list);
    Py_DECREF(list); /* the dict holds it */
    return failed ? NULL : list;
}

static int append_long(PyObject *list, unsigned long long value) {
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (v == NULL)
        return -1;
    int failed = PyList_Append(list, v);
    Py_DECREF(v);
    return failed;
}

static int member_u64(PyObject *member, Py_ssize_t i, uint64_t *out) {
    PyObject *v = PyList_GET_ITEM(member, i);
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "member field %zd is not an integer", i);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* layout(samples, used, offsets, keys, exts) -> plan
 *
 * What _Filling.receive's loop does, for `samples` ([key, members], each member
 * [ext, size] or [ext, size, offset, checksum]): each member placed after the bytes
 * already `used` of its extension, `offsets` and `keys` extended as the batch records
 * them. `exts` (a list) maps the plan's extension indices to names; new ones are
 * appended. `checked`: take the fourth field as a checksum. */
static PyObject *layout(PyObject *self, PyObject *args) {
    PyObject *samples, *used, *offsets, *keys, *exts;
    int checked;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!p", &PyList_Type, &samples, &PyDict_Type, &used,
                          &PyDict_Type, &offsets, &PyList_Type, &keys, &PyList_Type, &exts,
                          &checked))
        return NULL;
    Py_ssize_t count = 0, ns = PyList_GET_SIZE(samples);
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *sample = PyList_GET_ITEM(samples, s);
        if (!PyList_Check(sample) || PyList_GET_SIZE(sample) != 2 ||
            !PyList_Check(PyList_GET_ITEM(sample, 1))) {
            PyErr_SetString(PyExc_TypeError, "a sample is not [key, members]");
            return NULL;
        }
        count += PyList_GET_SIZE(PyList_GET_ITEM(sample, 1));
    }
    PyObject *plan = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(struct place));
    if (plan == NULL)
        return NULL;
    struct place *p = (struct place *)PyBytes_AS_STRING(plan);
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *sample = PyList_GET_ITEM(samples, s);
        PyObject *members = PyList_GET_ITEM(sample, 1);
        Py_ssize_t n = PyList_GET_SIZE(keys), nm = PyList_GET_SIZE(members);
        for (Py_ssize_t m = 0; m < nm; m++, p++) {
            PyObject *member = PyList_GET_ITEM(members, m);
            Py_ssize_t fields = PyList_Check(member) ? PyList_GET_SIZE(member) : 0;
            if (fields < 2 || !PyUnicode_Check(PyList_GET_ITEM(member, 0))) {
                PyErr_SetString(PyExc_TypeError, "a member is not [ext, size, ...]");
                goto fail;
            }
            PyObject *ext = PyList_GET_ITEM(member, 0);
            memset(p, 0, sizeof *p);
            if (member_u64(member, 1, &p->size) < 0)
                goto fail;
            if (fields >= 3 && PyList_GET_ITEM(member, 2) != Py_None) {
                if (member_u64(member, 2, &p->offset) < 0)
                    goto fail;
                p->flags |= HAS_OFFSET;
            }
            if (checked && fields >= 4 && PyList_GET_ITEM(member, 3) != Py_None) {
                if (member_u64(member, 3, &p->checksum) < 0)
                    goto fail;
                p->flags |= HAS_CHECKSUM;
            }
            PyObject *was = PyDict_GetItemWithError(used, ext);
            if (was == NULL && PyErr_Occurred())
                goto fail;
            unsigned long long at = was == NULL ? 0 : PyLong_AsUnsignedLongLong(was);
            if (at == (unsigned long long)-1 && PyErr_Occurred())
                goto fail;
            p->at = at;
            PyObject *end = PyLong_FromUnsignedLongLong(at + p->size);
            if (end == NULL)
                goto fail;
            int failed = PyDict_SetItem(used, ext, end);
            Py_DECREF(end);
            if (failed)
                goto fail;
            PyObject *offs = offsets_of(offsets, ext, n);
            if (offs == NULL || append_long(offs, at + p->size) < 0)
                goto fail;
            Py_ssize_t e = 0, ne = PyList_GET_SIZE(exts);
            for (; e < ne; e++) { /* a few extensions: a scan beats a dict */
                PyObject *known = PyList_GET_ITEM(exts, e);
                if (known == ext)
                    break;
                int same = PyUnicode_Compare(known, ext);
                if (same == -1 && PyErr_Occurred())
                    goto fail;
                if (same == 0)
                    break;
            }
            if (e == ne && PyList_Append(exts, ext) < 0)
                goto fail;
            p->ext = (uint32_t)e;
        }
        if (PyList_Append(keys, PyList_GET_ITEM(sample, 0)) < 0)
            goto fail;
        if (nm < PyDict_GET_SIZE(offsets)) { /* this sample lacks an extension */
            PyObject *name, *offs;
            Py_ssize_t pos = 0;
            while (PyDict_Next(offsets, &pos, &name, &offs)) {
                Py_ssize_t len = PyList_GET_SIZE(offs);
                if (len < n + 2 && PyList_Append(offs, PyList_GET_ITEM(offs, len - 1)) < 0)
                    goto fail;
            }
        }
    }
    return plan;
fail:
    Py_DECREF(plan);
    return NULL;
}

static int run_read(int fd, struct iovec *iov, int niov, uint64_t start, uint64_t end,
                    int *err) {
    ssize_t got = preadv(fd, iov, niov, (off_t)start);
    if (got < 0) {
        *err = errno;
        return -1;
    }
    return (uint64_t)got == end - start ? 0 : 1;
}

/* read(fd, plan, buffers, first, count) -> None | (why, offset)
 *
 * Members first..first+count of `plan` from the shard file `fd` into `buffers` (one
 * writable buffer per extension index): runs of members at most MAX_GAP apart are one
 * preadv (the bytes between them into a scratch buffer), each member checked against
 * its checksum once its run is in. Returns None, or ("short", offset) /
 * ("checksum", offset) for the first failure; raises OSError. */
static PyObject *read_plan(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer plan;
    PyObject *buffers;
    Py_ssize_t first, count;
    if (!PyArg_ParseTuple(args, "iy*O!nn", &fd, &plan, &PyList_Type, &buffers, &first, &count))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t nbuf = PyList_GET_SIZE(buffers), held = 0;
    Py_buffer *views = PyMem_Calloc(nbuf ? nbuf : 1, sizeof(Py_buffer));
    long iov_max = sysconf(_SC_IOV_MAX);
    int max_iov = iov_max > 0 && iov_max < INT_MAX ? (int)iov_max : 1024;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)max_iov);
    char *scratch = PyMem_Malloc(MAX_GAP);
    Py_ssize_t total = plan.len / (Py_ssize_t)sizeof(struct place);
    if (views == NULL || iov == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (first < 0 || count < 0 || first + count > total) {
        PyErr_SetString(PyExc_IndexError, "members outside the plan");
        goto done;
    }
    for (; held < nbuf; held++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, held), &views[held],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    const struct place *places = (const struct place *)plan.buf + first;
    for (Py_ssize_t i = 0; i < count; i++) {
        const struct place *p = &places[i];
        if (p->ext >= (uint64_t)nbuf || !(p->flags & HAS_OFFSET) ||
            p->at + p->size > (uint64_t)views[p->ext].len) {
            PyErr_SetString(PyExc_ValueError, "a member outside its buffer, or without offset");
            goto done;
        }
    }
    int err = 0, status = 0;
    Py_ssize_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < count && status == 0) {
        /* One run: members from i on, in file order, each at most MAX_GAP after the last. */
        Py_ssize_t j = i;
        int niov = 0;
        uint64_t start = places[i].offset, end = start;
        while (j < count && niov < max_iov - 1) {
            const struct place *p = &places[j];
            if (j > i && (p->offset < end || p->offset - end > MAX_GAP ||
                          end - start >= RUN_BYTES))
                break;
            if (p->offset > end)
                iov[niov++] = (struct iovec){scratch, (size_t)(p->offset - end)};
            iov[niov++] = (struct iovec){(char *)views[p->ext].buf + p->at, (size_t)p->size};
            end = p->offset + p->size;
            j++;
        }
        status = run_read(fd, iov, niov, start, end, &err);
        if (status != 0) {
            bad = i;
            break;
        }
        for (; i < j; i++) {
            const struct place *p = &places[i];
            if ((p->flags & HAS_CHECKSUM) &&
                MEMBER_HASH((const char *)views[p->ext].buf + p->at, (size_t)p->size) !=
                    p->checksum) {
                status = 2;
                bad = i;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (status < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (status == 0) {
        result = Py_NewRef(Py_None);
    } else {
        result = Py_BuildValue("(sK)", status == 1 ? "short" : "checksum",
                               (unsigned long long)places[bad].offset);
    }
done:
    for (Py_ssize_t k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(scratch);
    PyBuffer_Release(&plan);
    return result;
}

/* checksum(data) -> int: the member checksum this module checks (XXH3-64). */
static PyObject *checksum(PyObject *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    XXH64_hash_t h = MEMBER_HASH(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"layout", layout, METH_VARARGS, "Lay a reply's samples out in a batch's buffers."},
    {"read", read_plan, METH_VARARGS, "Read laid-out members from a shard file."},
    {"checksum", checksum, METH_O, "XXH3-64 of a buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cached_client._gather",
    "FastLoader's local reads in C (docs/decisions.md, D32).", -1, methods,
};

PyMODINIT_FUNC PyInit__gather(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "PLACE_SIZE", (long)sizeof(struct place)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_GAP", MAX_GAP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
