/*
 * cached_wire._tarscan: the tar index and checksums of a downloaded shard file, in C.
 *
 * The native fetch path writes a whole shard into a file with no Python per byte; this
 * builds what the streaming path builds while the bytes arrive (cached/hot/index.py
 * TarIndexer, cached/hot/verify.py StreamSums) in one pass over that file, without
 * the GIL: every regular member's name, data offset, size and XXH3-64, and the XXH3-64
 * of the whole file. The naming and grouping of members into samples stay in Python
 * (cached/hot/scan.py, one piece of code with TarIndexer's).
 *
 * TarIndexer is the specification, errors included. Where it follows Python's int() or
 * its pax regex into corners this code does not model exactly (a number field that is
 * neither plain octal nor GNU base-256, a pax number that is not plain digits, a value
 * past 2^62), scan() says FALLBACK and the caller runs TarIndexer itself: the result is
 * always exactly the specification's. Archives as tarfile writes them (ustar, GNU, pax)
 * never take that way (tests/test_tarscan.py counts it).
 *
 * The file is mapped (read-only, populated up front) and walked through a window of
 * WINDOW bytes: the whole-file hash takes each window's new bytes, and the members'
 * hashes read them again right after, from the core's cache. Mapped rather than read:
 * on the development VM, for a 16 MB shard in the page cache, mapping cost 0.08 ms of
 * CPU per MB and pread's copy into a 256 KB buffer 0.20 (the whole scan: 0.25).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

/* The bulk hashing dispatched to the best vector unit (as in _gather.c); the streaming
 * state's reset and digest, which touch a few hundred bytes, inline. */
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#if defined(CACHED_X86_DISPATCH)
#include "xxh_x86dispatch.h"
#define HASH XXH3_64bits_dispatch
#define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#include "xxhash.h"
#define HASH XXH3_64bits
#define HASH_UPDATE XXH3_64bits_update
#endif

#define BLOCK 512
#define MAX_META (1 << 20) /* index.py _MAX_META */
/* Values at or past this are FALLBACK: below it, sizes and offsets never overflow. */
#define BIG ((uint64_t)1 << 62)
/* Bytes hashed for the whole file before the members in them are: small enough to stay
 * in the core's L2 cache until the members' hashes read them again. */
#define WINDOW ((uint64_t)256 << 10)

enum { OK = 0, FALLBACK = 1, CORRUPT = 2, INCOMPLETE = 3, OS_ERROR = 4 };

struct rec {
    uint64_t name_end; /* in the names blob; the name starts where the last one ended */
    uint64_t offset;   /* of the data in the file */
    uint64_t size;
    uint64_t sum; /* XXH3-64 of the data */
};

struct scan {
    const uint8_t *map;
    uint64_t size;
    uint64_t win_end; /* the whole-file hash has taken every byte before this */
    XXH3_state_t whole;
    XXH3_state_t part; /* a member that spans windows */
    struct rec *recs;
    size_t nrecs, caprecs;
    char *names;
    size_t nnames, capnames;
    /* the outcome */
    int kind;
    const char *reason; /* CORRUPT: TarIndexer's _Corrupt text; INCOMPLETE: where */
    char reason_buf[64];
    uint64_t headers; /* valid headers seen: with none, it is "not a tar archive" */
    uint64_t at;      /* CORRUPT: the header's offset; otherwise the file size */
    int err;          /* OS_ERROR: errno */
};

static int fail(struct scan *s, int kind, const char *reason) {
    s->kind = kind;
    s->reason = reason;
    return kind;
}

/* INCOMPLETE is said at the end of the input, like TarIndexer.finish. */
static int cut_short(struct scan *s, const char *where) {
    s->at = s->size;
    return fail(s, INCOMPLETE, where);
}

/* The whole-file hash takes every byte up to `end` (in windows, so that the members'
 * hashes find the bytes still cached). */
