/* Exit codes and error reporting shared by every module.
 *
 * Functions return one of these codes; the first failure formats a one-line
 * message into a per-thread buffer, and the CLI prints it as "nf4deq: MSG".
 * Nothing below the CLI exits the process, so the same code can serve a library. */
#ifndef NF4DEQ_STATUS_H
#define NF4DEQ_STATUS_H

#include <stddef.h>

enum nf4_status {
    NF4_OK = 0,
    NF4_EUSAGE = 2,        /* bad command line */
    NF4_EDATA = 65,        /* input is not a valid bnb-4bit / safetensors file */
    NF4_ENOINPUT = 66,     /* input missing or unreadable */
    NF4_EUNAVAILABLE = 69, /* GPU asked for but unavailable */
    NF4_ESOFTWARE = 70,    /* internal error (a bug, or out of memory) */
    NF4_ECANTCREAT = 73,   /* cannot create the output */
    NF4_EIO = 74,          /* read or write failed */
};

#if defined(__GNUC__)
#define NF4_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define NF4_PRINTF(a, b)
#endif

/* Records "FILE: TENSOR: message" (FILE and TENSOR may be NULL) and returns code.
 * Only the first error since the last nf4_clear_error() is kept: the root cause
 * matters more than what failed because of it. */
int nf4_fail(int code, const char *file, const char *tensor, const char *fmt, ...) NF4_PRINTF(4, 5);
/* Like nf4_fail, with ": strerror(errnum)" appended. */
int nf4_fail_errno(int code, int errnum, const char *file, const char *tensor, const char *fmt, ...)
    NF4_PRINTF(5, 6);
/* From now on, an error naming `dir` or a path inside it names `shown` (or
 * the same path inside it) instead; NULL for both ends it. A directory
 * conversion writes into a temp directory that becomes OUT once complete, and
 * the user, who knows only OUT, needs to read which of OUT's files failed. */
void nf4_show_dir_as(const char *dir, const char *shown);
/* From now on, an error naming a tensor of `file` names it as
 * origin_of(owner, tensor) gives its name in the user's file, where that is
 * another (a converted LoRA's key, safetensors.h's st_tensor.origin): "KEY
 * (converted to NAME)". `file` must live until nf4_origins_unregister(owner).
 * Out of memory, messages keep the names as they are. */
void nf4_origins_register(const void *owner, const char *file,
                          const char *(*origin_of)(const void *owner, const char *tensor));
void nf4_origins_unregister(const void *owner);
/* Tensor `tensor` of `file` as errors name it (above), for a warning's text:
 * buf, or `tensor` itself where it has no other name. */
const char *nf4_tensor_shown(const char *file, const char *tensor, char *buf, size_t size);
#define NF4_TENSOR_SHOWN_MAX 2048
const char *nf4_last_error(void);
void nf4_clear_error(void);

/* The first error with its parts, for machine-readable reports (convert
 * --json), and to carry it from a worker thread to the one that reports. */
#define NF4_ERROR_MAX 8192 /* room for two paths of PATH_MAX */
struct nf4_error {
    char text[NF4_ERROR_MAX]; /* what nf4_last_error returns */
    char file[4096];          /* "" when none was named */
    char tensor[1024];
};
/* NULL when no error was recorded on this thread. */
const struct nf4_error *nf4_last_error_record(void);
void nf4_error_save(struct nf4_error *e);
/* Records e as this thread's error (unless it has one already); returns code. */
int nf4_error_restore(int code, const struct nf4_error *e);

/* Warnings go straight to stderr unless silenced by --quiet; while capture is
 * on they are also kept (the first NF4_MAX_CAPTURED_WARNINGS) for --json. */
void nf4_warn(const char *fmt, ...) NF4_PRINTF(1, 2);
/* A notice ("nf4deq: MSG"), not a problem: what nf4deq did on its own
 * (removed a dead run's partial output, resumed one). Silenced and kept as
 * warnings are. */
void nf4_note(const char *fmt, ...) NF4_PRINTF(1, 2);
/* The length of the control character at s (below 0x20, DEL, or a C1 control
 * in UTF-8: 2 bytes), else 0: messages and inspect's table print one as '?'
 * so that no name from a file reaches the terminal as a control. */
size_t nf4_control_len(const char *s);
#define NF4_MAX_CAPTURED_WARNINGS 1000
void nf4_warn_capture(int on);
/* The kept warnings, one line each, without the "nf4deq: warning: " prefix. */
const char *const *nf4_warnings(size_t *n);
void nf4_set_quiet(int quiet);
int nf4_is_quiet(void);

#endif
