/*
 * capi.c: the C side of libedgellm (native/edgellm.h), compiled by cffi's embedding mode
 * together with the extern "Python" declarations of native/capi_build.py.
 *
 * This file only does what must happen in C: start the embedded Python the way a desktop app
 * needs it (the venv the library was built from, no signal handlers, no PYTHON* variables),
 * keep each thread's last error message, turn opaque handle pointers into the integers the
 * Python side checks (edgellm/capi.py: slot + generation counter), and call the application's
 * callbacks without holding the GIL. Everything else (handles, JSON, models, the engine)
 * is Python.
 *
 * Defined before this file by the build: EDGELLM_VENV_PYTHON (the venv's bin/python) and
 * EDGELLM_LIBRARY_VERSION (edgellm's version string).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "edgellm.h"

/* ---- per-thread last error ------------------------------------------------------------ */

static pthread_key_t error_key;
static pthread_once_t error_once = PTHREAD_ONCE_INIT;

static void make_error_key(void) { pthread_key_create(&error_key, free); }

/* Called by the Python side too (declared in the cdef): the message of a failure on this
 * thread. Copied; the previous message of this thread is freed. */
static void elm_set_error(const char *message) {
    pthread_once(&error_once, make_error_key);
    char *copy = strdup(message ? message : "");
    char *old = pthread_getspecific(error_key);
    pthread_setspecific(error_key, copy);
    free(old);
}

static edgellm_status fail(edgellm_status status, const char *message) {
    elm_set_error(message);
    return status;
}

EDGELLM_API const char *edgellm_last_error(void) {
    pthread_once(&error_once, make_error_key);
    const char *message = pthread_getspecific(error_key);
    return message ? message : "";
}

EDGELLM_API const char *edgellm_status_name(edgellm_status status) {
    static const char *const names[] = {
        "EDGELLM_OK", "EDGELLM_ERR_INVALID_ARGUMENT", "EDGELLM_ERR_INVALID_JSON",
        "EDGELLM_ERR_NOT_FOUND", "EDGELLM_ERR_BAD_MODEL", "EDGELLM_ERR_BUFFER_TOO_SMALL",
        "EDGELLM_ERR_INVALID_HANDLE", "EDGELLM_ERR_CANCELLED", "EDGELLM_ERR_CONTEXT",
        "EDGELLM_ERR_BUSY", "EDGELLM_ERR_VERSION", "EDGELLM_ERR_RUNTIME", "EDGELLM_ERR_INTERNAL",
    };
    if (status < 0 || (size_t)status >= sizeof(names) / sizeof(names[0]))
        return "EDGELLM_ERR_UNKNOWN";
    return names[status];
}

EDGELLM_API uint32_t edgellm_abi_version(void) { return EDGELLM_ABI_VERSION; }

EDGELLM_API edgellm_status edgellm_check_abi(uint32_t header_abi) {
    if (header_abi == EDGELLM_ABI_VERSION)
        return EDGELLM_OK;
    char message[160];
    snprintf(message, sizeof message,
             "this program was compiled against edgellm ABI %u but the library is ABI %u: "
             "rebuild it against the library's edgellm.h", (unsigned)header_abi,
             (unsigned)EDGELLM_ABI_VERSION);
    return fail(EDGELLM_ERR_VERSION, message);
}

/* ---- the embedded Python -------------------------------------------------------------- */

static pthread_once_t python_once = PTHREAD_ONCE_INIT;
static edgellm_status python_status = EDGELLM_OK;
static char python_error[1024];
static volatile int python_ready = 0;  /* set by edgellm/capi.py once its functions attach */

static void elm_mark_ready(void) { python_ready = 1; }

static void elm_set_init_error(const char *message) {
    snprintf(python_error, sizeof python_error, "%s", message ? message : "");
}

/* Start CPython as the venv's own interpreter would start: program_name is the venv's
 * bin/python, so CPython finds pyvenv.cfg beside it and puts that venv's site-packages (and
 * the .pth files of an editable install) on sys.path. Isolated: PYTHONPATH/PYTHONHOME of the
 * app's environment cannot point it elsewhere; no signal handlers (the app owns signals). A
 * process where Python already runs keeps its interpreter. */
