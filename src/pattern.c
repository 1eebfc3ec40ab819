/* Python `re` patterns as a Thompson NFA: parse to a tree, size the program
 * the tree expands to, emit it, then simulate it over the name one code point
 * at a time. See pattern.h for what is read and why. */
#include "pattern.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "strutil.h"

#define CP_MAX 0x10FFFFu
#define CP_END UINT32_MAX      /* past the last code point of the name */
#define NODE_NONE UINT32_MAX
#define REPEAT_INF UINT32_MAX  /* "*", "+" and "{m,}" */
/* Python refuses repeat counts from 2**32 - 1 ("the repetition number is too large"). */
#define PY_MAXREPEAT UINT64_C(4294967295)

/* ---- code points ---- */

/* The code point at s[*i], advancing *i. A byte that does not start a valid
 * UTF-8 sequence becomes U+DC80..U+DCFF, as Python's surrogateescape reads it. */
static uint32_t utf8_next(const unsigned char *s, size_t len, size_t *i)
{
    static const unsigned char LEAD_BITS[5] = {0, 0x7F, 0x1F, 0x0F, 0x07};
    size_t n = utf8_sequence(s + *i, len - *i);
    if (n == 0)
        return 0xDC00u + s[(*i)++];
    uint32_t cp = s[*i] & LEAD_BITS[n];
    for (size_t k = 1; k < n; k++)
        cp = (cp << 6) | (s[*i + k] & 0x3F);
    *i += n;
    return cp;
}

struct range {
    uint32_t lo, hi;
};

/* Python's \s in a str pattern (_PyUnicode_IsWhitespace). */
static const struct range SPACE_RANGES[] = {{0x09, 0x0D}, {0x1C, 0x20}, {0x85, 0x85}, {0xA0, 0xA0},
                                            {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029},
                                            {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}};
static const struct range DIGIT_RANGES[] = {{'0', '9'}};
static const struct range WORD_RANGES[] = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};

static int is_word(uint32_t cp)
{
    return (cp >= '0' && cp <= '9') || (cp >= 'A' && cp <= 'Z') || cp == '_' || (cp >= 'a' && cp <= 'z');
}

/* ---- the tree ---- */

enum node_kind { N_SET, N_BOL, N_EOL, N_EOS, N_WORDB, N_NWORDB, N_CAT, N_ALT, N_REPEAT };

struct node {
    uint8_t kind;
    uint32_t child; /* N_CAT, N_ALT: first of the list; N_REPEAT: what repeats */
    uint32_t next;  /* the next sibling in a list */
    uint32_t set;   /* N_SET */
    uint32_t min, max;
    uint64_t size;  /* states it expands to, once node_size has run; 0 before */
    int sized;
};

/* A set of code points: ranges[first .. first+n), sorted, disjoint, not adjacent. */
struct cset {
    uint32_t first, n;
};

struct parser {
    const uint32_t *cp;
    size_t n, i;
    struct node *nodes;
    size_t nnodes, capnodes;
    struct range *ranges;
    size_t nranges, capranges;
    struct cset *sets;
    size_t nsets, capsets;
    const char *why;
    int nomem;
};

/* Records the first failure; every parse function returns NODE_NONE after one. */
static uint32_t fail(struct parser *p, const char *why)
{
    if (!p->why && !p->nomem)
        p->why = why;
    return NODE_NONE;
}

static uint32_t out_of_memory(struct parser *p)
{
    p->nomem = 1;
    return NODE_NONE;
}

static uint32_t new_node(struct parser *p, enum node_kind kind)
{
    if (!grow_array((void **)&p->nodes, &p->capnodes, p->nnodes + 1, sizeof *p->nodes))
        return out_of_memory(p);
    p->nodes[p->nnodes] = (struct node){.kind = (uint8_t)kind, .child = NODE_NONE, .next = NODE_NONE};
    return (uint32_t)p->nnodes++;
}

static int add_range(struct parser *p, uint32_t lo, uint32_t hi)
{
    if (!grow_array((void **)&p->ranges, &p->capranges, p->nranges + 1, sizeof *p->ranges)) {
        p->nomem = 1;
        return 0;
    }
    p->ranges[p->nranges++] = (struct range){lo, hi};
    return 1;
}

