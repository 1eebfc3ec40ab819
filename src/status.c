#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define ERROR_MAX 1024

static _Thread_local char last_error[ERROR_MAX];
static _Thread_local int have_error;
static int quiet;

static void vrecord(const char *file, const char *tensor, const char *suffix, const char *fmt, va_list ap)
{
    if (have_error)
        return;
    size_t len = 0;
    if (file)
        len += (size_t)snprintf(last_error + len, ERROR_MAX - len, "%s: ", file);
    if (tensor && len < ERROR_MAX)
        len += (size_t)snprintf(last_error + len, ERROR_MAX - len, "%s: ", tensor);
    if (len < ERROR_MAX)
        len += (size_t)vsnprintf(last_error + len, ERROR_MAX - len, fmt, ap);
    if (suffix && len < ERROR_MAX)
        snprintf(last_error + len, ERROR_MAX - len, ": %s", suffix);
    /* The message must stay on one line whatever a hostile file name holds. */
    for (char *p = last_error; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
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
    return have_error ? last_error : "unknown error";
}

void nf4_clear_error(void)
{
    have_error = 0;
    last_error[0] = '\0';
}

void nf4_set_quiet(int q)
{
    quiet = q;
}

int nf4_is_quiet(void)
{
    return quiet;
}

void nf4_warn(const char *fmt, ...)
{
    if (quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    fputs("nf4deq: warning: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}
