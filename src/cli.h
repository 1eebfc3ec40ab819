/* Command-line front end: parses arguments, runs a subcommand, prints errors. */
#ifndef NF4DEQ_CLI_H
#define NF4DEQ_CLI_H

#include <getopt.h>
#include <stdint.h>

/* The exit codes, as every command's --help ends. */
#define EXIT_CODES_HELP                                                                                        \
    "Exit status:\n"                                                                                           \
    "   0  success\n"                                                                                          \
    "   2  bad command line (unknown option, wrong arguments, OUT is IN, - where\n"                            \
    "      it cannot work, a --mem too small for one tensor), an NF4DEQ_CPU that\n"                             \
    "      names no CPU kernel, or an on/off NF4DEQ_ setting (convert --help)\n"                                 \
    "      that is neither 0 nor 1\n"                                                                            \
    "  65  the input is not a valid safetensors / bitsandbytes 4-bit checkpoint\n"                             \
    "  66  the input (an adapter, a --tokenizer folder) is missing or unreadable\n"                             \
    "  69  a GPU was asked for (--device cuda) but none is usable, or NF4DEQ_CPU\n"                             \
    "      names a CPU kernel this processor or build lacks\n"                                                    \
    "  70  internal error (including out of memory)\n"                                                         \
    "  73  the output cannot be created (exists without --force, is a link or a\n"                            \
    "      device, another nf4deq is writing it, permissions), or the temp file\n"                              \
    "      a LoRA in another form than diffusers' is converted into (TMPDIR)\n"                                \
    "  74  read or write failed (I/O error, disk full, closed standard output,\n"                              \
    "      an input that changed while it was read)\n"

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
