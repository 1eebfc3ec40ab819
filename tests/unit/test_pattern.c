/* src/pattern.c: Python re.match, answered by a Thompson NFA. The expected
 * answers below are what CPython 3.11's re gives (tests/python/check_patterns.py
 * asks Python itself, about these kinds of cases and 20,000 random ones). */
#include "pattern.h"
#include "test_util.h"

struct question {
    const char *pattern, *name;
    int match;
};

static int answer(const char *pattern, const char *name)
{
    struct pattern *p;
    const char *why;
    int code = pattern_compile(pattern, &p, &why);
    if (code != PATTERN_OK)
        fail_msg("%s: refused (%s)", pattern, code == PATTERN_NOMEM ? "out of memory" : why);
    int m = pattern_match(p, name);
    pattern_free(p);
    return m;
}

/* The reason a pattern is refused; the test fails if it compiles. */
static const char *refusal(const char *pattern)
{
    struct pattern *p = (struct pattern *)1;
    const char *why = NULL;
    int code = pattern_compile(pattern, &p, &why);
    if (code != PATTERN_INVALID)
        fail_msg("%s: code %d, expected a refusal", pattern, code);
    assert_null(p);
    assert_non_null(why);
    return why;
}

static void test_answers_as_python(void **state)
{
    (void)state;
    static const struct question Q[] = {
        /* re.match: anchored at the start only. */
        {"q_proj", "q_proj.lora_A", 1},
        {"q_proj", "model.q_proj", 0},
        {"(.*\\.)?(q_proj)$", "model.layers.0.self_attn.q_proj", 1},
        {"(.*\\.)?(q_proj)$", "model.layers.0.self_attn.xq_proj", 0},
        {"(.*\\.)?(proj)$", "model.q_proj", 0},
        /* '.' is anything but a newline; '$' also matches before a final newline, \Z does not. */
        {"a.b", "a\nb", 0},
        {"a.b", "a\xc3\xa9" "b", 1},
        {"a$", "a\n", 1},
        {"a\\Z", "a\n", 0},
        {"a$", "a\n\n", 0},
        {"^a", "a", 1},
        {"b^", "b", 0},
        {"\\Aa", "a", 1},
        /* Sets: ']' first is a literal; a '-' next to ']' is one; ranges; negation; escapes. */
        {"[]a]+$", "]a]", 1},
        {"[^]a]", "]", 0},
        {"[^]a]", "b", 1},
        {"[a-]+$", "-a-", 1},
        {"[\\d-]+$", "1-2", 1},
        {"[0-9a-f]+$", "c0ffee", 1},
        {"[0-9a-f]+$", "c0ffeg", 0},
        {"[^a-z]", "\xe2\x82\xac", 1},
        {"[\\]\\\\]+$", "]\\]", 1},
        {"[\\b]", "\b", 1},
        {"[\\1]", "\x01", 1},
        {"[\\D]", "5", 0},
        {"[^\\x00-\\U0010ffff]", "a", 0}, /* a set of nothing */
        {"a[^\\x00-\\U0010ffff]?b", "ab", 1},
        {"[\\s]", "\xe3\x80\x80", 1}, /* U+3000 is white space to Python */
        {"\\S", "\xc2\xa0", 0},       /* and so is U+00A0 */
        /* Escapes. */
        {"\\x41\\u0042\\U00000043", "ABC", 1},
        {"\\101", "A", 1},
        {"\\01\\012", "\x01\n", 1},
        {"\\.", "x", 0},
        {"\\d+\\.\\w+$", "12.q_proj", 1},
        {"x.\\bq", "x.q", 1},
        {"\\bq", "x.q", 0},
        {"x\\Bq", "xq", 1},
        {"\\b", "", 0},
        {"\\B", "", 0},
        /* Repeats: counted, lazy, a literal brace where Python reads one. */
        {"a{3}$", "aaa", 1},
        {"a{3}$", "aaaa", 0},
        {"a{2,}$", "aaaaa", 1},
        {"a{,2}$", "aaa", 0},
        {"a{,}$", "aaaa", 1},
        {"a{}", "a{}", 1},
        {"a{x}", "a{x}", 1},
        {"x{", "x{", 1},
        {"a{1,3}?b", "aab", 1},
        {"a*?$", "aaa", 1},
        {"(?:ab)+$", "ababab", 1},
        {"(?:ab)+$", "ababa", 0},
        {"(?:)*a", "a", 1},
        {"(^)*a", "a", 1},
        {"()", "", 1},
        {"|", "x", 1},
        {"a||b", "b", 1},
        /* Alternation, in groups and at the top. */
        {"(?:q|k|v)_proj$", "v_proj", 1},
        {"model\\.layers\\.(1[0-9]|2[0-3])\\..*", "model.layers.23.mlp", 1},
        {"model\\.layers\\.(1[0-9]|2[0-3])\\..*", "model.layers.24.mlp", 0},
        /* PEFT's text substitution makes a key with unbalanced parentheses valid. */
        {"(.*\\.)?(a)|(b)$", "b", 1},
        {"(.*\\.)?(a)|(b)$", "x.b", 0},
        /* Exponential for a backtracking matcher, linear here. */
        {"(a|aa)*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaac", 0},
        {"(a*)*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab", 1},
        {"((.*)*){1,250}", "model.layers.0.mlp", 1},
        {"(.*){1,333}x$", "model.layers.0.mlp", 0},
    };
    for (size_t i = 0; i < sizeof Q / sizeof Q[0]; i++) {
        int m = answer(Q[i].pattern, Q[i].name);
        if (m != Q[i].match)
            fail_msg("re.match(%s, %s): %d, Python says %d", Q[i].pattern, Q[i].name, m, Q[i].match);
    }
}

