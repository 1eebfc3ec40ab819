/* Progress reporting for long conversions: one updating line on a terminal,
 * periodic plain lines for logs, or nothing. */
#ifndef NF4DEQ_PROGRESS_H
#define NF4DEQ_PROGRESS_H

#include <pthread.h>
#include <stdint.h>

enum progress_mode { PROGRESS_AUTO, PROGRESS_TTY, PROGRESS_PLAIN, PROGRESS_NONE };

struct progress {
    enum progress_mode mode; /* resolved: never AUTO once started */
    pthread_mutex_t mu;
    uint64_t tensors_done, tensors_total;
    uint64_t bytes_done, bytes_total;
    double started, last_print;
    int printed_tty; /* a TTY line is on screen and needs clearing */
};

/* Parses "auto", "tty", "plain", "none"; -1 if unknown. */
int progress_mode_from_name(const char *name);
void progress_start(struct progress *p, enum progress_mode mode, uint64_t tensors_total, uint64_t bytes_total);
/* Thread-safe; prints at most every so often. */
void progress_add(struct progress *p, uint64_t bytes, uint64_t tensors);
/* Clears the TTY line. */
void progress_finish(struct progress *p);
double progress_now(void);

#endif