static void hash_to(struct scan *s, uint64_t end) {
    while (s->win_end < end) {
        uint64_t n = end - s->win_end;
        if (n > WINDOW)
            n = WINDOW;
        HASH_UPDATE(&s->whole, s->map + s->win_end, (size_t)n);
        s->win_end += n;
    }
}

/* [off, off + n) is about to be read: the whole-file hash takes it first (and the rest
 * of a window beyond it), so that every byte is hashed right before it is used. */
static void reach(struct scan *s, uint64_t off, uint64_t n) {
    if (off + n <= s->win_end)
        return;
    uint64_t end = off + (n > WINDOW ? n : WINDOW);
    hash_to(s, end < s->size ? end : s->size);
}

static uint64_t member_sum(struct scan *s, uint64_t off, uint64_t size) {
    const uint8_t *p = s->map + off;
    if (size <= WINDOW) {
        reach(s, off, size);
        return HASH(p, (size_t)size);
    }
    XXH3_64bits_reset(&s->part);
    for (uint64_t done = 0; done < size;) {
        uint64_t n = size - done < WINDOW ? size - done : WINDOW;
        reach(s, off + done, n);
        HASH_UPDATE(&s->part, p + done, (size_t)n);
        done += n;
    }
    return XXH3_64bits_digest(&s->part);
}

static int grow(void **items, size_t *cap, size_t need, size_t item) {
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap : 64;
    while (n < need)
        n *= 2;
    void *p = PyMem_RawRealloc(*items, n * item);
    if (p == NULL)
        return -1;
    *items = p;
    *cap = n;
    return 0;
}

static int add_name(struct scan *s, const void *bytes, size_t n) {
    if (grow((void **)&s->names, &s->capnames, s->nnames + n, 1) < 0)
        return -1;
    memcpy(s->names + s->nnames, bytes, n);
    s->nnames += n;
    return 0;
}

static size_t nts(const uint8_t *field, size_t n) {
    const uint8_t *end = memchr(field, 0, n);
    return end ? (size_t)(end - field) : n;
}

/* Bytes that index.py's _num can never read as part of a number, in either of its two
 * tries (int(field.rstrip(b"\0 "), 8), then int(text_before_nul.strip() or "0", 8)):
 * anything but octal digits, signs, underscores, the "o" of "0o" and white space. */
static int never_numeric(uint8_t c) {
    if (c >= '0' && c <= '7')
        return 0;
    if (c == '_' || c == '+' || c == '-' || c == 'o' || c == 'O' || c == ' ')
        return 0;
    if ((c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f)) /* str.strip() white space */
        return 0;
    return 1;
}

/* index.py _num: GNU base-256, or octal text. Exact for base-256, for octal digits
 * between spaces and NUL/space padding, and for a field of padding alone (0); CORRUPT
 * where no reading can succeed; FALLBACK for the rest (int()'s signs, underscores...).
 * A negative 12-byte base-256 value is returned as -1: only its sign is used. */
static int num(struct scan *s, const uint8_t *f, size_t n, int64_t *out) {
    if (f[0] == 0x80 || f[0] == 0xff) { /* not octal text: the first try fails on it */
        uint64_t v = 0;
        for (size_t k = 1; k < n; k++) {
            if (f[0] == 0x80 && v >= (BIG >> 8))
                return fail(s, FALLBACK, "base-256 number past 2^62");
            v = (v << 8) | f[k];
        }
        if (f[0] == 0x80) {
            if (v >= BIG)
                return fail(s, FALLBACK, "base-256 number past 2^62");
            *out = (int64_t)v;
        } else {
            /* n - 256 ** (n - 1): exact for a checksum field (8 bytes), negative always */
            *out = n <= 8 ? (int64_t)v - ((int64_t)1 << (8 * (n - 1))) : -1;
        }
        return OK;
    }
    size_t k = 0;
    while (k < n && f[k] == ' ') /* int() skips leading white space */
        k++;
    size_t digits = k;
    uint64_t v = 0;
    while (digits < n && f[digits] >= '0' && f[digits] <= '7')
        v = v * 8 + (uint64_t)(f[digits++] - '0');
    size_t pad = digits;
    while (pad < n && (f[pad] == 0 || f[pad] == ' '))
        pad++;
    if (pad == n) {
        /* digits: the first try reads them; none: the field is padding, which the
         * second try reads as "0" */
        *out = (int64_t)v;
        return OK;
    }
    size_t text = nts(f, n);
    for (size_t j = 0; j < text; j++)
        if (never_numeric(f[j]))
            return fail(s, CORRUPT, "invalid number field");
    return fail(s, FALLBACK, "number field");
}