static void start_python(void) {
    if (Py_IsInitialized())
        return;
    const char *exe = getenv("EDGELLM_PYTHON");
    if (exe == NULL || exe[0] == '\0')
        exe = EDGELLM_VENV_PYTHON;
    if (access(exe, X_OK) != 0) {
        snprintf(python_error, sizeof python_error,
                 "libedgellm needs the Python of its virtual environment, but %s is missing (%s): "
                 "rebuild the library with `edgellm capi build` in the venv, or set "
                 "EDGELLM_PYTHON to a venv's bin/python with edgellm installed", exe,
                 strerror(errno));
        python_status = EDGELLM_ERR_RUNTIME;
        return;
    }
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);
    config.install_signal_handlers = 0;
    config.site_import = 1;
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, exe);
    if (!PyStatus_Exception(status))
        status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        snprintf(python_error, sizeof python_error, "the embedded Python (%s) did not start: %s",
                 exe, status.err_msg ? status.err_msg : "unknown error");
        python_status = EDGELLM_ERR_RUNTIME;
        return;
    }
    PyEval_SaveThread(); /* release the GIL: every call takes it as it needs it */
}

/* elm_py_ping and the other elm_py_* functions are extern "Python" (capi_build.py) */

/* EDGELLM_OK once Python runs and edgellm/capi.py has attached its functions. */
static edgellm_status ensure_python(void) {
    if (python_ready)
        return EDGELLM_OK;
    pthread_once(&python_once, start_python);
    if (python_status != EDGELLM_OK)
        return fail(python_status, python_error);
    elm_py_ping(); /* the first extern "Python" call runs the init code (once, in cffi) */
    if (!python_ready) {
        if (python_error[0] == '\0')
            elm_set_init_error("the embedded Python did not load edgellm (no message)");
        return fail(EDGELLM_ERR_RUNTIME, python_error);
    }
    return EDGELLM_OK;
}

/* Handles are opaque pointers whose bits are the Python side's (kind, slot, generation)
 * integer: never dereferenced, so a stale or forged one is rejected, not followed. */
#define HANDLE(p) ((uint64_t)(uintptr_t)(p))

#define NEED_PYTHON()                                                                         \
    do {                                                                                      \
        edgellm_status s_ = ensure_python();                                                  \
        if (s_ != EDGELLM_OK)                                                                 \
            return s_;                                                                        \
    } while (0)

/* ---- models --------------------------------------------------------------------------- */

