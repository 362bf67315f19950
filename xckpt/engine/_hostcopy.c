/* Copy between two host arrays with streaming (non-temporal) stores.
 *
 * An asynchronous save copies the whole state into staging buffers that are read again only
 * later, by its background writer; a load copies what it read into the caller's arrays. Ordinary
 * stores first read every destination cache line (read-for-ownership) and then evict the data
 * the training loop was using; streaming stores write around the cache, so the copy moves two
 * bytes per byte copied instead of three. Measured on the benchmark VM (4 processes copying
 * 266 MB each at once): 18.9 GB/s against 11.4 GB/s for numpy's copy.
 *
 * One function, copy(dst_address, src_address, shape, dst_strides, src_strides, itemsize):
 * the caller (xckpt/engine/hostcopy.py) passes two live numpy arrays of one shape and dtype,
 * the innermost dimension contiguous in both. The GIL is released while copying. Without
 * SSE2 (not x86-64) it copies with memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define XCKPT_STREAM 1
#endif

#define MAX_DIMS 64 /* numpy's limit */
/* Runs shorter than this are copied with memcpy: partial lines defeat write-combining. */
#define STREAM_MIN_RUN 256

static void copy_run(char *dst, const char *src, size_t n) {
#ifdef XCKPT_STREAM
    if (n >= STREAM_MIN_RUN) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void copy_nd(int nd, const Py_ssize_t *shape, const Py_ssize_t *ds, const Py_ssize_t *ss,
                    char *dst, const char *src, size_t run) {
    if (nd == 0) {
        copy_run(dst, src, run);
        return;
    }
    for (Py_ssize_t i = 0; i < shape[0]; i++)
        copy_nd(nd - 1, shape + 1, ds + 1, ss + 1, dst + i * ds[0], src + i * ss[0], run);
}

static int parse_dims(PyObject *seq, Py_ssize_t *out, Py_ssize_t nd, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != nd) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries", what, nd);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *hostcopy_copy(PyObject *self, PyObject *args) {
    Py_ssize_t dst_addr, src_addr, itemsize;
    PyObject *shape_o, *ds_o, *ss_o;
    if (!PyArg_ParseTuple(args, "nnOOOn", &dst_addr, &src_addr, &shape_o, &ds_o, &ss_o, &itemsize))
        return NULL;
    Py_ssize_t nd = PySequence_Size(shape_o);
    if (nd < 0)
        return NULL;
    if (nd > MAX_DIMS || itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "too many dimensions or a bad item size");
        return NULL;
    }
    Py_ssize_t shape[MAX_DIMS + 1], ds[MAX_DIMS + 1], ss[MAX_DIMS + 1];
    if (parse_dims(shape_o, shape, nd, "shape") || parse_dims(ds_o, ds, nd, "dst strides") ||
        parse_dims(ss_o, ss, nd, "src strides"))
        return NULL;
    for (Py_ssize_t i = 0; i < nd; i++) {
        if (shape[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "negative dimension");
            return NULL;
        }
        if (shape[i] == 0)
            Py_RETURN_NONE;
    }
    /* the innermost run: trailing dimensions contiguous in both arrays, merged */
    size_t run = (size_t)itemsize;
    while (nd > 0 && ds[nd - 1] == (Py_ssize_t)run && ss[nd - 1] == (Py_ssize_t)run) {
        run *= (size_t)shape[nd - 1];
        nd--;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_nd((int)nd, shape, ds, ss, (char *)dst_addr, (const char *)src_addr, run);
#ifdef XCKPT_STREAM
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", hostcopy_copy, METH_VARARGS,
     "copy(dst_address, src_address, shape, dst_strides, src_strides, itemsize): copy with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hostcopy(void) { return PyModule_Create(&module); }
