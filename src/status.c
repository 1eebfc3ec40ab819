#include "status.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local struct nf4_error last;
static _Thread_local int have_error;
static int quiet;

/* Warnings kept for convert --json, from any thread. */
static pthread_mutex_t warn_mu = PTHREAD_MUTEX_INITIALIZER;
static int capturing;
static char **captured;
static size_t ncaptured, captured_cap;

size_t nf4_control_len(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    if (p[0] < 0x20 || p[0] == 0x7f)
        return p[0] ? 1 : 0;
    return p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f ? 2 : 0; /* C1 (CSI is U+009B) as UTF-8 */
}

/* The message must stay one line, and inert on a terminal, whatever a hostile
 * file or tensor name holds: control characters (newlines, ESC sequences, VT,
 * BEL, C1) print as '?', as ls does. */
static void one_line(char *s)
{
    char *w = s;
    for (const char *p = s; *p;) {
        size_t n = nf4_control_len(p);
        *w++ = n ? '?' : *p;
        p += n ? n : 1;
    }
    *w = '\0';
}

/* nf4_show_dir_as: set by the thread that runs a conversion, read by any
 * thread that fails. */
static pthread_mutex_t shown_mu = PTHREAD_MUTEX_INITIALIZER;
static char *shown_dir, *shown_as;

void nf4_show_dir_as(const char *dir, const char *shown)
{
    char *d = dir && shown ? strdup(dir) : NULL, *s = d ? strdup(shown) : NULL;
    if (!s) { /* out of memory: messages keep the real path */
        free(d);
        d = NULL;
    }
    for (size_t n = s ? strlen(s) : 0; n > 1 && s[n - 1] == '/'; n--)
        s[n - 1] = '\0'; /* "out/" + "/config.json" would read "out//config.json" */
    pthread_mutex_lock(&shown_mu);
    free(shown_dir);
    free(shown_as);
    shown_dir = d;
    shown_as = s;
    pthread_mutex_unlock(&shown_mu);
}

/* file as the user should read it, into buf. */
static void shown_path(char *buf, size_t size, const char *file)
{
    pthread_mutex_lock(&shown_mu);
    size_t n = shown_dir ? strlen(shown_dir) : 0;
    if (n && strncmp(file, shown_dir, n) == 0 && (file[n] == '/' || file[n] == '\0'))
        snprintf(buf, size, "%s%s", shown_as, file + n);
    else
        snprintf(buf, size, "%s", file);
    pthread_mutex_unlock(&shown_mu);
}

/* nf4_origins_register: set by the thread that opens a converted LoRA, read
 * by any thread that fails. */
struct origins {
    const void *owner;
    const char *file;
    const char *(*origin_of)(const void *owner, const char *tensor);
};
static pthread_mutex_t origins_mu = PTHREAD_MUTEX_INITIALIZER;
static struct origins *origins;
static size_t norigins, origins_cap;

void nf4_origins_register(const void *owner, const char *file,
                          const char *(*origin_of)(const void *owner, const char *tensor))
{
    pthread_mutex_lock(&origins_mu);
    if (norigins == origins_cap) {
        size_t cap = origins_cap ? 2 * origins_cap : 8;
        struct origins *grown = realloc(origins, cap * sizeof *grown);
        if (grown) {
            origins = grown;
            origins_cap = cap;
        }
    }
    if (norigins < origins_cap)
        origins[norigins++] = (struct origins){owner, file, origin_of};
    pthread_mutex_unlock(&origins_mu);
}

void nf4_origins_unregister(const void *owner)
{
    pthread_mutex_lock(&origins_mu);
    for (size_t i = 0; i < norigins; i++)
        if (origins[i].owner == owner)
            origins[i--] = origins[--norigins];
    if (norigins == 0) { /* nothing held between conversions */
        free(origins);
        origins = NULL;
        origins_cap = 0;
    }
    pthread_mutex_unlock(&origins_mu);
}

/* Into buf, the name tensor `tensor` of `file` has in the user's file, where
 * another: 1; else 0. Copied under the lock, as the file may be closed
 * after it. */
static int origin_of(const char *file, const char *tensor, char *buf, size_t size)
{
    const char *o = NULL;
    pthread_mutex_lock(&origins_mu);
    for (size_t i = 0; i < norigins && !o; i++)
        if (strcmp(origins[i].file, file) == 0)
            o = origins[i].origin_of(origins[i].owner, tensor);
    int found = o && strcmp(o, tensor) != 0;
    if (found)
        snprintf(buf, size, "%s", o);
    pthread_mutex_unlock(&origins_mu);
    return found;
}

