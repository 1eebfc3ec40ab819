#include "control_index.h"

#include <cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "json_text.h"
#include "json_util.h"
#include "status.h"
#include "strbuf.h"

#define CLASS_KEY "_class_name"

static const struct {
    const char *plain, *control;
} CONTROL_CLASSES[] = {
    {"FluxPipeline", "FluxControlPipeline"},
    {"FluxImg2ImgPipeline", "FluxControlImg2ImgPipeline"},
    {"FluxInpaintPipeline", "FluxControlInpaintPipeline"},
};

/* FluxPipeline's optional components, which the control classes lack: left
 * out of their index, as their save_pretrained leaves them (a folder one
 * names is still copied, and unused). */
static const char *const DROPPED[] = {"image_encoder", "feature_extractor"};

const char *flux_control_class(const char *cls)
{
    for (size_t i = 0; cls && i < sizeof CONTROL_CLASSES / sizeof CONTROL_CLASSES[0]; i++)
        if (strcmp(cls, CONTROL_CLASSES[i].plain) == 0 || strcmp(cls, CONTROL_CLASSES[i].control) == 0)
            return CONTROL_CLASSES[i].control;
    return NULL;
}

static int dropped(const char *json, const struct json_member *m)
{
    for (size_t i = 0; i < sizeof DROPPED / sizeof DROPPED[0]; i++)
        if (json_member_key_is(json, m, DROPPED[i]))
            return 1;
    return 0;
}

/* The members of the object opening at json[open], each written as it was
 * but for the class's value and the dropped ones; a kept member is preceded
 * by the separator that preceded it in the file, so the layout stays. */
static int put_rewritten(struct strbuf *b, const char *json, size_t len, const char *to)
{
    size_t open = json_text_skip_ws(json, 0, len), count;
    struct json_member *mem = json_scan_members(json, open, len, &count);
    if (!mem)
        return -1;
    strbuf_put(b, json, count ? mem[0].key_start : len);
    int kept = 0;
    for (size_t k = 0; k < count; k++) {
        const struct json_member *m = &mem[k];
        if (dropped(json, m))
            continue;
        if (kept++)
            strbuf_put(b, json + mem[k - 1].value_end, m->key_start - mem[k - 1].value_end);
        if (json_member_key_is(json, m, CLASS_KEY)) {
            strbuf_put(b, json + m->key_start, m->value_start - m->key_start);
            strbuf_printf(b, "\"%s\"", to);
        } else {
            strbuf_put(b, json + m->key_start, m->value_end - m->key_start);
        }
    }
    if (count)
        strbuf_put(b, json + mem[count - 1].value_end, len - mem[count - 1].value_end);
    free(mem);
    return 0;
}

int control_index_rewrite(const char *path, const char *json, size_t len, char **from, const char **to, char **out,
                          size_t *out_len)
{
    *from = NULL;
    *to = NULL;
    *out = NULL;
    *out_len = 0;
    cJSON *root = json_parse_whole(json, len);
    if (!root && json_ran_out_of_memory())
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory parsing it");
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return nf4_fail(NF4_EDATA, path, NULL, "not a JSON object");
    }
    const char *dup = NULL;
    const int twice = json_first_duplicate_key(root, &dup);
    if (twice != 0) {
        int code = twice < 0 ? nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory")
                             : nf4_fail(NF4_EDATA, path, NULL, "has \"%s\" twice, which diffusers reads as the last "
                                        "and nf4deq would not", dup);
        cJSON_Delete(root);
        return code;
    }
    const cJSON *cls = cJSON_GetObjectItemCaseSensitive(root, CLASS_KEY);
    int code = NF4_OK;
    if (cJSON_IsString(cls) && !(*from = strdup(cls->valuestring)))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    *to = flux_control_class(*from);
    if (code == NF4_OK && *to && strcmp(*from, *to) != 0) {
        struct strbuf b = {0};
        if (put_rewritten(&b, json, len, *to) != 0 || b.oom || !b.p) {
            free(b.p);
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        } else {
            *out = b.p;
            *out_len = b.len;
        }
    }
    cJSON_Delete(root);
    return code;
}
