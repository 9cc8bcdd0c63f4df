/*
 * edgellm.h: the C ABI of edgellm, a runtime for small language models on the user's machine.
 *
 * RUNTIME REQUIREMENT: libedgellm embeds CPython (it is built with cffi's embedding mode)
 * and runs the edgellm Python package. It uses the Python of the virtual environment it was
 * built from (`edgellm capi build` records that venv's `bin/python` in the library); set the
 * environment variable EDGELLM_PYTHON to another venv's `bin/python` to use that one. The
 * venv needs edgellm and its dependencies installed. The interpreter starts on the first
 * call that needs it (a model load, a tokenize, ...), never at link or dlopen time; a
 * process that already runs Python (the library loaded into a Python app) shares its
 * interpreter. If Python cannot start, calls return EDGELLM_ERR_RUNTIME and
 * edgellm_last_error() says why.
 *
 * SHAPE OF THE ABI, chosen so that it can stay stable for years:
 *   - opaque handles only (edgellm_model, edgellm_request), each create with its free;
 *     no struct is passed or returned by value, or at all;
 *   - every call returns an edgellm_status; the message of the last failure on the calling
 *     thread is edgellm_last_error();
 *   - anything with options is JSON text (UTF-8): load options in, OpenAI-style requests in,
 *     OpenAI-style chunk objects out. New options are new JSON keys, never new parameters;
 *   - a handle used after its free (or a handle of the wrong kind) is detected: handles carry
 *     a generation counter, so a stale one gives EDGELLM_ERR_INVALID_HANDLE, not a crash;
 *   - buffers are sized by the caller with the two-call pattern: pass NULL / 0 to learn the
 *     size, then call again with a buffer of that size.
 *
 * THREADS: every function may be called from any thread unless its comment says otherwise.
 * A model is shared by all threads: concurrent requests on one model are decoded together by
 * its engine (continuous batching), and each gets the output it would get alone. Callbacks
 * run on the thread that made the call they belong to, before that call returns.
 *
 * Status codes and function signatures are never changed or renumbered; new ones are added.
 */
#ifndef EDGELLM_H
#define EDGELLM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(EDGELLM_BUILDING)
#define EDGELLM_API __declspec(dllexport)
#elif defined(_WIN32)
#define EDGELLM_API __declspec(dllimport)
#else
#define EDGELLM_API __attribute__((visibility("default")))
#endif

/* The ABI this header describes. Bumped only when an existing function's meaning changes
 * (never for additions). Check it at startup: EDGELLM_CHECK_ABI() != EDGELLM_OK means the
 * library found at run time is not the one this program was compiled against. */
#define EDGELLM_ABI_VERSION 1
#define EDGELLM_CHECK_ABI() edgellm_check_abi(EDGELLM_ABI_VERSION)

/* ---- status codes --------------------------------------------------------------------- */
typedef int32_t edgellm_status;
#define EDGELLM_OK 0
#define EDGELLM_ERR_INVALID_ARGUMENT 1 /* a NULL pointer where one is required, a bad value */
#define EDGELLM_ERR_INVALID_JSON 2     /* not JSON, wrong type, unknown or unsupported key */
#define EDGELLM_ERR_NOT_FOUND 3        /* unknown model name, missing model file */
#define EDGELLM_ERR_BAD_MODEL 4        /* a file edgellm cannot run (corrupt, unsupported) */
#define EDGELLM_ERR_BUFFER_TOO_SMALL 5 /* the size needed is in the call's size out-parameter */
#define EDGELLM_ERR_INVALID_HANDLE 6   /* a handle already freed, never made, or the wrong kind */
#define EDGELLM_ERR_CANCELLED 7        /* edgellm_request_cancel, or a callback returned non-zero */
#define EDGELLM_ERR_CONTEXT 8          /* the prompt does not fit the model's context */
#define EDGELLM_ERR_BUSY 9             /* a request already ran, or is running; queue full */
#define EDGELLM_ERR_VERSION 10         /* the library's ABI differs from the header's */
#define EDGELLM_ERR_RUNTIME 11         /* the embedded Python or edgellm could not start */
#define EDGELLM_ERR_INTERNAL 12        /* a bug in edgellm: the message has the details */

/* ---- opaque handles ------------------------------------------------------------------- */
typedef struct edgellm_model edgellm_model;     /* a loaded model and its engine */
typedef struct edgellm_request edgellm_request; /* one generation; cancellable from any thread */