/* index.py _checksum_ok: the unsigned byte sum, or the signed one of old Sun/NeXT tars. */
static int checksum_ok(const uint8_t *b, int64_t stored) {
    int64_t u = 256, sg = 256;
    for (size_t k = 0; k < 148; k++) {
        u += b[k];
        sg += (int8_t)b[k];
    }
    for (size_t k = 156; k < BLOCK; k++) {
        u += b[k];
        sg += (int8_t)b[k];
    }
    return stored == u || stored == sg;
}

static int zero_block(const uint8_t *b) {
    uint64_t acc = 0;
    for (size_t k = 0; k < BLOCK; k += 8) {
        uint64_t w;
        memcpy(&w, b + k, 8);
        acc |= w;
    }
    return acc == 0;
}

/* The overrides of extended headers, until the header they describe (TarIndexer's
 * _name, _size and _pending). Names point into the mapped file. */
struct pending {
    int on, has_name, has_size;
    const uint8_t *name;
    size_t name_len;
    uint64_t size;
};

static int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* index.py TarIndexer._extension: a complete GNU long name ("L") or pax ("x", "X")
 * payload of `n` bytes (padded to blocks, as TarIndexer collects it). */
static int extension(struct scan *s, struct pending *pd, uint8_t kind, const uint8_t *p,
                     size_t n) {
    if (kind == 'L') {
        if (!pd->has_name) {
            pd->has_name = 1;
            pd->name = p;
            pd->name_len = nts(p, n);
        }
        return OK;
    }
    int has_name = 0, has_size = 0;
    const uint8_t *name = NULL;
    size_t name_len = 0;
    uint64_t size = 0;
    size_t pos = 0;
    for (;;) { /* _PAX_RECORD.match(payload, pos): rb"(\d+) ([^=]+)=" */
        size_t d = pos;
        while (d < n && is_digit(p[d]))
            d++;
        if (d == pos || d >= n || p[d] != ' ')
            break;
        size_t kw = d + 1;
        if (kw >= n || p[kw] == '=')
            break;
        const uint8_t *eq = memchr(p + kw, '=', n - kw);
        if (eq == NULL)
            break;
        size_t e = (size_t)(eq - p);
        if (d - pos > 18)
            return fail(s, FALLBACK, "long pax record length");
        uint64_t length = 0;
        for (size_t j = pos; j < d; j++)
            length = length * 10 + (uint64_t)(p[j] - '0');
        if (length == 0)
            return fail(s, CORRUPT, "invalid pax record");
        size_t kw_len = e - kw;
        if (kw_len >= 11 && memcmp(p + kw, "GNU.sparse.", 11) == 0)
            return fail(s, CORRUPT, "GNU sparse members are not supported");
        /* value = payload[e + 1 : pos + length - 1], with Python's slice clamping */
        uint64_t lo = e + 1, hi = pos + length - 1;
        if (hi > n)
            hi = n;
        if (hi < lo)
            hi = lo;
        if (kw_len == 4 && memcmp(p + kw, "path", 4) == 0) {
            name = p + lo;
            name_len = (size_t)(hi - lo);
            while (name_len && name[name_len - 1] == '/') /* .rstrip("/") */
                name_len--;
            has_name = 1;
        } else if (kw_len == 4 && memcmp(p + kw, "size", 4) == 0) {
            /* int(value) of plain digits; "" is a bad number, which tarfile reads as 0 */
            if (hi - lo > 18)
                return fail(s, FALLBACK, "long pax size");
            size = 0;
            for (uint64_t j = lo; j < hi; j++) {
                if (!is_digit(p[j]))
                    return fail(s, FALLBACK, "pax size");
                size = size * 10 + (uint64_t)(p[j] - '0');
            }
            has_size = 1;
        }
        pos += (size_t)length;
    }
    if (has_name && !pd->has_name) { /* of chained overrides the first wins */
        pd->has_name = 1;
        pd->name = name;
        pd->name_len = name_len;
    }
    if (has_size && !pd->has_size) {
        pd->has_size = 1;
        pd->size = size;
    }
    return OK;
}

