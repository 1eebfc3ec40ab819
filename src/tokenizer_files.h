/* Which tokenizer a converted model directory gets. By default IN's own files
 * are copied with the rest. A QLoRA trainer (PEFT with TRL, Unsloth, axolotl)
 * saves the tokenizer it trained with beside the adapter, added tokens and
 * chat template included, and vLLM's LoRA serving loads it from there; so with
 * --lora the output takes the last adapter folder's tokenizer, when one holds
 * one. --tokenizer DIR names the folder, and --tokenizer base keeps IN's.
 * A tokenizer is taken whole: none of IN's tokenizer files is kept beside
 * another folder's, which would mix two vocabularies. */
#ifndef NF4DEQ_TOKENIZER_FILES_H
#define NF4DEQ_TOKENIZER_FILES_H

#include <stddef.h>
#include <stdint.h>

#define TOKENIZER_CONFIG_NAME "tokenizer_config.json"
#define ADDED_TOKENS_NAME "added_tokens.json"

/* --tokenizer's word for IN's own tokenizer (a folder named so: ./base). */
#define TOKENIZER_OF_BASE "base"

enum tokenizer_origin {
    TOKENIZER_IN,      /* IN's own files, copied with the rest */
    TOKENIZER_ADAPTER, /* an --lora folder's, found there */
    TOKENIZER_GIVEN,   /* --tokenizer DIR */
};

struct tokenizer_source {
    enum tokenizer_origin origin;
    const char *dir; /* the folder it comes from; NULL for TOKENIZER_IN */
};

/* Whether `name` is one of the files transformers saves a tokenizer as. */
int tokenizer_file_name(const char *name);
/* Whether `name` is the folder a tokenizer keeps its other chat templates in
 * (additional_chat_templates/NAME.jinja, as recent transformers save them). */
int tokenizer_dir_name(const char *name);

/* Where the output's tokenizer comes from: `option` is --tokenizer's value or
 * NULL; `adapters` the --lora folders in order; `in` the model directory.
 * A folder given that does not exist or holds no tokenizer, and a set from
 * another folder that cannot be copied whole (an entry not a regular file,
 * unreadable, or a link out of its folder), fail with NF4_ENOINPUT before
 * anything is written. Returns an NF4_* code. */
int tokenizer_choose(const char *option, const char *in, const char *const *adapters, size_t nadapters,
                     struct tokenizer_source *out);

/* The tokenizer's files (and folder) in `dir`, sorted; free with dir_names_free. */
int tokenizer_list(const char *dir, char ***names, size_t *n);

/* "tokenizer.json, tokenizer_config.json" into buf (cut short to fit). */
void tokenizer_names_text(char *const *names, size_t n, char *buf, size_t cap);

/* The highest token id the tokenizer in `dir` gives an added token
 * (tokenizer_config.json's added_tokens_decoder, or added_tokens.json), that
 * token's text cut to fit `cap`, and the name of the file that says so: 1,
 * or 0 where they name none or cannot be read (no verdict then). */
int tokenizer_highest_added_id(const char *dir, uint64_t *id, char *token, size_t cap, const char **file);

/* Copies the tokenizer files (and folder) of `dir` into the output directory `to_dir`. */
int tokenizer_copy(const char *dir, const char *to_dir);

#endif
