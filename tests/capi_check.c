/*
 * capi_check.c: drives libedgellm (native/edgellm.h) for tests/test_capi.py, which compiles
 * it with the system's C compiler. Each mode prints "key value" lines the test reads:
 *
 *   capi_check bad MODEL MISSING GARBAGE every kind of bad input: "case NAME STATUS message"
 *   capi_check cancel MODEL              a reply cancelled from a second thread, then reused
 *   capi_check prefill MODEL             a 2000-token prompt cancelled during its prefill
 *   capi_check threads MODEL             four threads at once against their solo outputs
 *   capi_check cycles MODEL N            load and free N times: RSS after each free
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "edgellm.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static edgellm_model *load(const char *name, int max_sequences, int context_length) {
    char options[1024];
    snprintf(options, sizeof options,
             "{\"model\": \"%s\", \"max_sequences\": %d, \"context_length\": %d}", name,
             max_sequences, context_length);
    edgellm_model *model = NULL;
    edgellm_status status = edgellm_model_load(options, NULL, NULL, &model);
    if (status != EDGELLM_OK) {
        printf("error load %s: %s\n", edgellm_status_name(status), edgellm_last_error());
        exit(1);
    }
    return model;
}

/* ---- a reply's token ids, collected by the chunk callback ------------------------------ */