static uint64_t padded(uint64_t size) { return (size + BLOCK - 1) & ~(uint64_t)(BLOCK - 1); }

/* TarIndexer.feed over the whole file, then finish. */
static int walk(struct scan *s) {
    const uint64_t n = s->size;
    uint64_t i = 0;
    int ended = 0;
    struct pending pd = {0};
    if (n == 0)
        return cut_short(s, "is empty");
    while (i < n) {
        if (n - i < BLOCK)
            return cut_short(s, "ends inside a header");
        reach(s, i, BLOCK);
        const uint8_t *b = s->map + i;
        s->at = i;
        i += BLOCK;
        if (zero_block(b)) {
            if (pd.on)
                return fail(s, CORRUPT, "end-of-archive marker after an extended header");
            ended = 1; /* tarfile stops at the first zero block */
            break;
        }
        int64_t stored, size;
        if (num(s, b + 148, 8, &stored) != OK)
            return s->kind;
        if (!checksum_ok(b, stored))
            return fail(s, CORRUPT, "bad header checksum");
        s->headers++;
        if (num(s, b + 124, 12, &size) != OK)
            return s->kind;
        if (size < 0)
            return fail(s, CORRUPT, "negative member size");
        uint8_t kind = b[156];
        if (kind == 'L' || kind == 'K' || kind == 'x' || kind == 'X' || kind == 'g') {
            uint64_t skip = padded((uint64_t)size);
            pd.on = 1;
            if (kind == 'L' || kind == 'x' || kind == 'X') {
                if (size > MAX_META) {
                    snprintf(s->reason_buf, sizeof s->reason_buf, "extended header of %lld bytes",
                             (long long)size);
                    return fail(s, CORRUPT, s->reason_buf);
                }
                if (skip > n - i) /* its payload is cut short */
                    break;
                reach(s, i, skip);
                if (extension(s, &pd, kind, s->map + i, (size_t)skip) != OK)
                    return s->kind;
            } else if (skip > n - i) { /* "K", "g": not needed, skipped */
                break;
            }
            i += skip;
            continue;
        }
        if (kind == 'S')
            return fail(s, CORRUPT, "GNU sparse members are not supported");
        struct pending use = pd;
        if (pd.on) {
            if (pd.has_size)
                size = (int64_t)pd.size;
            memset(&pd, 0, sizeof pd);
        }
        size_t short_len = nts(b, 100);
        int regular = (kind == '0' || kind == '\0' || kind == '7') &&
                      !(kind == '\0' && short_len && b[short_len - 1] == '/');
        uint64_t skip = padded((uint64_t)size);
        /* links, devices, dirs (an old-style one too: "\0" and a trailing "/"): tarfile
         * assumes no data, whatever the size field says; unknown types have theirs */
        if ((kind >= '1' && kind <= '6') || (kind == '\0' && !regular))
            skip = 0;
        if (skip > n - i)
            return cut_short(s, "ends inside a member's data");
        if (regular) {
            int failed;
            if (use.has_name)
                failed = add_name(s, use.name, use.name_len);
            else if (b[345]) /* ustar prefix, applied whatever the magic says (tarfile) */
                failed = add_name(s, b + 345, nts(b + 345, 155)) < 0 || add_name(s, "/", 1) < 0 ||
                         add_name(s, b, short_len) < 0;
            else
                failed = add_name(s, b, short_len);
            if (failed || grow((void **)&s->recs, &s->caprecs, s->nrecs + 1, sizeof(struct rec)))
                return fail(s, OS_ERROR, NULL);
            struct rec *r = &s->recs[s->nrecs++];
            r->name_end = s->nnames;
            r->offset = i;
            r->size = (uint64_t)size;
            r->sum = member_sum(s, i, (uint64_t)size);
        }
        i += skip;
    }
    if (!ended && pd.on)
        return cut_short(s, "ends inside an extended header");
    hash_to(s, n); /* trailing blocks, and anything after the end marker */
    s->at = n;
    return OK;
}