static int range_cmp(const void *a, const void *b)
{
    const struct range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorts ranges[first..] and merges what overlaps or touches. */
static void normalize(struct parser *p, size_t first)
{
    size_t n = p->nranges - first;
    if (n < 2)
        return;
    struct range *r = p->ranges + first;
    qsort(r, n, sizeof *r, range_cmp);
    size_t out = 0;
    for (size_t k = 1; k < n; k++) {
        if (r[k].lo <= r[out].hi || r[k].lo - 1 == r[out].hi) {
            if (r[k].hi > r[out].hi)
                r[out].hi = r[k].hi;
        } else {
            r[++out] = r[k];
        }
    }
    p->nranges = first + out + 1;
}

/* Replaces the normalized ranges[first..] by their complement in 0..CP_MAX. */
static int complement(struct parser *p, size_t first)
{
    size_t n = p->nranges - first;
    struct range *old = malloc((n ? n : 1) * sizeof *old);
    if (!old) {
        p->nomem = 1;
        return 0;
    }
    if (n)
        memcpy(old, p->ranges + first, n * sizeof *old);
    p->nranges = first;
    uint32_t lo = 0;
    int ok = 1, open = 1;
    for (size_t k = 0; k < n && ok; k++) {
        if (old[k].lo > lo)
            ok = add_range(p, lo, old[k].lo - 1);
        if (old[k].hi == CP_MAX)
            open = 0;
        else
            lo = old[k].hi + 1;
    }
    if (ok && open)
        ok = add_range(p, lo, CP_MAX);
    free(old);
    return ok;
}

static int add_ranges(struct parser *p, const struct range *r, size_t n, int negate)
{
    size_t first = p->nranges;
    for (size_t k = 0; k < n; k++)
        if (!add_range(p, r[k].lo, r[k].hi))
            return 0;
    normalize(p, first);
    return !negate || complement(p, first);
}

static int is_class_escape(uint32_t c)
{
    return c == 'd' || c == 'D' || c == 'w' || c == 'W' || c == 's' || c == 'S';
}

/* Adds the ranges of \d \D \w \W \s or \S (`c` is the letter); 0 if memory ran out. */
static int add_class_escape(struct parser *p, uint32_t c)
{
    int negate = c == 'D' || c == 'W' || c == 'S';
    if (c == 'd' || c == 'D')
        return add_ranges(p, DIGIT_RANGES, sizeof DIGIT_RANGES / sizeof *DIGIT_RANGES, negate);
    if (c == 'w' || c == 'W')
        return add_ranges(p, WORD_RANGES, sizeof WORD_RANGES / sizeof *WORD_RANGES, negate);
    return add_ranges(p, SPACE_RANGES, sizeof SPACE_RANGES / sizeof *SPACE_RANGES, negate);
}

/* A set node over the ranges added since `first`. */
static uint32_t set_node(struct parser *p, size_t first, int negate)
{
    normalize(p, first);
    if (negate && !complement(p, first))
        return out_of_memory(p);
    if (!grow_array((void **)&p->sets, &p->capsets, p->nsets + 1, sizeof *p->sets))
        return out_of_memory(p);
    p->sets[p->nsets] = (struct cset){(uint32_t)first, (uint32_t)(p->nranges - first)};
    uint32_t k = new_node(p, N_SET);
    if (k != NODE_NONE)
        p->nodes[k].set = (uint32_t)p->nsets++;
    return k;
}

static uint32_t literal(struct parser *p, uint32_t c)
{
    size_t first = p->nranges;
    return add_range(p, c, c) ? set_node(p, first, 0) : out_of_memory(p);
}

static int at(const struct parser *p, uint32_t c)
{
    return p->i < p->n && p->cp[p->i] == c;
}

static int hex_value(uint32_t c)
{
    return c >= '0' && c <= '9' ? (int)(c - '0') : c >= 'a' && c <= 'f' ? (int)(c - 'a' + 10)
           : c >= 'A' && c <= 'F' ? (int)(c - 'A' + 10) : -1;
}

static int is_octal(uint32_t c)
{
    return c >= '0' && c <= '7';
}

/* \xhh, \uhhhh, \Uhhhhhhhh after the letter; CP_END if malformed. */
static uint32_t hex_escape(struct parser *p, size_t digits)
{
    uint32_t v = 0;
    for (size_t k = 0; k < digits; k++) {
        int h = p->i < p->n ? hex_value(p->cp[p->i]) : -1;
        if (h < 0)
            return CP_END;
        v = v * 16 + (uint32_t)h;
        p->i++;
    }
    return v <= CP_MAX ? v : CP_END;
}

/* The code point an escape stands for, after the backslash and `c`, for the
 * escapes a set and the pattern share; CP_END with p->why set if none. Octal
 * differs: in a set any octal digit starts one; outside, \0 or three digits
 * do, and \1 to \99 otherwise refer back to a group. */
static uint32_t char_escape(struct parser *p, uint32_t c, int in_set)
{
    switch (c) {
    case 'a': return 7;
    case 'f': return 12;
    case 'n': return 10;
    case 'r': return 13;
    case 't': return 9;
    case 'v': return 11;
    case 'x': case 'u': case 'U': {
        uint32_t v = hex_escape(p, c == 'x' ? 2 : c == 'u' ? 4 : 8);
        if (v == CP_END)
            fail(p, "a \\x, \\u or \\U escape lacks its hex digits or is past U+10FFFF");
        return v;
    }
    case 'N':
        fail(p, "\\N{...} escapes are not supported");
        return CP_END;
    default: break;
    }
    if (c == '0' || (is_octal(c) && (in_set || (p->i + 1 < p->n && is_octal(p->cp[p->i]) &&
                                                 is_octal(p->cp[p->i + 1]))))) {
        uint32_t v = c - '0';
        for (size_t k = 0; k < 2 && p->i < p->n && is_octal(p->cp[p->i]); k++)
            v = v * 8 + (p->cp[p->i++] - '0');
        if (v > 0377) {
            fail(p, "an octal escape is past \\377");
            return CP_END;
        }
        return v;
    }
    if (c >= '1' && c <= '9') {
        fail(p, in_set ? "it has an escape Python does not know in a set" : "back-references are not supported");
        return CP_END;
    }
    if (c < 0x80 && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) {
        fail(p, in_set ? "it has an escape Python does not know in a set"
                       : "it has an escape Python does not know (a backslash before a letter)");
        return CP_END;
    }
    return c;
}

/* An escape inside a set that is not \d, \w or \s: there \b is a backspace. */
static uint32_t set_escape(struct parser *p, uint32_t c)
{
    return c == 'b' ? 8 : char_escape(p, c, 1);
}

/* One member of a set at p->i: a code point (1, in *cp), or \d \w \s or a
 * negation (2; with `add`, its ranges are added). 0 after a failure. */
static int set_member(struct parser *p, int add, uint32_t *cp)
{
    uint32_t c = p->cp[p->i++];
    if (c != '\\') {
        *cp = c;
        return 1;
    }
    if (p->i >= p->n) {
        fail(p, "it ends in a backslash");
        return 0;
    }
    c = p->cp[p->i++];
    if (is_class_escape(c)) {
        if (add && !add_class_escape(p, c))
            return 0;
        return 2;
    }
    return (*cp = set_escape(p, c)) == CP_END ? 0 : 1;
}

/* [...] from after the '['. */
static uint32_t parse_set(struct parser *p)
{
    int negate = 0;
    if (at(p, '^')) {
        negate = 1;
        p->i++;
    }
    size_t first = p->nranges, start = p->i;
    for (;;) {
        if (p->i >= p->n)
            return fail(p, "a [ set is not closed");
        if (at(p, ']') && p->i != start) { /* a ']' first is a member */
            p->i++;
            break;
        }
        uint32_t lo, hi;
        int kind = set_member(p, 1, &lo);
        if (!kind)
            return NODE_NONE;
        /* '-' makes a range unless it comes last. */
        int range = at(p, '-') && p->i + 1 < p->n && p->cp[p->i + 1] != ']';
        if (kind == 2) {
            if (range)
                return fail(p, "a set has a range that starts at \\d, \\w or \\s");
            continue;
        }
        hi = lo;
        if (range) {
            p->i++;
            if (!(kind = set_member(p, 0, &hi)))
                return NODE_NONE;
            if (kind == 2)
                return fail(p, "a set has a range that ends at \\d, \\w or \\s");
            if (hi < lo)
                return fail(p, "a set has a range that runs backwards");
        }
        if (!add_range(p, lo, hi))
            return out_of_memory(p);
    }
    return set_node(p, first, negate);
}

/* "{m}", "{m,}", "{,n}", "{m,n}" at p->i: 1 with the bounds (p->i moves past
 * it only if `consume`), 0 if the brace is a literal as Python reads it, -1 if
 * the count is one Python refuses. */
static int counted_repeat(struct parser *p, int consume, uint32_t *min, uint32_t *max)
{
    size_t j = p->i + 1;
    if (!at(p, '{') || (j < p->n && p->cp[j] == '}'))
        return 0;
    uint64_t lo = 0, hi = 0;
    size_t lo_digits = 0, hi_digits = 0;
    for (; j < p->n && p->cp[j] >= '0' && p->cp[j] <= '9'; j++, lo_digits++)
        lo = lo > PY_MAXREPEAT ? lo : lo * 10 + (p->cp[j] - '0');
    if (j < p->n && p->cp[j] == ',') {
        for (j++; j < p->n && p->cp[j] >= '0' && p->cp[j] <= '9'; j++, hi_digits++)
            hi = hi > PY_MAXREPEAT ? hi : hi * 10 + (p->cp[j] - '0');
    } else {
        hi = lo;
        hi_digits = lo_digits;
    }
    if (j >= p->n || p->cp[j] != '}')
        return 0;
    if (lo >= PY_MAXREPEAT || hi >= PY_MAXREPEAT) {
        fail(p, "a repeat count is too large");
        return -1;
    }
    if (hi_digits && hi < lo) {
        fail(p, "a {m,n} repeat has m greater than n");
        return -1;
    }
    *min = (uint32_t)lo;
    *max = hi_digits ? (uint32_t)hi : REPEAT_INF;
    if (consume)
        p->i = j + 1;
    return 1;
}

/* 1 if a repeat (*, +, ? or a counted one) starts at p->i, -1 on a refused count. */
static int repeat_ahead(struct parser *p)
{
    uint32_t lo, hi;
    if (at(p, '*') || at(p, '+') || at(p, '?'))
        return 1;
    return counted_repeat(p, 0, &lo, &hi);
}

static uint32_t parse_alt(struct parser *p, unsigned depth);

/* What a backslash outside a set stands for, from after the backslash. */
static uint32_t parse_escape(struct parser *p)
{
    if (p->i >= p->n)
        return fail(p, "it ends in a backslash");
    uint32_t c = p->cp[p->i++];
    size_t first = p->nranges;
    if (is_class_escape(c))
        return add_class_escape(p, c) ? set_node(p, first, 0) : NODE_NONE;
    switch (c) {
    case 'A': return new_node(p, N_BOL);
    case 'Z': return new_node(p, N_EOS);
    case 'b': return new_node(p, N_WORDB);
    case 'B': return new_node(p, N_NWORDB);
    default: break;
    }
    uint32_t v = char_escape(p, c, 0);
    return v == CP_END ? NODE_NONE : literal(p, v);
}

static uint32_t parse_group(struct parser *p, unsigned depth)
{
    if (at(p, '?')) {
        p->i++;
        if (!at(p, ':'))
            return fail(p, at(p, '=') || at(p, '!') || at(p, '<') ? "look-ahead and look-behind are not supported"
                           : at(p, 'P') ? "named groups are not supported"
                           : "(?...) extensions other than (?:...) are not supported");
        p->i++;
    }
    uint32_t inner = parse_alt(p, depth + 1);
    if (inner == NODE_NONE)
        return NODE_NONE;
    if (!at(p, ')'))
        return fail(p, "a ( group is not closed");
    p->i++;
    /* Wrapped, so that a repeat of "(^)" is a repeat of a group, as in Python. */
    uint32_t g = new_node(p, N_CAT);
    if (g != NODE_NONE)
        p->nodes[g].child = inner;
    return g;
}

static uint32_t parse_atom(struct parser *p, unsigned depth)
{
    uint32_t c = p->cp[p->i++], lo, hi;
    switch (c) {
    case '(': return parse_group(p, depth);
    case '[': return parse_set(p);
    case '^': return new_node(p, N_BOL);
    case '$': return new_node(p, N_EOL);
    case '\\': return parse_escape(p);
    case '.': {
        size_t first = p->nranges;
        return add_range(p, '\n', '\n') ? set_node(p, first, 1) : out_of_memory(p);
    }
    case '*': case '+': case '?': return fail(p, "a repeat has nothing to repeat");
    case '{':
        p->i--;
        switch (counted_repeat(p, 0, &lo, &hi)) {
        case 1: return fail(p, "a repeat has nothing to repeat");
        case -1: return NODE_NONE;
        default: p->i++; return literal(p, '{');
        }
    default: return literal(p, c);
    }
}

/* The repeats after an atom: one, then an optional lazy '?'. */
static uint32_t parse_repeat(struct parser *p, uint32_t atom)
{
    int ahead = repeat_ahead(p);
    if (ahead <= 0)
        return ahead < 0 ? NODE_NONE : atom;
    uint8_t kind = p->nodes[atom].kind;
    if (kind == N_BOL || kind == N_EOL || kind == N_EOS || kind == N_WORDB || kind == N_NWORDB)
        return fail(p, "a repeat has nothing to repeat");
    uint32_t min, max, c = p->cp[p->i];
    if (c == '{') {
        counted_repeat(p, 1, &min, &max);
    } else {
        p->i++;
        min = c == '+' ? 1 : 0;
        max = c == '?' ? 1 : REPEAT_INF;
    }
    if (at(p, '?'))
        p->i++; /* lazy: the same matches exist */
    else if (at(p, '+'))
        return fail(p, "possessive repeats are not supported");
    int again = repeat_ahead(p);
    if (again != 0)
        return again > 0 ? fail(p, "it has a repeat of a repeat") : NODE_NONE;
    uint32_t r = new_node(p, N_REPEAT);
    if (r != NODE_NONE) {
        p->nodes[r].child = atom;
        p->nodes[r].min = min;
        p->nodes[r].max = max;
    }
    return r;
}

/* A sequence up to '|', ')' or the end. */
static uint32_t parse_seq(struct parser *p, unsigned depth)
{
    uint32_t seq = new_node(p, N_CAT), last = NODE_NONE;
    while (seq != NODE_NONE && p->i < p->n && !at(p, '|') && !at(p, ')')) {
        uint32_t item = parse_atom(p, depth);
        if (item != NODE_NONE)
            item = parse_repeat(p, item);
        if (item == NODE_NONE)
            return NODE_NONE;
        if (last == NODE_NONE)
            p->nodes[seq].child = item;
        else
            p->nodes[last].next = item;
        last = item;
    }
    return seq;
}

static uint32_t parse_alt(struct parser *p, unsigned depth)
{
    if (depth > PATTERN_MAX_NESTING)
        return fail(p, "its groups nest more than 100 deep");
    uint32_t first = parse_seq(p, depth);
    if (first == NODE_NONE || !at(p, '|'))
        return first;
    uint32_t alt = new_node(p, N_ALT), last = first;
    if (alt == NODE_NONE)
        return NODE_NONE;
    p->nodes[alt].child = first;
    while (at(p, '|')) {
        p->i++;
        uint32_t s = parse_seq(p, depth);
        if (s == NODE_NONE)
            return NODE_NONE;
        p->nodes[last].next = s;
        last = s;
    }
    return alt;
}

/* ---- the program ---- */

enum op { OP_SET, OP_SPLIT, OP_JMP, OP_BOL, OP_EOL, OP_EOS, OP_WORDB, OP_NWORDB, OP_MATCH };

struct inst {
    uint8_t op;
    uint32_t x, y; /* OP_SET: x is the set; OP_SPLIT: both targets; OP_JMP: x */
};

struct pattern {
    /* A PEFT key matched without a program (pattern_compile_peft_key): its
     * text, less a leading '^' (anchored); NULL for a program. */
    char *tail;
    size_t tail_len;
    int anchored;
    struct inst *prog;
    uint32_t nprog;
    struct range *ranges;
    struct cset *sets;
    /* Matching state, sized here so that pattern_match allocates nothing. */
    uint32_t *now, *next, *stack, *mark;
    uint32_t generation;
};

#define SIZE_OVER ((uint64_t)PATTERN_MAX_PROGRAM + 1)

static uint64_t expanded_size(struct parser *p, uint32_t k);

static uint64_t capped(uint64_t v)
{
    return v > SIZE_OVER ? SIZE_OVER : v;
}

/* States node k expands to, capped just past the budget. A repeat emits its
 * body once per copy, so the sizes are kept. */
static uint64_t node_size(struct parser *p, uint32_t k)
{
    struct node *nd = &p->nodes[k];
    if (!nd->sized) {
        nd->size = expanded_size(p, k);
        nd->sized = 1;
    }
    return nd->size;
}

static uint64_t expanded_size(struct parser *p, uint32_t k)
{
    const struct node *nd = &p->nodes[k];
    uint64_t sum = 0, count = 0;
    switch (nd->kind) {
    case N_CAT:
    case N_ALT:
        for (uint32_t c = nd->child; c != NODE_NONE; c = p->nodes[c].next, count++)
            sum = capped(sum + node_size(p, c));
        return nd->kind == N_ALT && count > 1 ? capped(sum + 2 * (count - 1)) : sum;
    case N_REPEAT: {
        uint64_t body = node_size(p, nd->child);
        if (body == 0) /* "(?:)*" and the like: a repeat of nothing is nothing */
            return 0;
        uint64_t fixed = capped(body * nd->min);
        if (nd->max == REPEAT_INF)
            return capped(fixed + (nd->min ? 1 : body + 2));
        return capped(fixed + capped((uint64_t)(nd->max - nd->min) * (body + 1)));
    }
    default: return 1;
    }
}

static void emit(struct pattern *pt, struct parser *p, uint32_t k)
{
    /* Nothing to write ("()", "x{0}"): not walked again for each repeated copy. */
    if (node_size(p, k) == 0)
        return;
    const struct node *nd = &p->nodes[k];
    struct inst *prog = pt->prog;
    switch (nd->kind) {
    case N_SET: prog[pt->nprog++] = (struct inst){OP_SET, nd->set, 0}; return;
    case N_BOL: prog[pt->nprog++] = (struct inst){OP_BOL, 0, 0}; return;
    case N_EOL: prog[pt->nprog++] = (struct inst){OP_EOL, 0, 0}; return;
    case N_EOS: prog[pt->nprog++] = (struct inst){OP_EOS, 0, 0}; return;
    case N_WORDB: prog[pt->nprog++] = (struct inst){OP_WORDB, 0, 0}; return;
    case N_NWORDB: prog[pt->nprog++] = (struct inst){OP_NWORDB, 0, 0}; return;
    case N_CAT:
        for (uint32_t c = nd->child; c != NODE_NONE; c = p->nodes[c].next)
            emit(pt, p, c);
        return;
    case N_ALT: {
        /* SPLIT to each branch but the last; each branch but the last ends in a
         * JMP past the last. The JMPs are chained through x until the end is known. */
        uint32_t jumps = NODE_NONE;
        for (uint32_t c = nd->child; c != NODE_NONE; c = p->nodes[c].next) {
            if (p->nodes[c].next == NODE_NONE) {
                emit(pt, p, c);
                break;
            }
            uint32_t split = pt->nprog++;
            prog[split] = (struct inst){OP_SPLIT, split + 1, 0};
            emit(pt, p, c);
            prog[pt->nprog] = (struct inst){OP_JMP, jumps, 0};
            jumps = pt->nprog++;
            prog[split].y = pt->nprog;
        }
        while (jumps != NODE_NONE) {
            uint32_t up = prog[jumps].x;
            prog[jumps].x = pt->nprog;
            jumps = up;
        }
        return;
    }
    case N_REPEAT: {
        uint32_t body = nd->child;
        if (nd->max == REPEAT_INF) {
            if (nd->min == 0) { /* L: SPLIT body, out; body; JMP L */
                uint32_t loop = pt->nprog++;
                emit(pt, p, body);
                prog[pt->nprog++] = (struct inst){OP_JMP, loop, 0};
                prog[loop] = (struct inst){OP_SPLIT, loop + 1, pt->nprog};
            } else { /* body * (min-1); L: body; SPLIT L, out */
                for (uint32_t r = 1; r < nd->min; r++)
                    emit(pt, p, body);
                uint32_t loop = pt->nprog;
                emit(pt, p, body);
                prog[pt->nprog] = (struct inst){OP_SPLIT, loop, pt->nprog + 1};
                pt->nprog++;
            }
            return;
        }
        for (uint32_t r = 0; r < nd->min; r++)
            emit(pt, p, body);
        /* Each optional copy: SPLIT into it or past all of them (chained through y). */
        uint32_t splits = NODE_NONE;
        for (uint32_t r = nd->min; r < nd->max; r++) {
            uint32_t split = pt->nprog++;
            prog[split] = (struct inst){OP_SPLIT, split + 1, splits};
            splits = split;
            emit(pt, p, body);
        }
        while (splits != NODE_NONE) {
            uint32_t up = prog[splits].y;
            prog[splits].y = pt->nprog;
            splits = up;
        }
        return;
    }
    }
}

void pattern_free(struct pattern *pt)
{
    if (!pt)
        return;
    free(pt->tail);
    free(pt->prog);
    free(pt->ranges);
    free(pt->sets);
    free(pt->now);
    free(pt->next);
    free(pt->stack);
    free(pt->mark);
    free(pt);
}

int pattern_compile(const char *src, struct pattern **out, const char **why)
{
    *out = NULL;
    *why = NULL;
    size_t len = strlen(src), n = 0;
    if (len > PATTERN_MAX_SOURCE) {
        *why = "it is longer than 4096 bytes";
        return PATTERN_INVALID;
    }
    struct parser p = {0};
    uint32_t *cps = malloc((len ? len : 1) * sizeof *cps);
    if (!cps)
        return PATTERN_NOMEM;
    for (size_t i = 0; i < len;)
        cps[n++] = utf8_next((const unsigned char *)src, len, &i);
    p.cp = cps;
    p.n = n;
    uint32_t root = parse_alt(&p, 0);
    if (root != NODE_NONE && p.i < p.n)
        root = fail(&p, "it has a ) that closes no group");
    uint64_t size = root == NODE_NONE ? 0 : node_size(&p, root);
    if (root != NODE_NONE && size > PATTERN_MAX_PROGRAM)
        root = fail(&p, "its repeats expand past 2048 states");
    int code = p.nomem ? PATTERN_NOMEM : root == NODE_NONE ? PATTERN_INVALID : PATTERN_OK;
    struct pattern *pt = NULL;
    if (code == PATTERN_OK) {
        uint32_t states = (uint32_t)size + 1; /* and OP_MATCH */
        pt = calloc(1, sizeof *pt);
        if (pt) {
            pt->prog = malloc(states * sizeof *pt->prog);
            pt->now = malloc(states * sizeof *pt->now);
            pt->next = malloc(states * sizeof *pt->next);
            pt->stack = malloc((2 * (size_t)states + 1) * sizeof *pt->stack);
            pt->mark = calloc(states, sizeof *pt->mark);
            pt->ranges = malloc((p.nranges ? p.nranges : 1) * sizeof *pt->ranges);
            pt->sets = malloc((p.nsets ? p.nsets : 1) * sizeof *pt->sets);
        }
        if (!pt || !pt->prog || !pt->now || !pt->next || !pt->stack || !pt->mark || !pt->ranges || !pt->sets) {
            pattern_free(pt);
            pt = NULL;
            code = PATTERN_NOMEM;
        } else {
            /* "()" has no set, "[^\0-\U0010ffff]" no range; memcpy takes no NULL. */
            if (p.nranges)
                memcpy(pt->ranges, p.ranges, p.nranges * sizeof *pt->ranges);
            if (p.nsets)
                memcpy(pt->sets, p.sets, p.nsets * sizeof *pt->sets);
            emit(pt, &p, root);
            pt->prog[pt->nprog++] = (struct inst){OP_MATCH, 0, 0};
        }
    }
    if (code == PATTERN_INVALID)
        *why = p.why;
    free(cps);
    free(p.nodes);
    free(p.ranges);
    free(p.sets);
    *out = pt;
    return code;
}

int pattern_compile_in(const char *fmt, const char *src, struct pattern **out, const char **why)
{
    *out = NULL;
    *why = NULL;
    size_t n = strlen(fmt) + strlen(src) + 1;
    char *full = malloc(n);
    if (!full)
        return PATTERN_NOMEM;
    snprintf(full, n, fmt, src);
    int code = pattern_compile(full, out, why);
    free(full);
    return code;
}

unsigned pattern_states(const struct pattern *pt)
{
    return pt->nprog;
}

/* Whether a PEFT key is of name characters and dots alone, maybe after a '^'. */
static int is_plain_peft_key(const char *key)
{
    for (const char *p = key + (key[0] == '^'); *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' ||
              *p == '-' || *p == '.'))
            return 0;
    return 1;
}

