/* Which modules an adapter config targets, as PEFT decides it
 * (check_target_module_exists): target_modules, exclude_modules,
 * layers_to_transform and layers_pattern. PEFT wraps only the modules these
 * select, and the adapter weights of any other module are unexpected keys it
 * does not load; a merge that matches PEFT's leaves them out too. */
#ifndef NF4DEQ_LORA_TARGET_H
#define NF4DEQ_LORA_TARGET_H

#include <cJSON.h>
#include <stddef.h>

struct pattern;

/* layers_pattern lists at most this many patterns (PEFT's defaults are five);
 * each compiles to at most PATTERN_MAX_PROGRAM states. */
#define LORA_TARGET_MAX_PATTERNS 64u

struct lora_target_rules {
    const cJSON *targets;  /* a list of names, or NULL: every module (absent, null, or "all-linear") */
    const cJSON *excludes; /* a list of names, or NULL */
    struct pattern *target_re, *exclude_re; /* the string forms, as re.fullmatch */
    const cJSON *layers;   /* layers_to_transform: an int, a list of ints, or NULL */
    /* layers_pattern, each as "(?:.*\.)?(?:P)\Z" over the name up to the '.'
     * before the layer index; none: any segment before the index.
     * NULL-terminated. */
    struct pattern **layer_res;
    int unselective; /* a pattern nf4deq cannot run: every module is taken, with a warning */
};

/* Reads the rules from an adapter config's root object (`path` names it in
 * messages). NF4_EDATA for keys of the wrong type; a pattern nf4deq cannot
 * run sets `unselective`, with a warning. Free with lora_target_free, even on
 * failure. */
int lora_target_parse(const char *path, const cJSON *root, struct lora_target_rules *r);
void lora_target_free(struct lora_target_rules *r);

/* 1 if `module` is one of the strings of the list `names`, or ends in "." and
 * one of them: how PEFT matches target_modules and exclude_modules lists
 * (modules_to_save goes by str.endswith alone: lora.c). */
int lora_name_listed(const cJSON *names, const char *module);

/* 1 if PEFT would put a LoRA layer on `module` ("model.layers.0.mlp.down_proj"). */
int lora_target_matches(const struct lora_target_rules *r, const char *module);

#endif
