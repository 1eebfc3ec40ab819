/* Python `re` matching for the regular expressions PEFT writes into adapter
 * configs (rank_pattern and alpha_pattern keys), in time linear in the name
 * and in memory fixed before matching starts.
 *
 * Why not regcomp(3): an adapter config is untrusted input, and glibc expands
 * counted repeats and builds DFA states that grow with the square of the
 * pattern: "(.*){1,333}x" takes 3 s and 200 MB to compile and match, and
 * "((.*)*){1,250}" runs for minutes. This module parses the pattern as Python
 * 3 reads it and runs a Thompson NFA over the name: no backtracking, each
 * character of the name advances a set of at most PATTERN_MAX_PROGRAM states.
 *
 * Read as Python reads them: literals, '.', [...] sets with ranges and '^',
 * \d \w \s and \D \W \S, escapes of punctuation, \a \f \n \r \t \v \xhh
 * \uhhhh \Uhhhhhhhh and octal \0oo, groups (...) and (?:...), '|',
 * * + ? {m} {m,} {,n} {m,n} and their lazy forms, ^ $ \A \Z \b \B.
 * \d and \w (so \b) take their ASCII meaning: module names are ASCII.
 * Refused with a reason: what Python itself refuses, and what an automaton
 * cannot match (back-references, look-around, inline flags, possessive and
 * atomic repeats), named groups and \N{...}. */
#ifndef NF4DEQ_PATTERN_H
#define NF4DEQ_PATTERN_H

/* The program a pattern may compile to once counted repeats are expanded:
 * "a{5}" costs 5 states. Adapter configs use tens. At 2048, with every state
 * live at once ("(.?){1000}$"), a 200-character name takes about 3 ms on the
 * 2-core development machine; each state costs about 32 bytes. */
#define PATTERN_MAX_PROGRAM 2048u
/* Groups nested deeper than this are refused: the parser recurses per group. */
#define PATTERN_MAX_NESTING 100u
/* Longer patterns are refused before parsing: the parse takes about 70 bytes of
 * memory per byte of pattern, and emitting walks the tree once per repeated
 * copy. Adapter config keys are tens of bytes. */
#define PATTERN_MAX_SOURCE 4096u

enum { PATTERN_OK = 0, PATTERN_INVALID = -1, PATTERN_NOMEM = -2 };

struct pattern;

/* Compiles `src` (UTF-8, NUL-terminated). Returns PATTERN_OK with *out set,
 * PATTERN_INVALID with *why set to a static one-line reason, or PATTERN_NOMEM. */
int pattern_compile(const char *src, struct pattern **out, const char **why);
/* pattern_compile of `fmt` with `src` put in its one "%s": how a caller asks
 * its own question of a config's pattern ("(.*\.)?(%s)$", "(?:%s)\Z"). */
int pattern_compile_in(const char *fmt, const char *src, struct pattern **out, const char **why);

/* pattern_compile_in("(.*\\.)?(%s)$", key): what PEFT matches a rank_pattern
 * or alpha_pattern key against a module's name with. A key of ASCII letters,
 * digits, '_', '-' and '.' alone, maybe after a '^' (a module's own name, as
 * diffusers writes thousands of them for a LoRA of many ranks), is matched
 * directly, in time linear in the name, and counts one state. */
int pattern_compile_peft_key(const char *key, struct pattern **out, const char **why);

/* 1 if Python's re.match(src, name) finds a match (anchored at the start, not
 * at the end), else 0. Allocates nothing; one pattern serves one thread. */
int pattern_match(struct pattern *p, const char *name);

/* The states the program holds: what it costs in memory (about 32 bytes a
 * state) and in time per character matched. */
unsigned pattern_states(const struct pattern *p);

void pattern_free(struct pattern *p);

#endif