int pattern_compile_peft_key(const char *key, struct pattern **out, const char **why)
{
    *out = NULL;
    *why = NULL;
    if (strlen(key) > PATTERN_MAX_SOURCE || !is_plain_peft_key(key))
        return pattern_compile_in("(.*\\.)?(%s)$", key, out, why);
    struct pattern *pt = calloc(1, sizeof *pt);
    if (!pt || !(pt->tail = strdup(key + (key[0] == '^')))) {
        free(pt);
        return PATTERN_NOMEM;
    }
    pt->anchored = key[0] == '^';
    pt->tail_len = strlen(pt->tail);
    pt->nprog = 1;
    *out = pt;
    return PATTERN_OK;
}

/* The bytes of the code point at s[0..left): a UTF-8 sequence, or one byte
 * of none (as utf8_next reads it). */
static size_t code_point_bytes(const unsigned char *s, size_t left)
{
    size_t n = utf8_sequence(s, left);
    return n ? n : 1;
}

/* The plain key against name[0..end) as "(.*[.])?(KEY)$" reads it: its last
 * code points, each '.' any but a line break, and before them nothing, or
 * (not anchored) a '.' after a run without a line break. */
static int tail_matches(const struct pattern *pt, const unsigned char *s, size_t end)
{
    size_t count = 0, start = 0;
    for (size_t i = 0; i < end; i += code_point_bytes(s + i, end - i))
        count++;
    if (count < pt->tail_len)
        return 0;
    for (size_t k = 0; k < count - pt->tail_len; k++)
        start += code_point_bytes(s + start, end - start);
    for (size_t k = 0, i = start; k < pt->tail_len; k++) {
        const size_t n = code_point_bytes(s + i, end - i);
        const char kc = pt->tail[k];
        if (kc == '.' ? n == 1 && s[i] == '\n' : n != 1 || s[i] != (unsigned char)kc)
            return 0;
        i += n;
    }
    if (start == 0)
        return 1;
    if (pt->anchored || s[start - 1] != '.')
        return 0;
    return memchr(s, '\n', start - 1) == NULL;
}

