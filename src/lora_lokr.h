/* LoKr adapters: PEFT's LoKr layer (LyCORIS' Kronecker product adapter),
 * as diffusers loads them into Flux.2's and Z-Image's transformers
 * (load_lora_adapter with a LoKrConfig), and as a PEFT adapter folder
 * holds one (peft_type "LOKR"). A module's keys are
 *   <module>.lokr_w1    [a, b]      or  <module>.lokr_w1_a [a, r], <module>.lokr_w1_b [r, b]
 *   <module>.lokr_w2    [c, d]      or  <module>.lokr_w2_a [c, r], <module>.lokr_w2_b [r, d]
 * and its delta is (alpha / r) * kron(W1, W2), [a * c, b * d], W1 and W2
 * each the factor or the product of its two halves (PEFT's
 * get_delta_weight and make_kron). lora_merge.h states the arithmetic.
 *
 * PEFT builds the layer's factors from its own reading of the config: it
 * factors the layer's dimensions (factorization(), decompose_factor) and
 * splits W1 only with decompose_both, and each factor only where r is less
 * than half its larger side. A file whose factors are not those does not
 * load as saved (a shape PEFT refuses, or factors PEFT leaves at their
 * initial values with a warning): nf4deq refuses it, naming what PEFT
 * would build. Refused too: LoKr on a convolution (lokr_t2, or factors of
 * more than two dimensions), and factors of other than F32, BF16 or F16.
 *
 * Without a config (a diffusers file without metadata) diffusers builds one
 * from the factors' shapes (_create_lokr_config): each module's rank (its
 * split W2's, else its split W1's, else W2's larger side) with alpha equal
 * to it (scaling 1: a converter bakes any alpha into W1 first,
 * lora_lokr_forms.h), decompose_both where any W1 is split, and the
 * decompose_factor that gives every module's factors, refused where none
 * does. lokr_inferred_config builds the same.
 *
 * Where Flux.2's BFL form trains one LoKr on a fused qkv (to_qkv,
 * to_added_qkv), diffusers fuses the transformer's projections to load it;
 * nf4deq splits the fused delta by rows into the separate projections the
 * checkpoint holds (lora.c): what the fused model computes with. */
#ifndef NF4DEQ_LORA_LOKR_H
#define NF4DEQ_LORA_LOKR_H

#include <stddef.h>
#include <stdint.h>

#include "lora.h"
#include "model.h"

#define LOKR_MARK ".lokr_" /* in every LoKr key: how diffusers tells a LoKr file */
#define LOKR_DEFAULT_R 8      /* LoKrConfig's r and alpha where a config leaves them out */
#define LOKR_DEFAULT_ALPHA 8.0

/* The length of the LoKr factor suffix `name` ends in (".lokr_w1",
 * ".lokr_w2_b", ".lokr_t2", ...), or 0. */
size_t lokr_suffix_len(const char *name);

/* Whether `name` ends in the suffix of a module's first factor, lokr_w1 or
 * lokr_w1_a: the key a module is bound by. */
int lokr_is_first_factor(const char *name);

/* PEFT's factorization(dimension, factor): two numbers whose product is
 * `dim`, the first `factor` where it divides dim, else near the square root
 * (factor -1) or below `factor`, smaller first. dim > 0. */
void lokr_factorization(uint64_t dim, int64_t factor, uint64_t *m, uint64_t *n);

/* Reads module `module`'s factors (keys key_prefix + module + suffix in w,
 * `file` naming them) as PEFT's LoKr layer on a linear layer [out, in]
 * with rank r under config c would load them, into *k (row0 0). NF4_EDATA,
 * naming the file and key, where it would not (see above); NF4_ESOFTWARE. */
int lokr_read_factors(const struct model *w, const char *file, const char *key_prefix, const char *module,
                      const struct lora_config *c, uint32_t r, uint64_t out, uint64_t in, struct lora_kron *k);

/* Whether any key of w under `prefix` is a LoKr's (LOKR_MARK in it). */
int lokr_any_key(const struct model *w, const char *prefix);

/* The LoKrConfig diffusers' _create_lokr_config builds for w's LoKr keys
 * under `prefix` (see above), as JSON text an adapter config holds
 * (allocated, *json). NF4_EDATA naming the key or file where diffusers
 * raises (a module without lokr_w1 or lokr_w1_a, factors that are not
 * matrices, no decompose_factor that gives every module's); NF4_ESOFTWARE. */
int lokr_inferred_config(const struct model *w, const char *path, const char *prefix, char **json);

/* Whether `key` is a field of PEFT 0.21's LoKrConfig, which diffusers builds
 * with a LoKr file's metadata entries as keyword arguments (an unknown one
 * raises). */
int lokr_config_field(const char *key);

#endif