static void test_refusals_name_the_reason(void **state)
{
    (void)state;
    static const struct {
        const char *pattern, *why;
    } R[] = {
        /* What Python refuses. */
        {"(", "a ( group is not closed"},
        {"a)", "it has a ) that closes no group"},
        {"[a", "a [ set is not closed"},
        {"\\", "it ends in a backslash"},
        {"*a", "a repeat has nothing to repeat"},
        {"{3}", "a repeat has nothing to repeat"},
        {"^*", "a repeat has nothing to repeat"},
        {"a**", "it has a repeat of a repeat"},
        {"a{2}{3}", "it has a repeat of a repeat"},
        {"a*??", "it has a repeat of a repeat"},
        {"a{3,2}", "a {m,n} repeat has m greater than n"},
        {"a{4294967295}", "a repeat count is too large"},
        {"a{99999999999999999999}", "a repeat count is too large"},
        {"[z-a]", "a set has a range that runs backwards"},
        {"[\\d-z]", "a set has a range that starts at \\d, \\w or \\s"},
        {"[a-\\w]", "a set has a range that ends at \\d, \\w or \\s"},
        {"\\q", "it has an escape Python does not know (a backslash before a letter)"},
        {"[\\A]", "it has an escape Python does not know in a set"},
        {"[\\8]", "it has an escape Python does not know in a set"},
        {"\\x4", "a \\x, \\u or \\U escape lacks its hex digits or is past U+10FFFF"},
        {"\\U00110000", "a \\x, \\u or \\U escape lacks its hex digits or is past U+10FFFF"},
        {"\\400", "an octal escape is past \\377"},
        /* What an automaton cannot do, or nf4deq does not read. */
        {"(a)\\1", "back-references are not supported"},
        {"(?!vision).*", "look-ahead and look-behind are not supported"},
        {"(?<=a)b", "look-ahead and look-behind are not supported"},
        {"(?P<n>a)", "named groups are not supported"},
        {"(?i)a", "(?...) extensions other than (?:...) are not supported"},
        {"(?>a)", "(?...) extensions other than (?:...) are not supported"},
        {"a*+", "possessive repeats are not supported"},
        {"\\N{DIGIT ONE}", "\\N{...} escapes are not supported"},
        /* Sizes: 64,000 states, nesting past 100. */
        {"((x{40}){40}){40}", "its repeats expand past 2048 states"},
        {"a{2049}", "its repeats expand past 2048 states"},
    };
    for (size_t i = 0; i < sizeof R / sizeof R[0]; i++) {
        const char *why = refusal(R[i].pattern);
        if (strcmp(why, R[i].why) != 0)
            fail_msg("%s: \"%s\", expected \"%s\"", R[i].pattern, why, R[i].why);
    }
    char deep[2 * 101 + 1];
    memset(deep, '(', 101);
    memset(deep + 101, ')', 101);
    deep[202] = '\0';
    assert_string_equal(refusal(deep), "its groups nest more than 100 deep");
    deep[100] = '\0'; /* 50 deep */
    memset(deep + 50, ')', 50);
    assert_int_equal(answer(deep, "x"), 1);
}

/* The budget is exact: a{2048} is 2048 states and compiles, a{2048}$ does not. */
static void test_budget_edge(void **state)
{
    (void)state;
    char name[2050];
    memset(name, 'a', 2048);
    name[2048] = '\0';
    assert_int_equal(answer("a{2048}", name), 1);
    name[2047] = '\0';
    assert_int_equal(answer("a{2048}", name), 0);
    assert_int_equal(answer("a{2047}$", name), 1);
    /* {0,n}: a SPLIT and the body per optional copy. */
    assert_int_equal(answer("a{0,1024}", "aaa"), 1);
    assert_int_equal(answer("a{0,1023}$", "aaa"), 1);
    assert_string_equal(refusal("a{0,1025}"), "its repeats expand past 2048 states");
    assert_string_equal(refusal("a{2048}$"), "its repeats expand past 2048 states");
    /* A repeat of nothing costs nothing, however large its count. */
    assert_int_equal(answer("(?:){4294967294}a", "a"), 1);
    struct pattern *p;
    const char *why;
    assert_int_equal(pattern_compile("a{5}", &p, &why), PATTERN_OK);
    assert_int_equal(pattern_states(p), 6); /* and the final match */
    pattern_free(p);
}

