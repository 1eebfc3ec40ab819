/* Command-line front end: parses arguments, runs a subcommand, prints errors. */
#ifndef NF4DEQ_CLI_H
#define NF4DEQ_CLI_H

#include <getopt.h>
#include <stdint.h>

/* Returns the process exit status (an NF4_* code). */
int cli_main(int argc, char **argv);

/* Parses "512M", "12G", "1048576": binary units K, M, G, T (an optional "iB"
 * or "B" after them). Returns 0 on a malformed or overflowing size. */
int parse_size(const char *text, uint64_t *out);

/* getopt_long for a subcommand, remembering where each option came from so that
 * cli_option_error can name it: "-z" inside "-qz", "--bogus", "--force=1".
 * The option strings start with ':' and opterr is 0: getopt prints nothing. */
struct cli_opt_scan {
    const struct option *longopts;
    int before; /* optind before the call */
};
int cli_getopt(struct cli_opt_scan *scan, int argc, char **argv, const char *optstring,
               const struct option *longopts);
/* Prints the bad option and the "Try" line; returns NF4_EUSAGE. */
int cli_option_error(const char *cmd, char **argv, const struct cli_opt_scan *scan, int c);

#endif
