/*
 * cached_client._gather: FastLoader's local read of one reply's members, in C.
 *
 * The Python path (cached_client/filling.py Filling.receive, then local.py
 * LocalPayload.read_many) spends about 2.5 us of interpreter time per member: the
 * layout of each member in its extension's buffer, one memoryview slice per member
 * and per gap, and one XXH3 call per member after every run was read. Here one call
 * lays a reply's samples out (layout_packed) and one reads them (read): the runs by preadv
 * straight into the ring's buffers, each member checked while it is still in cache,
 * without the GIL. docs/decisions.md, D32.
 *
 * The plan that layout_packed returns is a bytes object of `struct place`, one per member in
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

/* As local_files.py: bytes between two members that one preadv still spans. */
#define MAX_GAP (64 << 10)
/* A run ends once it holds this many bytes, so that its members are still in the core's
 * L2 cache when they are checked: 0.73-0.75x a raw read against 0.58-0.64x with whole-shard
 * runs (4 MB shards of 100 KB members; D32). */
#define RUN_BYTES (256 << 10)

enum { HAS_OFFSET = 1, HAS_CHECKSUM = 2 };

struct place {
    uint32_t ext;      /* index into the extension list layout_packed returns */
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

/* What one layout call keeps of each extension it meets: the bytes used in its buffer
 * (written back to `used` at the end), its offsets list, its index in `exts`. As many
 * as the reply names (any number: the array grows), found by name through `by_name`. */
struct ext_state {
    PyObject *name; /* borrowed from `names` */
    unsigned long long at;
    PyObject *offs; /* borrowed from `offsets` */
    uint32_t index;
};

struct layout_state {
    PyObject *used, *offsets, *keys, *exts;
    PyObject *by_name;   /* name -> its slot in `ext` (a new dict) */
    PyObject *in_exts;   /* name -> its index in `exts` (a new dict) */
    struct ext_state *ext;
    Py_ssize_t n_ext, cap;
};

/* A file offset or a buffer size that a member's bytes may reach (off_t, ssize_t). */
#define BYTES_MAX ((uint64_t)INT64_MAX)

static int layout_begin(struct layout_state *st) {
    st->by_name = PyDict_New();
    st->in_exts = PyDict_New();
    if (st->by_name == NULL || st->in_exts == NULL)
        return -1;
    Py_ssize_t ne = PyList_GET_SIZE(st->exts);
    for (Py_ssize_t i = ne - 1; i >= 0; i--) { /* the first of equal names wins */
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL)
            return -1;
        int failed = PyDict_SetItem(st->in_exts, PyList_GET_ITEM(st->exts, i), index);
        Py_DECREF(index);
        if (failed)
            return -1;
    }
    return 0;
}

static void layout_end(struct layout_state *st) {
    Py_CLEAR(st->by_name);
    Py_CLEAR(st->in_exts);
    PyMem_Free(st->ext);
    st->ext = NULL;
}