/* ---- version and errors (pure C: these never start Python) ---------------------------- */

/* The ABI version of the library (EDGELLM_ABI_VERSION it was built with). Any thread. */
EDGELLM_API uint32_t edgellm_abi_version(void);

/* EDGELLM_OK if a program compiled against header version `header_abi` can use this library,
 * else EDGELLM_ERR_VERSION (with a message). Any thread. Use EDGELLM_CHECK_ABI(). */
EDGELLM_API edgellm_status edgellm_check_abi(uint32_t header_abi);

/* The message of the last failed call on the calling thread ("" if none yet). Per thread:
 * another thread's failures never change it. Valid until the next edgellm call on this
 * thread; copy it to keep it. Never NULL. */
EDGELLM_API const char *edgellm_last_error(void);

/* A constant name for a status code ("EDGELLM_ERR_NOT_FOUND", ...). Never NULL. Any thread. */
EDGELLM_API const char *edgellm_status_name(edgellm_status status);

/* ---- models --------------------------------------------------------------------------- */

/* Load progress: fraction in [0, 1] (reaches 1 when loading is done) and a short stage name
 * ("file", "weights", "tokenizer", "engine"). Return 0 to go on, non-zero to abort the load
 * (edgellm_model_load then returns EDGELLM_ERR_CANCELLED and frees what it had loaded). */
typedef int (*edgellm_progress_fn)(void *user_data, double fraction, const char *stage);

/* Load a model. options_json (required) is a JSON object:
 *   "model":          catalog name (e.g. "qwen2.5-coder-0.5b-instruct") or .gguf path; required
 *   "backend":        "auto" (default), "cpu", "numpy"
 *   "threads":        CPU threads (default: physical cores)
 *   "context_length": tokens per sequence (default: the model's, at most 4096)
 *   "max_sequences":  sequences decoded together by the engine (default 4); each is a KV
 *                     cache of context_length tokens, allocated by the load
 * Unknown keys are refused (EDGELLM_ERR_INVALID_JSON) rather than ignored.
 * progress may be NULL; it runs on the calling thread. On success *out_model is a new handle
 * to free with edgellm_model_free; on failure it is set to NULL.
 * Any thread; loads of different models may run concurrently. */
EDGELLM_API edgellm_status edgellm_model_load(const char *options_json,
                                              edgellm_progress_fn progress, void *user_data,
                                              edgellm_model **out_model);

/* Free a model: refuses new calls on it, waits for the calls in progress on other threads,
 * cancels its running requests (their edgellm_chat returns EDGELLM_ERR_CANCELLED), stops its
 * engine and releases its memory. The handle is invalid afterwards (using it gives
 * EDGELLM_ERR_INVALID_HANDLE); its requests must still be freed with edgellm_request_free.
 * Any thread, but not from inside one of this model's callbacks (EDGELLM_ERR_BUSY). */
EDGELLM_API edgellm_status edgellm_model_free(edgellm_model *model);

/* The model's description as a JSON object (name, architecture, context_length, vocab_size,
 * backend, max_sequences, ...; "stats": the engine's counters now: requests, prompt and
 * generated tokens, steps, cancel_steps_max), NUL-terminated, into buf of buf_size bytes. *out_size receives the bytes
 * needed including the NUL. buf NULL with buf_size 0 asks for the size (EDGELLM_OK); a
 * buffer too small gives EDGELLM_ERR_BUFFER_TOO_SMALL and nothing written. Any thread. */
EDGELLM_API edgellm_status edgellm_model_info(edgellm_model *model, char *buf, size_t buf_size,
                                              size_t *out_size);

/* ---- tokenizer ------------------------------------------------------------------------ */

#define EDGELLM_TOKENIZE_ADD_BOS 1       /* add the model's BOS as its file asks */
#define EDGELLM_TOKENIZE_PARSE_SPECIAL 2 /* "<|im_start|>" etc. become their special tokens */

/* Tokenize UTF-8 text. Writes up to capacity token ids into tokens; *out_count receives the
 * number of tokens the text has. tokens NULL with capacity 0 asks for the count (EDGELLM_OK);
 * a capacity too small gives EDGELLM_ERR_BUFFER_TOO_SMALL and nothing written. flags: the
 * EDGELLM_TOKENIZE_* bits. Any thread. */
EDGELLM_API edgellm_status edgellm_tokenize(edgellm_model *model, const char *text,
                                            uint32_t flags, int32_t *tokens, size_t capacity,
                                            size_t *out_count);

