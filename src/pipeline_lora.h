/* Diffusers LoRAs on a whole diffusers pipeline (`convert PIPE OUT --lora L`,
 * `inspect PIPE --lora L`): which component takes which LoRA. Each LoRA's
 * keys say their component ("transformer.", "text_encoder."); a component
 * takes the LoRAs with keys under its name, where diffusers' loader for the
 * pipeline's class loads LoRAs into it (diffusers_loads). lora.c then binds
 * them per component (lora_open_component). */
#ifndef NF4DEQ_PIPELINE_LORA_H
#define NF4DEQ_PIPELINE_LORA_H

#include <stddef.h>

#include "layout.h"
#include "model.h"

struct pipeline_loras {
    const char *const *args; /* --lora as given, n of them */
    const char **paths;      /* each one's LoRA: its argument, less "COMPONENT=" */
    char **into;             /* the COMPONENT it names, or NULL: the components its keys name */
    struct model **weights;  /* each one's weights, opened to read its keys */
    size_t n;
    char *cls; /* the pipeline index's _class_name (diffusers_pipeline_class), or NULL */
    /* MiniMax-H3's two partitions (`partitions` set for its pipelines):
     * transformer_ref takes the keys under transformer_ref., and the
     * transformer's where the pipeline loads no transformer (a ref2va one)
     * or --lora transformer_ref=LORA says so (load_into_transformer_ref).
     * What diffusers loads is what the pipeline's index lists (else, with no
     * index to read, what the folder holds); what nf4deq merges into, the
     * components of those the folder holds. */
    struct {
        int partitions;
        int loads_transformer, loads_ref; /* listed in the index */
        int holds_transformer, holds_ref; /* listed, and in the folder */
    } h3;
};

/* --lora COMPONENT=LORA on a pipeline: the LoRA's transformer keys go into
 * COMPONENT instead, as diffusers' load_lora_weights(...,
 * load_into_transformer_2=True) loads them into Wan 2.2's transformer_2
 * (and load_into_transformer_ref=True into MiniMax-H3's transformer_ref).
 * An argument that names an existing path is that path; otherwise a leading
 * name of letters, digits and '_' before '=' is the component. Returns the
 * LoRA's part of `arg`, and the component's length in *component_len (0:
 * none). */
const char *pipeline_lora_arg(const char *arg, size_t *component_len);

/* NF4_EUSAGE, naming `in`, where some --lora names a component and a LoRA
 * that is there: IN is not a pipeline. */
int pipeline_lora_refuse_components(const char *in, const char *const *args, size_t n);

/* Whether each --lora can go on the pipeline `in`, before anything is read
 * or written: NF4_EUSAGE for a PEFT adapter (which merges into one model),
 * NF4_ENOINPUT for what is missing or neither kind. */
int pipeline_loras_check(const char *in, const char *const *args, size_t n);

/* Opens each LoRA's weights and checks that its keys are for components of
 * this pipeline (`e`, ne entries of pipeline_list) that diffusers loads LoRAs
 * into: a warning for keys of others, NF4_EDATA where none is; a LoRA given
 * as COMPONENT=LORA needs transformer keys, and NF4_EUSAGE where the
 * pipeline has no such component or diffusers' loader for its class cannot
 * load into it. n = 0 opens nothing. Close with pipeline_loras_close, even on
 * failure. */
int pipeline_loras_open(const char *in, const char *const *args, size_t n, const struct pipeline_entry *e,
                        size_t ne, struct pipeline_loras *pl);

/* The LoRAs one component of a pipeline takes (lora_open_component): their
 * --lora arguments, and for each the LoRA pipeline_loras_open made by
 * converting it (a kohya or Qwen-Image LoRA, opened again with model_reopen
 * rather than converted again) or NULL (opened again from its file). */
struct component_loras {
    const char *component;
    const char **dirs;
    const char **key_components; /* whose keys each one merges: component, or the transformer's */
    struct model **converted;
    size_t n;
};

/* Room in cl for every LoRA of pl. NF4_OK or NF4_ESOFTWARE (naming `in`). */
int component_loras_init(struct component_loras *cl, const struct pipeline_loras *pl, const char *in);
void component_loras_free(struct component_loras *cl);

/* The LoRAs `component` takes, into cl (component_loras_init): cl->n of them. */
void pipeline_loras_for(const struct pipeline_loras *pl, const char *component, struct component_loras *cl);

void pipeline_loras_close(struct pipeline_loras *pl);

#endif
