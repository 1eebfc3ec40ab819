/* What convert tells its caller when it ends: the one-line human summary on
 * stderr, and with --json one JSON object on stdout (the schema is in the
 * README and the man page). */
#ifndef NF4DEQ_REPORT_H
#define NF4DEQ_REPORT_H

#include <stdio.h>

#include "convert.h"

struct convert_report {
    const char *input;      /* IN as given */
    const char *input_path; /* what it resolved to (a cache snapshot, /dev/stdin) */
    const char *revision;   /* --revision, or NULL */
    const char *output;     /* OUT as given ("-": standard output) */
    int code;               /* the exit status */
    const struct convert_stats *stats;
    int nlora;
};

void report_summary(FILE *err, const struct convert_report *r);
/* Prints the success or failure object. NF4_OK, or NF4_ESOFTWARE when out of
 * memory (nothing printed). */
int report_json(FILE *out, const struct convert_report *r);

#endif
