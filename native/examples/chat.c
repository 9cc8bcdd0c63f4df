/*
 * chat.c: a small streaming chat CLI over libedgellm (native/edgellm.h).
 *
 *   edgellm capi build --out build/capi
 *   cc -I build/capi native/examples/chat.c -L build/capi -ledgellm \
 *      -Wl,-rpath,"$PWD/build/capi" -o chat
 *   ./chat [-m MODEL] [-n MAX_TOKENS] [-t TEMPERATURE] [-s SYSTEM] [--ids]
 *
 * Reads one user message per line from stdin and streams the reply to stdout, keeping the
 * conversation (each turn sends the whole history, as an OpenAI client does; the engine
 * reuses the cached prefix). Ctrl-C stops the current reply. --ids prints each chunk's token
 * ids to stderr ("ids: 9707 11"), one line per reply.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm.h"

static volatile sig_atomic_t interrupted = 0;

static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1; /* the chunk callback cancels: edgellm calls are not async-signal-safe */
}

/* A growing string. */
typedef struct {
    char *data;
    size_t len, cap;
} buffer;

static void append(buffer *b, const char *text, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->data = realloc(b->data, b->cap);
        if (b->data == NULL) {
            fprintf(stderr, "chat: out of memory\n");
            exit(1);
        }
    }
    memcpy(b->data + b->len, text, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void append_str(buffer *b, const char *text) { append(b, text, strlen(text)); }

/* text as a JSON string literal (quotes included). */
static void append_json_string(buffer *b, const char *text) {
    append_str(b, "\"");
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            append(b, esc, 2);
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            append_str(b, esc);
        } else {
            append(b, (const char *)p, 1);
        }
    }
    append_str(b, "\"");
}

/* The UTF-8 bytes of code point cp. */
static void append_utf8(buffer *b, unsigned cp) {
    char out[4];
    size_t n;
    if (cp < 0x80) {
        out[0] = (char)cp, n = 1;
    } else if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    } else if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12), out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    } else {
        out[0] = (char)(0xF0 | cp >> 18), out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), out[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
    }
    append(b, out, n);
}

/* Decode the JSON string whose opening quote is at *s into out; returns the position after
 * its closing quote (NULL if malformed). Enough for the chunks edgellm writes. */
static const char *read_json_string(const char *s, buffer *out) {
    if (*s++ != '"')
        return NULL;
    while (*s && *s != '"') {
        if (*s != '\\') {
            append(out, s++, 1);
            continue;
        }
        s++;
        char c = *s++;
        const char *simple = strchr("\"\\/bfnrt", c);
        if (simple != NULL && c != '\0') {
            static const char decoded[] = "\"\\/\b\f\n\r\t";
            append(out, &decoded[simple - "\"\\/bfnrt"], 1);
        } else if (c == 'u') {
            unsigned cp = (unsigned)strtoul((char[5]){s[0], s[1], s[2], s[3], 0}, NULL, 16);
            s += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && s[0] == '\\' && s[1] == 'u') { /* surrogates */
                unsigned lo = (unsigned)strtoul((char[5]){s[2], s[3], s[4], s[5], 0}, NULL, 16);
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                s += 6;
            }
            append_utf8(out, cp);
        } else {
            return NULL;
        }
    }
    return *s == '"' ? s + 1 : NULL;
}

typedef struct {
    buffer reply; /* the assistant's text so far */
    buffer ids;   /* "ids:" and the token ids, for --ids */
} turn;

/* Print a chunk's delta content as it arrives; collect it and its token ids. */
static int on_chunk(void *user_data, const char *chunk, size_t length) {
    (void)length;
    turn *t = user_data;
    const char *content = strstr(chunk, "\"content\": ");
    if (content != NULL) {
        buffer text = {0};
        if (read_json_string(content + strlen("\"content\": "), &text) != NULL && text.len) {
            fwrite(text.data, 1, text.len, stdout);
            fflush(stdout);
            append(&t->reply, text.data, text.len);
        }
        free(text.data);
    }
    const char *ids = strstr(chunk, "\"token_ids\": [");
    for (ids = ids ? ids + strlen("\"token_ids\": [") : NULL; ids && *ids && *ids != ']';) {
        char *end;
        long id = strtol(ids, &end, 10);
        if (end == ids)
            break;
        char number[24];
        snprintf(number, sizeof number, " %ld", id);
        append_str(&t->ids, number);
        ids = end + (*end == ',' ? 1 : 0);
        while (*ids == ' ')
            ids++;
    }
    return interrupted; /* non-zero cancels the request */
}