/* scan(fd, size) -> (kind, reason, headers, at, names, table, whole) */
static PyObject *scan(PyObject *self, PyObject *args) {
    int fd;
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "iK:scan", &fd, &size))
        return NULL;
    if (size >= BIG) {
        PyErr_SetString(PyExc_OverflowError, "file too large");
        return NULL;
    }
    struct scan state; /* on the stack: the hash states want their 64-byte alignment */
    struct scan *s = &state;
    memset(s, 0, sizeof *s);
    s->size = size;
    XXH3_INITSTATE(&s->whole);
    XXH3_INITSTATE(&s->part);
    XXH3_64bits_reset(&s->whole);
    void *map = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (size) {
        /* The pages are in the page cache (just written): mapping them all at once costs
         * less than a fault per few pages (0.08 against 0.09 ms/MB), and nothing is
         * copied. The caller's size is the file's: a page past its end would be SIGBUS. */
        map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
        if (map == MAP_FAILED) {
            s->err = errno;
            s->kind = OS_ERROR;
            map = NULL;
        }
    }
    if (s->kind == OK) {
        s->map = map;
        walk(s);
    }
    if (map != NULL)
        munmap(map, (size_t)size);
    Py_END_ALLOW_THREADS

    PyObject *result = NULL;
    if (s->kind == OS_ERROR) {
        if (s->err) {
            errno = s->err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            PyErr_NoMemory();
        }
    } else {
        PyObject *whole = s->kind == OK ? PyLong_FromUnsignedLongLong(XXH3_64bits_digest(&s->whole))
                                        : PyLong_FromLong(0);
        result = Py_BuildValue("(izKKy#y#N)", s->kind, s->reason, (unsigned long long)s->headers,
                               (unsigned long long)s->at, s->names ? s->names : "",
                               (Py_ssize_t)s->nnames, s->recs ? (const char *)s->recs : "",
                               (Py_ssize_t)(s->nrecs * sizeof(struct rec)), whole);
    }
    PyMem_RawFree(s->names);
    PyMem_RawFree(s->recs);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(fd, size) -> (kind, reason, headers, at, names, table, whole): the tar index "
     "and XXH3-64 checksums of a file of size bytes (its size: no more), in one pass "
     "without the GIL. kind: OK, FALLBACK (run TarIndexer instead), CORRUPT (reason, "
     "header at byte at) or INCOMPLETE (reason: where it ends); headers: valid headers "
     "before that. OK: names, the regular members' raw names end to end; table, "
     "RECORD_SIZE bytes per member (native u64: name end, data offset, size, XXH3-64); "
     "at, the size; whole, the file's XXH3-64. cached/hot/scan.py reads it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cached_wire._tarscan",
    "A downloaded shard's tar index and checksums in one pass, in C (cached/hot/scan.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__tarscan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "OK", OK) < 0 ||
        PyModule_AddIntConstant(m, "FALLBACK", FALLBACK) < 0 ||
        PyModule_AddIntConstant(m, "CORRUPT", CORRUPT) < 0 ||
        PyModule_AddIntConstant(m, "INCOMPLETE", INCOMPLETE) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_SIZE", (long)sizeof(struct rec)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