EDGELLM_API edgellm_status edgellm_model_load(const char *options_json,
                                              edgellm_progress_fn progress, void *user_data,
                                              edgellm_model **out_model) {
    if (out_model == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_model_load: out_model is NULL");
    *out_model = NULL;
    if (options_json == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    "edgellm_model_load: options_json is NULL (give at least {\"model\": NAME})");
    NEED_PYTHON();
    uint64_t handle = 0;
    edgellm_status status = elm_py_model_load(options_json, (void *)progress, user_data, &handle);
    if (status == EDGELLM_OK)
        *out_model = (edgellm_model *)(uintptr_t)handle;
    return status;
}

EDGELLM_API edgellm_status edgellm_model_free(edgellm_model *model) {
    if (model == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_model_free: model is NULL");
    NEED_PYTHON();
    return elm_py_model_free(HANDLE(model));
}

EDGELLM_API edgellm_status edgellm_model_info(edgellm_model *model, char *buf, size_t buf_size,
                                              size_t *out_size) {
    if (model == NULL || out_size == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    model ? "edgellm_model_info: out_size is NULL"
                          : "edgellm_model_info: model is NULL");
    if (buf == NULL && buf_size != 0)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_model_info: buf is NULL but buf_size "
                                                  "is not 0");
    NEED_PYTHON();
    return elm_py_model_info(HANDLE(model), buf, buf_size, out_size);
}

/* ---- tokenizer ------------------------------------------------------------------------ */

EDGELLM_API edgellm_status edgellm_tokenize(edgellm_model *model, const char *text,
                                            uint32_t flags, int32_t *tokens, size_t capacity,
                                            size_t *out_count) {
    if (model == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_tokenize: model is NULL");
    if (text == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_tokenize: text is NULL");
    if (out_count == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_tokenize: out_count is NULL");
    if (tokens == NULL && capacity != 0)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    "edgellm_tokenize: tokens is NULL but capacity is not 0");
    NEED_PYTHON();
    return elm_py_tokenize(HANDLE(model), text, flags, tokens, capacity, out_count);
}

EDGELLM_API edgellm_status edgellm_detokenize(edgellm_model *model, const int32_t *tokens,
                                              size_t n_tokens, char *buf, size_t buf_size,
                                              size_t *out_size) {
    if (model == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_detokenize: model is NULL");
    if (tokens == NULL && n_tokens != 0)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    "edgellm_detokenize: tokens is NULL but n_tokens is not 0");
    if (out_size == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_detokenize: out_size is NULL");
    if (buf == NULL && buf_size != 0)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    "edgellm_detokenize: buf is NULL but buf_size is not 0");
    NEED_PYTHON();
    return elm_py_detokenize(HANDLE(model), tokens, n_tokens, buf, buf_size, out_size);
}

/* ---- requests ------------------------------------------------------------------------- */

EDGELLM_API edgellm_status edgellm_request_create(edgellm_model *model,
                                                  edgellm_request **out_request) {
    if (out_request == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_request_create: out_request is NULL");
    *out_request = NULL;
    if (model == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_request_create: model is NULL");
    NEED_PYTHON();
    uint64_t handle = 0;
    edgellm_status status = elm_py_request_create(HANDLE(model), &handle);
    if (status == EDGELLM_OK)
        *out_request = (edgellm_request *)(uintptr_t)handle;
    return status;
}

EDGELLM_API edgellm_status edgellm_request_cancel(edgellm_request *request) {
    if (request == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_request_cancel: request is NULL");
    NEED_PYTHON();
    return elm_py_request_cancel(HANDLE(request));
}

EDGELLM_API edgellm_status edgellm_request_free(edgellm_request *request) {
    if (request == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, "edgellm_request_free: request is NULL");
    NEED_PYTHON();
    return elm_py_request_free(HANDLE(request));
}

/* kind: 0 chat, 1 completion. The chunks are pulled from Python one at a time and handed to
 * the callback here, in C, with the GIL released: the app's code never runs inside Python,
 * and a callback that blocks or re-enters edgellm holds nothing up but its own request. */
static edgellm_status run_request(const char *fn, int kind, edgellm_request *request,
                                  const char *request_json, edgellm_chunk_fn on_chunk,
                                  void *user_data) {
    char message[128];
    if (request == NULL || request_json == NULL) {
        snprintf(message, sizeof message, "%s: %s is NULL", fn,
                 request == NULL ? "request" : "request_json");
        return fail(EDGELLM_ERR_INVALID_ARGUMENT, message);
    }
    NEED_PYTHON();
    uint64_t handle = HANDLE(request);
    edgellm_status status = elm_py_run_start(handle, kind, request_json);
    if (status != EDGELLM_OK)
        return status;
    for (;;) {
        const char *chunk = NULL;
        size_t length = 0;
        status = elm_py_run_next(handle, &chunk, &length);
        if (status != EDGELLM_OK || chunk == NULL) /* chunk NULL: the reply is complete */
            return status;
        if (on_chunk != NULL && on_chunk(user_data, chunk, length) != 0)
            elm_py_request_cancel(handle);
    }
}

EDGELLM_API edgellm_status edgellm_chat(edgellm_request *request, const char *request_json,
                                        edgellm_chunk_fn on_chunk, void *user_data) {
    return run_request("edgellm_chat", 0, request, request_json, on_chunk, user_data);
}

EDGELLM_API edgellm_status edgellm_complete(edgellm_request *request, const char *request_json,
                                            edgellm_chunk_fn on_chunk, void *user_data) {
    return run_request("edgellm_complete", 1, request, request_json, on_chunk, user_data);
}

EDGELLM_API edgellm_status edgellm_request_result(edgellm_request *request, char *buf,
                                                  size_t buf_size, size_t *out_size) {
    if (request == NULL || out_size == NULL)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    request ? "edgellm_request_result: out_size is NULL"
                            : "edgellm_request_result: request is NULL");
    if (buf == NULL && buf_size != 0)
        return fail(EDGELLM_ERR_INVALID_ARGUMENT,
                    "edgellm_request_result: buf is NULL but buf_size is not 0");
    NEED_PYTHON();
    return elm_py_request_result(HANDLE(request), buf, buf_size, out_size);
}