static struct ext_state *ext_of(struct layout_state *st, PyObject *name, Py_ssize_t n) {
    /* The few extensions of a usual reply: by identity (the names are interned). */
    Py_ssize_t few = st->n_ext < 8 ? st->n_ext : 8;
    for (Py_ssize_t i = 0; i < few; i++)
        if (st->ext[i].name == name)
            return &st->ext[i];
    PyObject *slot = PyDict_GetItemWithError(st->by_name, name);
    if (slot != NULL)
        return &st->ext[PyLong_AsSsize_t(slot)];
    if (PyErr_Occurred())
        return NULL;
    if (st->n_ext == UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more extensions in one reply than 2^32 - 1");
        return NULL;
    }
    if (st->n_ext == st->cap) {
        Py_ssize_t cap = st->cap ? 2 * st->cap : 16;
        struct ext_state *grown = PyMem_Realloc(st->ext, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        st->ext = grown;
        st->cap = cap;
    }
    struct ext_state *e = &st->ext[st->n_ext];
    PyObject *was = PyDict_GetItemWithError(st->used, name);
    if (was == NULL && PyErr_Occurred())
        return NULL;
    e->at = was == NULL ? 0 : PyLong_AsUnsignedLongLong(was);
    if (e->at == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    e->offs = offsets_of(st->offsets, name, n);
    if (e->offs == NULL)
        return NULL;
    PyObject *index = PyDict_GetItemWithError(st->in_exts, name);
    if (index == NULL) {
        if (PyErr_Occurred())
            return NULL;
        index = PyLong_FromSsize_t(PyList_GET_SIZE(st->exts));
        if (index == NULL)
            return NULL;
        int failed = PyDict_SetItem(st->in_exts, name, index) < 0 ||
                     PyList_Append(st->exts, name) < 0;
        Py_DECREF(index);
        if (failed)
            return NULL;
        index = PyDict_GetItemWithError(st->in_exts, name);
        if (index == NULL)
            return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i < 0 || i > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more extensions in one reply than 2^32 - 1");
        return NULL;
    }
    PyObject *mine = PyLong_FromSsize_t(st->n_ext);
    if (mine == NULL)
        return NULL;
    int failed = PyDict_SetItem(st->by_name, name, mine);
    Py_DECREF(mine);
    if (failed)
        return NULL;
    e->name = name;
    e->index = (uint32_t)i;
    st->n_ext++;
    return e;
}

/* Member `p` (its size, offset, checksum set) of extension `name`, in sample `n` of the
 * batch: placed after the bytes of its extension's buffer already used. */
static int place(struct layout_state *st, struct place *p, PyObject *name, Py_ssize_t n) {
    struct ext_state *e = ext_of(st, name, n);
    if (e == NULL)
        return -1;
    /* Sizes and the bytes used add up in 64 bits without wrapping: no buffer, and no
     * batch, holds more than BYTES_MAX bytes (the Python reader's check_rows says the same). */
    if (p->size > BYTES_MAX || e->at > BYTES_MAX - p->size) {
        PyErr_SetString(PyExc_OverflowError, "an extension's members add up past 2^63 - 1 bytes");
        return -1;
    }
    p->ext = e->index;
    p->at = e->at;
    e->at += p->size;
    return append_long(e->offs, e->at);
}

/* The sample's key joins the batch; an extension it lacks gets an empty member. */
static int end_sample(struct layout_state *st, PyObject *key, Py_ssize_t n, Py_ssize_t nm) {
    if (PyList_Append(st->keys, key) < 0)
        return -1;
    if (nm < PyDict_GET_SIZE(st->offsets)) {
        PyObject *name, *offs;
        Py_ssize_t pos = 0;
        while (PyDict_Next(st->offsets, &pos, &name, &offs)) {
            Py_ssize_t len = PyList_GET_SIZE(offs);
            if (len < n + 2 && PyList_Append(offs, PyList_GET_ITEM(offs, len - 1)) < 0)
                return -1;
        }
    }
    return 0;
}

/* `used` learns where each extension's bytes now end. */
static int write_back(struct layout_state *st) {
    for (Py_ssize_t i = 0; i < st->n_ext; i++) {
        PyObject *end = PyLong_FromUnsignedLongLong(st->ext[i].at);
        if (end == NULL)
            return -1;
        int failed = PyDict_SetItem(st->used, st->ext[i].name, end);
        Py_DECREF(end);
        if (failed)
            return -1;
    }
    return 0;
}

/* The packed layout of a local reply (docs/protocol.md, "Local reads"; made by the
 * daemon's cached/layouts.py, decoded alike by the client's layouts.py (unpacked)): little-endian
 *   u32 samples, u32 members,
 *   u32 first_member[samples + 1], u32 key_start[samples + 1],
 *   members x {u32 ext, u32 flags (1: has a checksum), u64 size, u64 offset, u64 checksum},
 *   the keys' UTF-8 bytes, end to end. */
struct packed_member {
    uint32_t ext, flags;
    uint64_t size, offset, checksum;
};

struct packed {
    uint32_t samples, members;
    const uint32_t *first_member, *key_start;
    const struct packed_member *member;
    const char *keys;
    Py_ssize_t keys_len;
};

static int parse_packed(const char *buf, Py_ssize_t len, struct packed *out) {
    if (len < 8)
        goto bad;
    memcpy(&out->samples, buf, 4);
    memcpy(&out->members, buf + 4, 4);
    Py_ssize_t tables = 8 + 8 * ((Py_ssize_t)out->samples + 1);
    Py_ssize_t records = (Py_ssize_t)out->members * (Py_ssize_t)sizeof(struct packed_member);
    if (len < tables + records)
        goto bad;
    out->first_member = (const uint32_t *)(buf + 8);
    out->key_start = out->first_member + out->samples + 1;
    out->member = (const struct packed_member *)(buf + tables);
    out->keys = buf + tables + records;
    out->keys_len = len - tables - records;
    if (out->first_member[out->samples] != out->members ||
        out->key_start[out->samples] > (uint64_t)out->keys_len)
        goto bad;
    for (uint32_t s = 0; s < out->samples; s++)
        if (out->first_member[s] > out->first_member[s + 1] ||
            out->key_start[s] > out->key_start[s + 1])
            goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "a packed layout that does not hold together");
    return -1;
}

/* layout_packed(frame, names, first, count, used, offsets, keys, exts, checked) -> plan
 *
 * Lays samples first..first+count of a packed layout (`names`: its extension names, by
 * index) out after the batch's `used` bytes, without a Python object per member: `used`,
 * `offsets` and `keys` extended as FastLoader's Python loop would, `exts` the names of
 * the plan's extension indices. */
static PyObject *layout_packed(PyObject *self, PyObject *args) {
    struct layout_state st = {0};
    Py_buffer frame;
    PyObject *names, *plan = NULL;
    Py_ssize_t first, count;
    int checked;
    if (!PyArg_ParseTuple(args, "y*O!nnO!O!O!O!p", &frame, &PyList_Type, &names, &first, &count,
                          &PyDict_Type, &st.used, &PyDict_Type, &st.offsets, &PyList_Type,
                          &st.keys, &PyList_Type, &st.exts, &checked))
        return NULL;
    struct packed pk;
    if (parse_packed(frame.buf, frame.len, &pk) < 0)
        goto done;
    if (first < 0 || count < 0 || first + count > (Py_ssize_t)pk.samples) {
        PyErr_SetString(PyExc_IndexError, "samples outside the packed layout");
        goto done;
    }
    Py_ssize_t m0 = pk.first_member[first], m1 = pk.first_member[first + count];
    plan = PyBytes_FromStringAndSize(NULL, (m1 - m0) * (Py_ssize_t)sizeof(struct place));
    if (plan == NULL)
        goto done;
    if (layout_begin(&st) < 0)
        goto fail;
    struct place *p = (struct place *)PyBytes_AS_STRING(plan);
    for (Py_ssize_t s = first; s < first + count; s++) {
        Py_ssize_t n = PyList_GET_SIZE(st.keys);
        Py_ssize_t a = pk.first_member[s], b = pk.first_member[s + 1];
        for (Py_ssize_t m = a; m < b; m++, p++) {
            const struct packed_member *pm = &pk.member[m];
            if (pm->ext >= (uint64_t)PyList_GET_SIZE(names)) {
                PyErr_SetString(PyExc_ValueError, "a packed member of an extension not named");
                goto fail;
            }
            *p = (struct place){0, HAS_OFFSET, 0, pm->size, pm->offset, 0};
            if (checked && (pm->flags & 1)) {
                p->checksum = pm->checksum;
                p->flags |= HAS_CHECKSUM;
            }
            if (place(&st, p, PyList_GET_ITEM(names, pm->ext), n) < 0)
                goto fail;
        }
        PyObject *key = PyUnicode_DecodeUTF8(pk.keys + pk.key_start[s],
                                             pk.key_start[s + 1] - pk.key_start[s], "strict");
        if (key == NULL)
            goto fail;
        int failed = end_sample(&st, key, n, b - a);
        Py_DECREF(key);
        if (failed)
            goto fail;
    }
    if (write_back(&st) < 0)
        goto fail;
    goto done;
fail:
    Py_CLEAR(plan);
done:
    layout_end(&st);
    PyBuffer_Release(&frame);
    return plan;
}

/* One preadv of a run; the bytes it got (short only at the file's end), or -1. */
static ssize_t run_read(int fd, struct iovec *iov, int niov, uint64_t start, int *err) {
    if (niov == 0)
        return 0;
    ssize_t got = preadv(fd, iov, niov, (off_t)start);
    if (got < 0)
        *err = errno;
    return got;
}

/* read(fd, plan, buffers, first, count) -> None | (why, offset)
 *
 * Members first..first+count of `plan` from the shard file `fd` into `buffers` (one
 * writable buffer per extension index): runs of members at most MAX_GAP apart are one
 * preadv (the bytes between them into a scratch buffer), each member checked against
 * its checksum once its run is in. The specification (tests/test_reader_spec.py, which
 * holds this and the Python reader, local.py LocalPayload.read_many, to it): the members
 * are taken in order and the first that fails is said, by its offset in the file:
 * ("short", offset) where its bytes are not all in the file (a member of no bytes never
 * is; one that ends past 2^63 - 1 always is), ("checksum", offset) where they do not
 * match its checksum. Returns None when none fails; raises OSError for a failed read,
 * ValueError (before reading) for a member outside its buffer or without an offset,
 * IndexError for members outside the plan. */
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
    if (first < 0 || count < 0 || first > total || count > total - first) {
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
        /* Not p->at + p->size > len: that sum can wrap. */
        if (p->ext >= (uint64_t)nbuf || !(p->flags & HAS_OFFSET) ||
            p->size > (uint64_t)views[p->ext].len ||
            p->at > (uint64_t)views[p->ext].len - p->size) {
            PyErr_SetString(PyExc_ValueError, "a member outside its buffer, or without offset");
            goto done;
        }
    }
    int err = 0, status = 0;
    Py_ssize_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < count && status == 0) {
        /* One run: members from i on, in file order, each at most MAX_GAP after the last.
         * A member of no bytes joins any run and adds nothing to it; one that ends past
         * BYTES_MAX (no file reaches it) ends the run before it, and fails it as short. */
        Py_ssize_t j = i;
        int niov = 0, bytes = 0;
        uint64_t start = 0, end = 0;
        while (j < count && niov < max_iov - 1) {
            const struct place *p = &places[j];
            if (p->size == 0) {
                j++;
                continue;
            }
            if (p->size > BYTES_MAX || p->offset > BYTES_MAX - p->size)
                break;
            if (bytes && (p->offset < end || p->offset - end > MAX_GAP ||
                          end - start >= RUN_BYTES))
                break;
            if (!bytes)
                start = end = p->offset;
            if (p->offset > end)
                iov[niov++] = (struct iovec){scratch, (size_t)(p->offset - end)};
            iov[niov++] = (struct iovec){(char *)views[p->ext].buf + p->at, (size_t)p->size};
            end = p->offset + p->size;
            bytes = 1;
            j++;
        }
        if (j == i) {
            /* The run's first member ends past BYTES_MAX. */
            status = 1;
            bad = i;
            break;
        }
        ssize_t got = run_read(fd, iov, niov, start, &err);
        if (got < 0) {
            status = -1;
            break;
        }
        /* Its members in order: the first whose bytes did not all come, or whose
         * checksum fails. A short read ends at the file's end: the members after it
         * (of any bytes) are not in the file either. */
        uint64_t in = start + (uint64_t)got;
        for (; i < j; i++) {
            const struct place *p = &places[i];
            if (p->size && p->offset + p->size > in) {
                status = 1;
                bad = i;
                break;
            }
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
    {"layout_packed", layout_packed, METH_VARARGS,
     "Lay a packed layout's samples out in a batch's buffers."},
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
