/* The Hugging Face cache's small parsers on arbitrary bytes: a refs/ file
 * (hf_ref_parse), and the model id and --revision checks that decide which
 * paths under the cache nf4deq opens. A ref that parses must be exactly 40
 * lower-case hex digits and white space; an accepted id or revision must not
 * be able to leave its directory. */
#include "fuzz_common.h"
#include "hf_cache.h"

static int is_lower_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

static void check_ref(const char *text, size_t size)
{
    nf4_clear_error();
    char commit[HF_COMMIT_HEX + 1];
    int code = hf_ref_parse("fuzz/refs/main", text, size, commit);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        return;
    }
    FUZZ_ASSERT(strlen(commit) == HF_COMMIT_HEX && memcmp(commit, text, HF_COMMIT_HEX) == 0, "commit %s", commit);
    for (size_t i = 0; i < HF_COMMIT_HEX; i++)
        FUZZ_ASSERT(is_lower_hex(commit[i]), "commit %s", commit);
    for (size_t i = HF_COMMIT_HEX; i < size; i++)
        FUZZ_ASSERT(strchr(" \t\r\n", text[i]) && text[i], "byte %zu of an accepted ref", i);
}

static void check_names(const char *s)
{
    if (hf_repo_id_is_valid(s)) {
        const char *slash = strchr(s, '/');
        FUZZ_ASSERT(slash && !strchr(slash + 1, '/') && !strstr(s, "..") && !strstr(s, "--") && s[0] != '.' &&
                        slash[1] != '.' && strlen(s) <= HF_REPO_ID_MAX,
                    "accepted model id '%s'", s);
        for (const char *p = s; *p; p++)
            FUZZ_ASSERT(*p == '/' || *p == '-' || *p == '_' || *p == '.' || (*p >= '0' && *p <= '9') ||
                            (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z'),
                        "accepted model id '%s'", s);
    }
    if (hf_revision_is_valid(s)) {
        FUZZ_ASSERT(s[0] && s[0] != '/' && strcmp(s, "..") != 0 && strncmp(s, "../", 3) != 0 && !strstr(s, "/../") &&
                        !strstr(s, "//"),
                    "accepted revision '%s'", s);
        size_t n = strlen(s);
        FUZZ_ASSERT(!(n >= 3 && strcmp(s + n - 3, "/..") == 0), "accepted revision '%s'", s);
        for (const unsigned char *p = (const unsigned char *)s; *p; p++)
            FUZZ_ASSERT(*p >= 0x20 && *p != 0x7f, "accepted revision with byte 0x%02x", *p);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = fuzz_copy(data, size); /* exactly size bytes: ASan sees any overread */
    char *name = fuzz_copy_string(data, size); /* the names are C strings */
    if (text && name) {
        check_ref(text, size);
        check_names(name);
    }
    free(text);
    free(name);
    return 0;
}
