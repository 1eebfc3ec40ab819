/* Command-line front end: parses arguments, runs a subcommand, prints errors. */
#ifndef NF4DEQ_CLI_H
#define NF4DEQ_CLI_H

#include <stdint.h>

/* Returns the process exit status (an NF4_* code). */
int cli_main(int argc, char **argv);

/* Parses "512M", "12G", "1048576": binary units K, M, G, T (an optional "iB"
 * or "B" after them). Returns 0 on a malformed or overflowing size. */
int parse_size(const char *text, uint64_t *out);

#endif