/* ---- matching ---- */

static int set_has(const struct pattern *pt, uint32_t set, uint32_t cp)
{
    const struct range *r = pt->ranges + pt->sets[set].first;
    size_t lo = 0, hi = pt->sets[set].n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (cp < r[mid].lo)
            hi = mid;
        else if (cp > r[mid].hi)
            lo = mid + 1;
        else
            return 1;
    }
    return 0;
}

/* Where the simulation stands between two code points of the name. */
struct position {
    uint32_t before, here; /* CP_END before the first and after the last */
    int start, last_is_newline_here;
};

static int assertion_holds(enum op op, const struct position *at)
{
    switch (op) {
    case OP_BOL: return at->start;
    case OP_EOS: return at->here == CP_END;
    case OP_EOL: return at->here == CP_END || at->last_is_newline_here;
    case OP_WORDB:
    case OP_NWORDB: {
        /* As Python's SRE_AT_BOUNDARY: neither holds in an empty name. */
        if (at->start && at->here == CP_END)
            return 0;
        int before = at->before != CP_END && is_word(at->before), here = at->here != CP_END && is_word(at->here);
        return op == OP_WORDB ? before != here : before == here;
    }
    default: return 0;
    }
}

/* Adds pc and what it reaches without consuming to `list`: the states that
 * wait for a code point. 1 if OP_MATCH is reached. */