/* The source is capped at 4096 bytes, before parsing: the parse takes memory
 * per byte, and a repeat's copies walk its body again. */
static void test_length_cap(void **state)
{
    (void)state;
    char src[4098];
    for (size_t k = 0; k < 4096; k += 4)
        memcpy(src + k, "(?:)", 4);
    src[4096] = '\0';
    assert_int_equal(answer(src, "x"), 1);
    src[4096] = 'a';
    src[4097] = '\0';
    assert_string_equal(refusal(src), "it is longer than 4096 bytes");
    /* Empty groups inside a repeated body: emitted once per copy, not walked per copy. */
    char big[4096];
    size_t n = 0;
    n += (size_t)sprintf(big + n, "(?:");
    while (n < 4000)
        n += (size_t)sprintf(big + n, "()");
    sprintf(big + n, "a){2040}$");
    char name[2041];
    memset(name, 'a', 2040);
    name[2040] = '\0';
    assert_int_equal(answer(big, name), 1);
    name[2039] = '\0';
    assert_int_equal(answer(big, name), 0);
}

/* A long name, and one pattern reused for many names (the marks must reset). */
static void test_long_names_and_reuse(void **state)
{
    (void)state;
    size_t n = 1u << 20;
    char *name = malloc(n + 2);
    assert_non_null(name);
    memset(name, 'a', n);
    name[n] = 'b';
    name[n + 1] = '\0';
    struct pattern *p;
    const char *why;
    assert_int_equal(pattern_compile("(a|aa)*b$", &p, &why), PATTERN_OK);
    assert_int_equal(pattern_match(p, name), 1);
    name[n] = 'c';
    assert_int_equal(pattern_match(p, name), 0);
    for (int k = 0; k < 1000; k++) {
        assert_int_equal(pattern_match(p, "aab"), 1);
        assert_int_equal(pattern_match(p, "aac"), 0);
    }
    pattern_free(p);
    free(name);
}

/* Invalid UTF-8 in a name or a pattern reads as Python's surrogateescape does:
 * each bad byte one code point of its own. */
static void test_invalid_utf8(void **state)
{
    (void)state;
    assert_int_equal(answer("a.b$", "a\xff" "b"), 1);
    assert_int_equal(answer("a..b$", "a\xc3" "b"), 0);
    assert_int_equal(answer("a.b$", "a\xe2\x82" "b"), 0); /* truncated: two code points */
    assert_int_equal(answer("a\xff" "b", "a\xff" "b"), 1);
    assert_int_equal(answer("[^a]$", "\xed\xa0\x80"), 0); /* a UTF-8 surrogate: three bytes */
}

/* A plain PEFT key (pattern_compile_peft_key: name characters and dots,
 * maybe after '^'), matched without a program, answers as the program of
 * "(.*\.)?(KEY)$" does: random keys against random names of dots, line
 * breaks, a two-byte and a broken UTF-8 character, half of them ending in the
 * key (and some then in a line break). */
static void test_plain_peft_keys_as_their_program(void **state)
{
    (void)state;
    static const char *const PIECES[] = {"a", "b", ".", "_", "1", "-", "\n", "\xc3\xa9", "\xa9", "x.y"};
    uint64_t seed = 88172645463325252ull;
    size_t matches = 0;
    for (int t = 0; t < 100000; t++) {
        char key[64] = "", name[128] = "";
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t r = seed >> 16;
        if (r % 3 == 0)
            strcat(key, "^");
        for (unsigned i = 0, n = (unsigned)(r >> 4) % 6; i < n; i++)
            strcat(key, PIECES[(r >> (8 + 3 * i)) % 6]); /* plain characters only */
        for (unsigned i = 0, n = (unsigned)(r >> 28) % 10; i < n; i++)
            strcat(name, PIECES[(r >> (32 + 3 * i)) % 10 % 10]);
        if ((r >> 60) & 1) {
            strcat(name, key + (key[0] == '^'));
            if ((r >> 61) & 1)
                strcat(name, "\n");
        }
        struct pattern *fast, *program;
        const char *why;
        assert_int_equal(pattern_compile_peft_key(key, &fast, &why), PATTERN_OK);
        assert_int_equal(pattern_compile_in("(.*\\.)?(%s)$", key, &program, &why), PATTERN_OK);
        const int want = pattern_match(program, name);
        if (pattern_match(fast, name) != want)
            fail_msg("key \"%s\", name \"%s\": the program says %d", key, name, want);
        matches += (size_t)want;
        assert_int_equal(pattern_states(fast), 1);
        pattern_free(fast);
        pattern_free(program);
    }
    assert_true(matches > 1000); /* the cases reach both answers */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_answers_as_python),
        cmocka_unit_test(test_refusals_name_the_reason),
        cmocka_unit_test(test_budget_edge),
        cmocka_unit_test(test_length_cap),
        cmocka_unit_test(test_long_names_and_reuse),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_plain_peft_keys_as_their_program),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