const char *nf4_tensor_shown(const char *file, const char *tensor, char *buf, size_t size)
{
    char origin[sizeof last.tensor];
    if (!file || !tensor || !origin_of(file, tensor, origin, sizeof origin))
        return tensor;
    snprintf(buf, size, "%s (converted to %s)", origin, tensor);
    return buf;
}

static void vrecord(const char *file, const char *tensor, const char *suffix, const char *fmt, va_list ap)
{
    if (have_error)
        return;
    char *t = last.text;
    size_t len = 0;
    char origin_buf[sizeof last.tensor];
    const char *origin = file && tensor && origin_of(file, tensor, origin_buf, sizeof origin_buf) ? origin_buf : NULL;
    if (file)
        shown_path(last.file, sizeof last.file, file);
    else
        last.file[0] = '\0';
    file = file ? last.file : NULL;
    snprintf(last.tensor, sizeof last.tensor, "%s", origin ? origin : tensor ? tensor : "");
    if (file)
        len += (size_t)snprintf(t + len, NF4_ERROR_MAX - len, "%s: ", file);
    if (origin && len < NF4_ERROR_MAX)
        len += (size_t)snprintf(t + len, NF4_ERROR_MAX - len, "%s (converted to %s): ", origin, tensor);
    else if (tensor && len < NF4_ERROR_MAX)
        len += (size_t)snprintf(t + len, NF4_ERROR_MAX - len, "%s: ", tensor);
    if (len < NF4_ERROR_MAX)
        len += (size_t)vsnprintf(t + len, NF4_ERROR_MAX - len, fmt, ap);
    if (suffix && len < NF4_ERROR_MAX)
        snprintf(t + len, NF4_ERROR_MAX - len, ": %s", suffix);
    one_line(t);
    have_error = 1;
}

int nf4_fail(int code, const char *file, const char *tensor, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vrecord(file, tensor, NULL, fmt, ap);
    va_end(ap);
    return code;
}

int nf4_fail_errno(int code, int errnum, const char *file, const char *tensor, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vrecord(file, tensor, strerror(errnum), fmt, ap);
    va_end(ap);
    return code;
}

const char *nf4_last_error(void)
{
    return have_error ? last.text : "unknown error";
}

const struct nf4_error *nf4_last_error_record(void)
{
    return have_error ? &last : NULL;
}

void nf4_error_save(struct nf4_error *e)
{
    if (have_error) {
        *e = last;
        return;
    }
    memset(e, 0, sizeof *e);
    snprintf(e->text, sizeof e->text, "unknown error");
}

int nf4_error_restore(int code, const struct nf4_error *e)
{
    if (!have_error) {
        last = *e;
        have_error = 1;
    }
    return code;
}

void nf4_clear_error(void)
{
    /* The flag alone: vrecord writes every field of the record whole, and nothing
     * reads the record while the flag is clear. Every call into the public ABI
     * clears it, once per eager dequantization from PyTorch, and wiping the whole
     * 13 KiB record there cost about 90 ns a call (and an L1 full of it). */
    have_error = 0;
}

void nf4_set_quiet(int q)
{
    quiet = q;
}

int nf4_is_quiet(void)
{
    return quiet;
}

void nf4_warn_capture(int on)
{
    pthread_mutex_lock(&warn_mu);
    capturing = on;
    pthread_mutex_unlock(&warn_mu);
}

static void capture(const char *text)
{
    pthread_mutex_lock(&warn_mu);
    if (capturing && ncaptured < NF4_MAX_CAPTURED_WARNINGS) {
        if (ncaptured == captured_cap) {
            size_t cap = captured_cap ? 2 * captured_cap : 8;
            char **grown = realloc(captured, cap * sizeof *grown);
            if (grown) {
                captured = grown;
                captured_cap = cap;
            }
        }
        char *copy = ncaptured < captured_cap ? strdup(text) : NULL;
        if (copy)
            captured[ncaptured++] = copy;
    }
    pthread_mutex_unlock(&warn_mu);
}

const char *const *nf4_warnings(size_t *n)
{
    pthread_mutex_lock(&warn_mu);
    *n = ncaptured;
    pthread_mutex_unlock(&warn_mu);
    return (const char *const *)captured;
}

static void vsay(const char *prefix, const char *fmt, va_list ap)
{
    static _Thread_local char text[NF4_ERROR_MAX]; /* off the stack: the pipeline's threads warn too */
    vsnprintf(text, sizeof text, fmt, ap);
    one_line(text);
    capture(text);
    if (!quiet)
        fprintf(stderr, "nf4deq: %s%s\n", prefix, text);
}

void nf4_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay("warning: ", fmt, ap);
    va_end(ap);
}

void nf4_note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay("", fmt, ap);
    va_end(ap);
}