static int follow(struct pattern *pt, uint32_t pc, uint32_t *list, uint32_t *nlist, const struct position *at)
{
    uint32_t top = 0;
    int matched = 0;
    pt->stack[top++] = pc;
    while (top) {
        pc = pt->stack[--top];
        if (pt->mark[pc] == pt->generation)
            continue;
        pt->mark[pc] = pt->generation;
        const struct inst *in = &pt->prog[pc];
        switch ((enum op)in->op) {
        case OP_SET: list[(*nlist)++] = pc; break;
        case OP_MATCH: matched = 1; break;
        case OP_JMP: pt->stack[top++] = in->x; break;
        case OP_SPLIT:
            pt->stack[top++] = in->y;
            pt->stack[top++] = in->x;
            break;
        default:
            if (assertion_holds((enum op)in->op, at))
                pt->stack[top++] = pc + 1;
            break;
        }
    }
    return matched;
}

static void next_generation(struct pattern *pt)
{
    if (++pt->generation == 0) {
        memset(pt->mark, 0, pt->nprog * sizeof *pt->mark);
        pt->generation = 1;
    }
}

int pattern_match(struct pattern *pt, const char *name)
{
    const unsigned char *s = (const unsigned char *)name;
    size_t len = strlen(name), off = 0;
    if (pt->tail) /* '$' matches at the end, and before a line break that ends the name */
        return tail_matches(pt, s, len) || (len && s[len - 1] == '\n' && tail_matches(pt, s, len - 1));
    struct position at = {.before = CP_END, .start = 1};
    at.here = len ? utf8_next(s, len, &off) : CP_END;
    at.last_is_newline_here = at.here == '\n' && off == len;
    uint32_t nnow = 0, nnext;
    next_generation(pt);
    int matched = follow(pt, 0, pt->now, &nnow, &at);
    while (!matched && nnow && at.here != CP_END) {
        uint32_t cp = at.here;
        at.before = cp;
        at.start = 0;
        at.here = off < len ? utf8_next(s, len, &off) : CP_END;
        at.last_is_newline_here = at.here == '\n' && off == len;
        next_generation(pt);
        nnext = 0;
        for (uint32_t k = 0; k < nnow && !matched; k++)
            if (set_has(pt, pt->prog[pt->now[k]].x, cp))
                matched = follow(pt, pt->now[k] + 1, pt->next, &nnext, &at);
        uint32_t *t = pt->now;
        pt->now = pt->next;
        pt->next = t;
        nnow = nnext;
    }
    return matched;
}