static int usage(void) {
    fprintf(stderr, "usage: chat [-m MODEL] [-n MAX_TOKENS] [-t TEMPERATURE] [-s SYSTEM] "
                    "[--ids]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *model_name = "qwen2.5-coder-0.5b-instruct", *system = NULL;
    int max_tokens = 256, show_ids = 0;
    double temperature = 0.0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ids"))
            show_ids = 1;
        else if (i + 1 < argc && !strcmp(argv[i], "-m"))
            model_name = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "-n"))
            max_tokens = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "-t"))
            temperature = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "-s"))
            system = argv[++i];
        else
            return usage();
    }
    if (EDGELLM_CHECK_ABI() != EDGELLM_OK) {
        fprintf(stderr, "chat: %s\n", edgellm_last_error());
        return 1;
    }
    buffer options = {0};
    append_str(&options, "{\"model\": ");
    append_json_string(&options, model_name);
    append_str(&options, ", \"max_sequences\": 1}");
    edgellm_model *model = NULL;
    edgellm_status status = edgellm_model_load(options.data, NULL, NULL, &model);
    free(options.data);
    if (status != EDGELLM_OK) {
        fprintf(stderr, "chat: %s: %s\n", edgellm_status_name(status), edgellm_last_error());
        return 1;
    }
    signal(SIGINT, on_sigint);

    buffer messages = {0}; /* the conversation as a JSON array's items */
    if (system != NULL) {
        append_str(&messages, "{\"role\": \"system\", \"content\": ");
        append_json_string(&messages, system);
        append_str(&messages, "}");
    }
    char line[8192];
    int exit_code = 0;
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] == '\0')
            continue;
        append_str(&messages, messages.len ? ", {\"role\": \"user\", \"content\": "
                                           : "{\"role\": \"user\", \"content\": ");
        append_json_string(&messages, line);
        append_str(&messages, "}");
        buffer request = {0};
        char sampling[96];
        snprintf(sampling, sizeof sampling, "], \"max_tokens\": %d, \"temperature\": %g}",
                 max_tokens, temperature);
        append_str(&request, "{\"messages\": [");
        append(&request, messages.data, messages.len);
        append_str(&request, sampling);

        turn t = {{0}, {0}};
        append_str(&t.reply, "");
        append_str(&t.ids, "ids:");
        edgellm_request *req = NULL;
        interrupted = 0;
        status = edgellm_request_create(model, &req);
        if (status == EDGELLM_OK)
            status = edgellm_chat(req, request.data, on_chunk, &t);
        free(request.data);
        printf("\n");
        fflush(stdout);
        if (show_ids)
            fprintf(stderr, "%s\n", t.ids.data);
        if (status == EDGELLM_ERR_CANCELLED) {
            fprintf(stderr, "chat: [reply stopped]\n");
        } else if (status != EDGELLM_OK) {
            fprintf(stderr, "chat: %s: %s\n", edgellm_status_name(status), edgellm_last_error());
            exit_code = 1;
        }
        /* the reply (even a cut one) joins the conversation */
        append_str(&messages, ", {\"role\": \"assistant\", \"content\": ");
        append_json_string(&messages, t.reply.data);
        append_str(&messages, "}");
        edgellm_request_free(req);
        free(t.reply.data);
        free(t.ids.data);
        if (exit_code)
            break;
    }
    free(messages.data);
    status = edgellm_model_free(model);
    if (status != EDGELLM_OK) {
        fprintf(stderr, "chat: %s\n", edgellm_last_error());
        return 1;
    }
    return exit_code;
}