#define MAX_IDS 512
typedef struct {
    int ids[MAX_IDS];
    int n_ids;
    int chunks;
    int chunks_at_cancel; /* -1 until the canceller acts */
    int cancel_after;     /* the canceller acts once this many chunks arrived (0: never) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} reply;

static void reply_init(reply *r, int cancel_after) {
    memset(r, 0, sizeof *r);
    r->chunks_at_cancel = -1;
    r->cancel_after = cancel_after;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static int collect(void *user_data, const char *chunk, size_t length) {
    (void)length;
    reply *r = user_data;
    pthread_mutex_lock(&r->mu);
    const char *p = strstr(chunk, "\"token_ids\": [");
    for (p = p ? p + 14 : NULL; p && *p && *p != ']';) {
        char *end;
        long id = strtol(p, &end, 10);
        if (end == p)
            break;
        if (r->n_ids < MAX_IDS)
            r->ids[r->n_ids++] = (int)id;
        p = end;
        while (*p == ',' || *p == ' ')
            p++;
    }
    r->chunks++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static edgellm_status run_chat(edgellm_model *model, const char *json, reply *r,
                               edgellm_request **keep) {
    edgellm_request *req = NULL;
    edgellm_status status = edgellm_request_create(model, &req);
    if (status != EDGELLM_OK)
        return status;
    if (keep)
        *keep = req;
    status = edgellm_chat(req, json, collect, r);
    if (!keep)
        edgellm_request_free(req);
    return status;
}

static void print_ids(const char *label, const reply *r) {
    printf("%s", label);
    for (int i = 0; i < r->n_ids; i++)
        printf(" %d", r->ids[i]);
    printf("\n");
}

static int same_ids(const reply *a, const reply *b) {
    return a->n_ids == b->n_ids && !memcmp(a->ids, b->ids, sizeof(int) * (size_t)a->n_ids);
}

/* ---- bad input --------------------------------------------------------------------------- */

static void report(const char *name, edgellm_status status) {
    printf("case %s %s %s\n", name, edgellm_status_name(status), edgellm_last_error());
    fflush(stdout);
}

static int refuse_load(void *user_data, double fraction, const char *stage) {
    (void)fraction;
    ++*(int *)user_data;
    return strcmp(stage, "weights") == 0; /* abort once the weights start */
}

static void *fail_on_another_thread(void *arg) {
    char *seen = arg;
    edgellm_model_free(NULL); /* this thread's own failure */
    snprintf(seen, 256, "%s", edgellm_last_error());
    return NULL;
}

static int bad_input(const char *model_name, const char *missing, const char *garbage) {
    edgellm_model *model = NULL;
    edgellm_request *req = NULL;
    size_t n = 0;
    char small[4];
    int32_t ids[64];
    char options[1024];

    /* NULL pointers, before and after Python has started */
    report("null_out_model", edgellm_model_load("{\"model\": \"x\"}", NULL, NULL, NULL));
    report("null_options", edgellm_model_load(NULL, NULL, NULL, &model));
    report("null_model_free", edgellm_model_free(NULL));
    report("null_model_tokenize", edgellm_tokenize(NULL, "hi", 0, NULL, 0, &n));
    report("null_request_cancel", edgellm_request_cancel(NULL));
    report("null_chat_request", edgellm_chat(NULL, "{}", NULL, NULL));

    /* the last error is per thread: another thread's failure leaves this one's alone */
    char other[256] = "", mine[256];
    snprintf(mine, sizeof mine, "%s", edgellm_last_error());
    pthread_t thread;
    pthread_create(&thread, NULL, fail_on_another_thread, other);
    pthread_join(thread, NULL);
    printf("last_error_per_thread %d\n", strcmp(mine, edgellm_last_error()) == 0 &&
                                              strstr(other, "edgellm_model_free") != NULL &&
                                              strstr(mine, "edgellm_chat") != NULL);

    /* invalid and wrong-typed JSON, unknown keys, unknown model, missing file */
    report("json_invalid", edgellm_model_load("{\"model\": ", NULL, NULL, &model));
    report("json_not_object", edgellm_model_load("[1, 2]", NULL, NULL, &model));
    report("json_wrong_type", edgellm_model_load("{\"model\": 7}", NULL, NULL, &model));
    report("json_unknown_key",
           edgellm_model_load("{\"model\": \"gemma-3-270m\", \"colour\": 1}", NULL, NULL, &model));
    report("json_bad_utf8", edgellm_model_load("{\"model\": \"\xff\xfe\"}", NULL, NULL, &model));
    report("unknown_model", edgellm_model_load("{\"model\": \"no-such-model-7b\"}", NULL, NULL,
                                               &model));
    snprintf(options, sizeof options, "{\"model\": \"%s\"}", missing);
    report("missing_file", edgellm_model_load(options, NULL, NULL, &model));
    snprintf(options, sizeof options, "{\"model\": \"%s\"}", garbage);
    report("not_a_model", edgellm_model_load(options, NULL, NULL, &model));
    report("bad_backend", edgellm_model_load("{\"model\": \"gemma-3-270m\", \"backend\": "
                                             "\"abacus\"}", NULL, NULL, &model));
    int progress_calls = 0;
    snprintf(options, sizeof options, "{\"model\": \"%s\"}", model_name);
    report("load_cancelled_by_progress", edgellm_model_load(options, refuse_load,
                                                            &progress_calls, &model));
    printf("progress_calls %d\n", progress_calls);
    report("model_after_failures_is_null", model == NULL ? EDGELLM_OK : EDGELLM_ERR_INTERNAL);

    model = load(model_name, 1, 512);
    report("null_tokenize_text", edgellm_tokenize(model, NULL, 0, ids, 64, &n));
    report("null_tokenize_count", edgellm_tokenize(model, "hi", 0, ids, 64, NULL));
    report("null_tokens_with_capacity", edgellm_tokenize(model, "hi", 0, NULL, 8, &n));
    report("bad_tokenize_flags", edgellm_tokenize(model, "hi", 0x80, ids, 64, &n));

    /* two-call sizing and buffers too small */
    edgellm_status s = edgellm_tokenize(model, "Hello, world! Hello again.", 0, NULL, 0, &n);
    printf("tokenize_size %s %zu\n", edgellm_status_name(s), n);
    report("tokenize_too_small", edgellm_tokenize(model, "Hello, world! Hello again.", 0, ids,
                                                  1, &n));
    printf("tokenize_needed %zu\n", n);
    s = edgellm_tokenize(model, "Hello, world! Hello again.", 0, ids, n, &n);
    printf("tokenize_full %s %zu\n", edgellm_status_name(s), n);
    size_t text_size = 0;
    s = edgellm_detokenize(model, ids, n, NULL, 0, &text_size);
    report("detokenize_too_small", edgellm_detokenize(model, ids, n, small, sizeof small,
                                                      &text_size));
    char *text = malloc(text_size);
    s = edgellm_detokenize(model, ids, n, text, text_size, &text_size);
    printf("detokenize_full %s %zu %s\n", edgellm_status_name(s), text_size, text);
    free(text);
    int32_t bad_id = 99999999;
    report("detokenize_bad_id", edgellm_detokenize(model, &bad_id, 1, NULL, 0, &text_size));
    report("info_too_small", edgellm_model_info(model, small, sizeof small, &n));

    /* requests: bad JSON, unsupported keys, wrong types, NULL, result before running */
    reply r;
    reply_init(&r, 0);
    report("chat_json_invalid", run_chat(model, "{\"messages\": [", &r, NULL));
    report("chat_wrong_type", run_chat(model, "{\"messages\": \"hello\"}", &r, NULL));
    report("chat_message_wrong_type",
           run_chat(model, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", &r, NULL));
    report("chat_bad_role",
           run_chat(model, "{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}", &r,
                    NULL));
    report("chat_unsupported_key",
           run_chat(model, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                           "\"tools\": []}", &r, NULL));
    report("chat_bad_temperature",
           run_chat(model, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                           "\"temperature\": -1}", &r, NULL));
    edgellm_request_create(model, &req);
    report("chat_null_json", edgellm_chat(req, NULL, NULL, NULL));
    report("chat_beyond_context",
           run_chat(model, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                           "\"max_tokens\": 100000}", &r, NULL));
    report("complete_missing_prompt", edgellm_complete(req, "{\"max_tokens\": 3}", NULL, NULL));
    report("result_before_run", edgellm_request_result(req, NULL, 0, &n));

    /* a request runs once; the result's buffer too small */
    edgellm_status ran = edgellm_chat(req, "{\"messages\": [{\"role\": \"user\", \"content\": "
                                           "\"hi\"}], \"max_tokens\": 2, \"temperature\": 0}",
                                      NULL, NULL);
    printf("chat_ok %s\n", edgellm_status_name(ran));
    report("chat_runs_once", edgellm_chat(req, "{\"messages\": [{\"role\": \"user\", "
                                               "\"content\": \"hi\"}]}", NULL, NULL));
    report("result_too_small", edgellm_request_result(req, small, sizeof small, &n));

    /* destroyed handles used again, and handles of the wrong kind */
    report("request_free", edgellm_request_free(req));
    report("request_used_after_free", edgellm_request_cancel(req));
    report("request_freed_twice", edgellm_request_free(req));
    report("request_as_model", edgellm_model_info((edgellm_model *)req, NULL, 0, &n));
    report("forged_handle", edgellm_model_info((edgellm_model *)(uintptr_t)0x1234, NULL, 0, &n));
    edgellm_request *orphan = NULL;
    edgellm_request_create(model, &orphan);
    report("model_free", edgellm_model_free(model));
    report("model_used_after_free", edgellm_tokenize(model, "hi", 0, NULL, 0, &n));
    report("model_freed_twice", edgellm_model_free(model));
    report("request_create_after_free", edgellm_request_create(model, &req));
    report("orphan_request_runs", edgellm_chat(orphan, "{\"messages\": [{\"role\": \"user\", "
                                                       "\"content\": \"hi\"}]}", NULL, NULL));
    report("orphan_request_free", edgellm_request_free(orphan));
    /* a new model reuses the slot: the old handle must still be rejected */
    edgellm_model *again = load(model_name, 1, 512);
    report("stale_handle_after_reuse", edgellm_tokenize(model, "hi", 0, NULL, 0, &n));
    report("new_handle_works", edgellm_tokenize(again, "hi", 0, NULL, 0, &n));
    edgellm_model_free(again);
    printf("done\n");
    return 0;
}

static long info_number(edgellm_model *model, const char *key);

/* ---- cancel a reply from a second thread --------------------------------------------- */

typedef struct {
    edgellm_request *request;
    reply *r;
} canceller_args;

static void *cancel_when_ready(void *arg) {
    canceller_args *a = arg;
    pthread_mutex_lock(&a->r->mu);
    while (a->r->chunks < a->r->cancel_after)
        pthread_cond_wait(&a->r->cv, &a->r->mu);
    a->r->chunks_at_cancel = a->r->chunks;
    /* the cancel itself happens with the lock held, so no chunk slips in between the count
     * and the cancel: every chunk counted later came after it */
    edgellm_request_cancel(a->request);
    pthread_mutex_unlock(&a->r->mu);
    return NULL;
}

#define CHAT_JSON(content, max_tokens)                                                        \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"" content "\"}], \"temperature\": 0, " \
    "\"max_tokens\": " #max_tokens "}"

typedef struct {
    edgellm_model *model;
    reply *r;
    edgellm_request *request;
    edgellm_status status;
    int unused;
} free_args;

static void *chat_while_freed(void *arg) {
    free_args *a = arg;
    a->status = edgellm_chat(a->request, CHAT_JSON("Write a long story about a fox.", 400),
                             collect, a->r);
    return NULL;
}

static int cancel_reply(const char *model_name) {
    edgellm_model *model = load(model_name, 2, 1024);
    const char *short_json = CHAT_JSON("Name three colours.", 12);
    reply before, after, cut;
    reply_init(&before, 0);
    edgellm_status s = run_chat(model, short_json, &before, NULL);
    printf("before %s\n", edgellm_status_name(s));

    reply_init(&cut, 4);
    edgellm_request *req = NULL;
    edgellm_request_create(model, &req);
    canceller_args args = {req, &cut};
    pthread_t thread;
    pthread_create(&thread, NULL, cancel_when_ready, &args);
    s = edgellm_chat(req, CHAT_JSON("Write a long story about a lighthouse keeper.", 400),
                     collect, &cut);
    pthread_join(thread, NULL);
    printf("cancel_status %s\n", edgellm_status_name(s));
    printf("chunks_at_cancel %d\n", cut.chunks_at_cancel);
    printf("chunks_total %d\n", cut.chunks);
    printf("cancel_steps_max %ld\n", info_number(model, "cancel_steps_max"));
    size_t n = 0;
    s = edgellm_request_result(req, NULL, 0, &n);
    printf("result_after_cancel %s\n", edgellm_status_name(s));
    edgellm_request_free(req);

    /* a request cancelled before it runs returns at once */
    edgellm_request_create(model, &req);
    edgellm_request_cancel(req);
    reply none;
    reply_init(&none, 0);
    s = edgellm_chat(req, short_json, collect, &none);
    printf("cancel_before_run %s %d\n", edgellm_status_name(s), none.chunks);
    edgellm_request_free(req);

    reply_init(&after, 0);
    s = run_chat(model, short_json, &after, NULL);
    printf("after %s\n", edgellm_status_name(s));
    print_ids("ids_before", &before);
    print_ids("ids_after", &after);
    printf("usable_after_cancel %d\n", same_ids(&before, &after));

    /* freeing the model while another thread's request runs: that request is cancelled */
    reply running;
    reply_init(&running, 0);
    edgellm_request_create(model, &req);
    free_args fa = {model, &running, req, 0, 0};
    pthread_create(&thread, NULL, chat_while_freed, &fa);
    pthread_mutex_lock(&running.mu);
    while (running.chunks < 2)
        pthread_cond_wait(&running.cv, &running.mu);
    pthread_mutex_unlock(&running.mu);
    s = edgellm_model_free(model);
    pthread_join(thread, NULL);
    printf("free_while_running %s %s\n", edgellm_status_name(s), edgellm_status_name(fa.status));
    printf("request_free_after_model %s\n", edgellm_status_name(edgellm_request_free(req)));
    return 0;
}

/* ---- cancel a long prompt's prefill ---------------------------------------------------- */

static long info_number(edgellm_model *model, const char *key) {
    char buf[4096];
    size_t n = 0;
    if (edgellm_model_info(model, buf, sizeof buf, &n) != EDGELLM_OK)
        return -1;
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\": ", key);
    const char *p = strstr(buf, pattern);
    return p ? strtol(p + strlen(pattern), NULL, 10) : -1;
}

typedef struct {
    edgellm_model *model;
    edgellm_request *request;
    long prompt_tokens_before;
    double cancelled_at;
    long prompt_tokens_at_cancel;
} prefill_args;

static void *cancel_during_prefill(void *arg) {
    prefill_args *a = arg;
    /* wait until the engine has run the first slice of the prompt, then cancel */
    while (info_number(a->model, "prompt_tokens") <= a->prompt_tokens_before)
        usleep(2000);
    a->prompt_tokens_at_cancel = info_number(a->model, "prompt_tokens") - a->prompt_tokens_before;
    a->cancelled_at = now_s();
    edgellm_request_cancel(a->request);
    return NULL;
}

static int cancel_prefill(const char *model_name) {
    edgellm_model *model = load(model_name, 1, 2560);
    const char *short_json = CHAT_JSON("Name three colours.", 8);
    reply before, after;
    reply_init(&before, 0);
    run_chat(model, short_json, &before, NULL);

    /* a user message of about 2000 tokens */
    static char json[65536];
    strcpy(json, "{\"messages\": [{\"role\": \"user\", \"content\": \"Summarize this: ");
    for (int i = 0; i < 2000; i++)
        strcat(json, i % 10 == 9 ? "lamp. " : "lamp ");
    strcat(json, "\"}], \"temperature\": 0, \"max_tokens\": 4}");
    char *content = strstr(json, "Summarize");
    size_t n = 0;
    *strstr(content, "\"}]") = '\0';
    edgellm_tokenize(model, content, 0, NULL, 0, &n);
    content[strlen(content)] = '"';
    printf("prompt_tokens %zu\n", n);

    prefill_args args = {model, NULL, info_number(model, "prompt_tokens"), 0, 0};
    edgellm_request_create(model, &args.request);
    pthread_t thread;
    pthread_create(&thread, NULL, cancel_during_prefill, &args);
    reply cut;
    reply_init(&cut, 0);
    double start = now_s();
    edgellm_status s = edgellm_chat(args.request, json, collect, &cut);
    double end = now_s();
    pthread_join(thread, NULL);
    printf("cancel_status %s\n", edgellm_status_name(s));
    printf("chunks %d\n", cut.chunks);
    printf("prefilled_at_cancel %ld\n", args.prompt_tokens_at_cancel);
    printf("prefilled_total %ld\n", info_number(model, "prompt_tokens") - args.prompt_tokens_before);
    printf("cancel_steps_max %ld\n", info_number(model, "cancel_steps_max"));
    printf("seconds_to_return %.3f\n", end - args.cancelled_at);
    printf("seconds_running %.3f\n", end - start);
    edgellm_request_free(args.request);

    reply_init(&after, 0);
    s = run_chat(model, short_json, &after, NULL);
    printf("after %s\n", edgellm_status_name(s));
    printf("usable_after_cancel %d\n", same_ids(&before, &after));
    edgellm_model_free(model);
    return 0;
}

/* ---- four threads on one model --------------------------------------------------------- */

static const char *const PROMPTS[4] = {
    CHAT_JSON("Write a haiku about the sea.", 16),
    CHAT_JSON("What is 17 times 3?", 16),
    CHAT_JSON("Write a C function that reverses a string.", 16),
    CHAT_JSON("Name the planets of the solar system.", 16),
};

typedef struct {
    edgellm_model *model;
    const char *json;
    reply r;
    edgellm_status status;
} worker_args;

static int workers_done = 0;

static void *worker(void *arg) {
    worker_args *w = arg;
    w->status = run_chat(w->model, w->json, &w->r, NULL);
    __sync_fetch_and_add(&workers_done, 1);
    return NULL;
}

static int four_threads(const char *model_name) {
    edgellm_model *model = load(model_name, 4, 512);
    worker_args solo[4], together[4];
    for (int i = 0; i < 4; i++) { /* each alone, one after another */
        memset(&solo[i], 0, sizeof solo[i]);
        solo[i].model = model, solo[i].json = PROMPTS[i];
        reply_init(&solo[i].r, 0);
        solo[i].status = run_chat(model, PROMPTS[i], &solo[i].r, NULL);
    }
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) { /* all four at once */
        memset(&together[i], 0, sizeof together[i]);
        together[i].model = model, together[i].json = PROMPTS[i];
        reply_init(&together[i].r, 0);
        pthread_create(&threads[i], NULL, worker, &together[i]);
    }
    /* how many sequences the engine decoded at once while they ran */
    long most_active = 0;
    while (__sync_fetch_and_add(&workers_done, 0) < 4) {
        long active = info_number(model, "active");
        most_active = active > most_active ? active : most_active;
        usleep(1000);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(threads[i], NULL);
    int all_same = 1;
    for (int i = 0; i < 4; i++) {
        char label[32];
        snprintf(label, sizeof label, "solo_%d", i);
        print_ids(label, &solo[i].r);
        snprintf(label, sizeof label, "together_%d", i);
        print_ids(label, &together[i].r);
        printf("status_%d %s %s\n", i, edgellm_status_name(solo[i].status),
               edgellm_status_name(together[i].status));
        all_same &= same_ids(&solo[i].r, &together[i].r) && solo[i].r.n_ids > 0 &&
                    together[i].status == EDGELLM_OK;
    }
    printf("most_active %ld\n", most_active);
    printf("all_same %d\n", all_same);
    edgellm_model_free(model);
    return 0;
}

/* ---- load and free, again and again ------------------------------------------------------ */

static long rss_kb(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (f == NULL)
        return -1;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = -1;
    fclose(f);
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static int cycles(const char *model_name, int n) {
    for (int i = 0; i < n; i++) {
        edgellm_model *model = load(model_name, 1, 256);
        reply r;
        reply_init(&r, 0);
        edgellm_status s = run_chat(model, CHAT_JSON("Hello", 4), &r, NULL);
        if (s != EDGELLM_OK)
            printf("error chat %s %s\n", edgellm_status_name(s), edgellm_last_error());
        long loaded = rss_kb();
        edgellm_model_free(model);
        printf("cycle %d loaded_kb %ld freed_kb %ld\n", i, loaded, rss_kb());
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (EDGELLM_CHECK_ABI() != EDGELLM_OK) {
        printf("error abi %s\n", edgellm_last_error());
        return 1;
    }
    printf("abi %u\n", edgellm_abi_version());
    if (argc == 5 && !strcmp(argv[1], "bad"))
        return bad_input(argv[2], argv[3], argv[4]);
    if (argc == 3 && !strcmp(argv[1], "cancel"))
        return cancel_reply(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "prefill"))
        return cancel_prefill(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "threads"))
        return four_threads(argv[2]);
    if (argc == 4 && !strcmp(argv[1], "cycles"))
        return cycles(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: capi_check bad|cancel|prefill|threads|cycles MODEL [ARG]\n");
    return 2;
}
