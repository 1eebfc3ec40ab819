#include "progress.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "status.h"

/* A terminal line may change often; a log line should not flood the log. */
#define TTY_INTERVAL_S 0.2
#define PLAIN_INTERVAL_S 10.0

double progress_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int progress_mode_from_name(const char *name)
{
    static const char *const NAMES[] = {"auto", "tty", "plain", "none"};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, NAMES[i]) == 0)
            return i;
    return -1;
}

void progress_start(struct progress *p, enum progress_mode mode, uint64_t tensors_total, uint64_t bytes_total)
{
    memset(p, 0, sizeof *p);
    pthread_mutex_init(&p->mu, NULL);
    if (mode == PROGRESS_AUTO)
        mode = isatty(STDERR_FILENO) ? PROGRESS_TTY : PROGRESS_NONE;
    if (nf4_is_quiet())
        mode = PROGRESS_NONE;
    p->mode = mode;
    p->tensors_total = tensors_total;
    p->bytes_total = bytes_total;
    p->started = p->last_print = progress_now();
}

static void print_line(struct progress *p, double now)
{
    double elapsed = now - p->started;
    double rate = elapsed > 0 ? (double)p->bytes_done / elapsed : 0;
    double left = rate > 0 ? (double)(p->bytes_total - p->bytes_done) / rate : 0;
    char line[160];
    snprintf(line, sizeof line,
             "nf4deq: %llu/%llu tensors, %.2f/%.2f GB written, %.2f GB/s, ETA %02d:%02d",
             (unsigned long long)p->tensors_done, (unsigned long long)p->tensors_total, (double)p->bytes_done / 1e9,
             (double)p->bytes_total / 1e9, rate / 1e9, (int)(left / 60), (int)left % 60);
    if (p->mode == PROGRESS_TTY) {
        fprintf(stderr, "\r%s\033[K", line);
        p->printed_tty = 1;
    } else {
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
}

void progress_add(struct progress *p, uint64_t bytes, uint64_t tensors)
{
    pthread_mutex_lock(&p->mu);
    p->bytes_done += bytes;
    p->tensors_done += tensors;
    if (p->mode == PROGRESS_TTY || p->mode == PROGRESS_PLAIN) {
        double now = progress_now();
        if (now - p->last_print >= (p->mode == PROGRESS_TTY ? TTY_INTERVAL_S : PLAIN_INTERVAL_S)) {
            p->last_print = now;
            print_line(p, now);
        }
    }
    pthread_mutex_unlock(&p->mu);
}

void progress_finish(struct progress *p)
{
    pthread_mutex_lock(&p->mu);
    if (p->printed_tty) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_destroy(&p->mu);
}
