/* pattern_compile and pattern_match on arbitrary bytes: the input up to its
 * first NUL is the pattern, the rest a module name. Compiling must end in a
 * program or a one-line reason, and matching must answer 0 or 1, within the
 * state budget whatever the pattern (libFuzzer's -timeout and -rss_limit_mb
 * catch a blow-up; regcomp(3) blew up here, see pattern.h). */
#include "fuzz_common.h"
#include "pattern.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = fuzz_copy_string(data, size);
    if (!text)
        return 0;
    size_t plen = strlen(text);
    const char *name = plen < size ? text + plen + 1 : "model.layers.0.self_attn.q_proj";
    struct pattern *p;
    const char *why;
    int code = pattern_compile(text, &p, &why);
    FUZZ_ASSERT(code == PATTERN_OK || code == PATTERN_INVALID || code == PATTERN_NOMEM, "code %d", code);
    if (code == PATTERN_INVALID) {
        FUZZ_ASSERT(p == NULL && why && *why && !strchr(why, '\n'), "refusal without a one-line reason");
    } else if (code == PATTERN_OK) {
        int m = pattern_match(p, name);
        FUZZ_ASSERT(m == 0 || m == 1, "match %d", m);
        FUZZ_ASSERT(pattern_match(p, name) == m, "a second match of the same name differs");
        m = pattern_match(p, "");
        FUZZ_ASSERT(m == 0 || m == 1, "match %d on an empty name", m);
    }
    pattern_free(p);
    free(text);
    return 0;
}
