/* lora_config_parse on arbitrary bytes (an adapter_config.json). When it
 * accepts, what the merge will use must be sane: a rank from 1 to 65536, a
 * finite alpha, and patterns and modules_to_save of the documented types; a
 * refusal must be bad data with a one-line message. */
#include <math.h>

#include "fuzz_common.h"
#include "lora.h"
#include "lora_experts.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *json = fuzz_copy(data, size);
    if (!json)
        return 0;
    nf4_clear_error();
    struct lora_config c;
    int code = lora_config_parse("fuzz/adapter_config.json", json, size, &c);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
    } else {
        FUZZ_ASSERT(c.r >= 1 && c.r <= 65536, "r = %u", c.r);
        FUZZ_ASSERT(isfinite(c.alpha), "alpha = %g", c.alpha);
        FUZZ_ASSERT(!c.rank_pattern || cJSON_IsObject(c.rank_pattern), "rank_pattern is not an object");
        FUZZ_ASSERT(!c.alpha_pattern || cJSON_IsObject(c.alpha_pattern), "alpha_pattern is not an object");
        FUZZ_ASSERT(!c.modules_to_save || cJSON_IsArray(c.modules_to_save), "modules_to_save is not a list");
        /* target_parameters: a non-empty list of strings (what PEFT's ParamWrapper refuses beside it is
         * refused where a pair binds to a parameter, not here). */
        if (c.target_parameters) {
            FUZZ_ASSERT(cJSON_IsArray(c.target_parameters) && c.target_parameters->child,
                        "target_parameters is not a non-empty list");
            const cJSON *p;
            cJSON_ArrayForEach(p, c.target_parameters)
                FUZZ_ASSERT(cJSON_IsString(p), "target_parameters holds a non-string");
            const char *params[EXPERTS_NPARAMS];
            FUZZ_ASSERT(experts_targeted(c.target_parameters, "model.layers.0.mlp.experts", params) <= EXPERTS_NPARAMS,
                        "more parameters than an experts module has");
        }
        /* Every pattern must work as a matcher on any module name. */
        const cJSON *e;
        cJSON_ArrayForEach(e, c.rank_pattern)
            FUZZ_ASSERT(lora_pattern_matches(e->string, "model.layers.0.self_attn.q_proj") >= 0, "pattern %s",
                        e->string);
    }
    lora_config_free(&c);
    free(json);
    return 0;
}