/* Token ids back to UTF-8 text (an incomplete character at the end becomes U+FFFD),
 * NUL-terminated, into buf of buf_size bytes; *out_size receives the bytes needed including
 * the NUL. Same two-call sizing as edgellm_model_info. An id outside the vocabulary gives
 * EDGELLM_ERR_INVALID_ARGUMENT. tokens may be NULL only when n_tokens is 0. Any thread. */
EDGELLM_API edgellm_status edgellm_detokenize(edgellm_model *model, const int32_t *tokens,
                                              size_t n_tokens, char *buf, size_t buf_size,
                                              size_t *out_size);

/* ---- requests ------------------------------------------------------------------------- */

/* A streamed chunk: one OpenAI "chat.completion.chunk" (edgellm_chat) or "text_completion"
 * (edgellm_complete) object as NUL-terminated JSON of `length` bytes, valid only during the
 * call. Each chunk carries the text of one or more new tokens; the last carries the
 * finish_reason ("stop", "length") and "usage". Called on the thread that runs
 * edgellm_chat/edgellm_complete. Return 0 to go on, non-zero to cancel the request. It may
 * call edgellm_request_cancel and any function on other handles, but not
 * edgellm_model_free on this model. */
typedef int (*edgellm_chunk_fn)(void *user_data, const char *chunk_json, size_t length);

/* A new request on a model. A request runs once (one edgellm_chat or edgellm_complete);
 * creating it before running it lets another thread hold it to cancel. Any thread. */
EDGELLM_API edgellm_status edgellm_request_create(edgellm_model *model,
                                                  edgellm_request **out_request);

/* Cancel a request: the running call stops at the next token (or the next prompt slice while
 * the prompt is processed) and returns EDGELLM_ERR_CANCELLED; a request cancelled before it
 * runs returns EDGELLM_ERR_CANCELLED at once. Idempotent. Any thread, at any time, including
 * from a callback. */
EDGELLM_API edgellm_status edgellm_request_cancel(edgellm_request *request);

/* Free a request. Not while it runs (EDGELLM_ERR_BUSY: cancel it and let the running call
 * return first). The handle is invalid afterwards. Any thread. */
EDGELLM_API edgellm_status edgellm_request_free(edgellm_request *request);

/* Run a chat request and stream the reply. request_json is an OpenAI chat-completions
 * request: "messages" (required: [{"role": "system"|"user"|"assistant", "content": "..."}]),
 * "max_tokens" or "max_completion_tokens", "temperature" (0 = greedy), "top_p", "seed",
 * "stop" (a string or up to 4), "presence_penalty", "frequency_penalty", and the
 * non-OpenAI "top_k", "min_p", "repetition_penalty". "model" and "stream" are accepted and
 * ignored (the handle decides the model; replies always stream). Any other key is refused
 * with EDGELLM_ERR_INVALID_JSON naming it. Keys not given take edgellm's defaults
 * (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; max_tokens: what the context leaves
 * after the prompt); a prompt, or prompt plus max_tokens, beyond the context gives
 * EDGELLM_ERR_CONTEXT. on_chunk may be NULL (read the reply with
 * edgellm_request_result). Blocks until the reply ends: EDGELLM_OK when it finished,
 * EDGELLM_ERR_CANCELLED when cancelled (chunks already delivered stay valid), another status
 * on failure. Any thread; many threads may run requests on one model at once. */
EDGELLM_API edgellm_status edgellm_chat(edgellm_request *request, const char *request_json,
                                        edgellm_chunk_fn on_chunk, void *user_data);

/* As edgellm_chat for an OpenAI completions request: "prompt" (a string, required) instead
 * of "messages"; the same sampling keys. Streams "text_completion" chunks. */
EDGELLM_API edgellm_status edgellm_complete(edgellm_request *request, const char *request_json,
                                            edgellm_chunk_fn on_chunk, void *user_data);

/* After edgellm_chat/edgellm_complete returned (finished or cancelled): the whole reply as one
 * OpenAI "chat.completion" / "text_completion" object with "usage", NUL-terminated, with the
 * two-call sizing of edgellm_model_info. EDGELLM_ERR_BUSY while the request runs or before
 * it ran. Any thread. */
EDGELLM_API edgellm_status edgellm_request_result(edgellm_request *request, char *buf,
                                                  size_t buf_size, size_t *out_size);

#ifdef __cplusplus
}
#endif

#endif /* EDGELLM_H */
