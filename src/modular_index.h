/* What a pipeline's index (model_index.json or modular_model_index.json,
 * layout.h) says about its components: which it loads, and, in a modular
 * one, where from. Each from_pretrained component is
 * [library, class, {"pretrained_model_name_or_path": REPO, "subfolder": S,
 * ...}]; diffusers 0.42's ModularPipeline.from_pretrained of a folder loads
 * a component from the folder where the folder holds S, else from REPO. So a
 * converted pipeline still takes the components its input did not hold from
 * their repositories, quantized or not: nf4deq says so. */
#ifndef NF4DEQ_MODULAR_INDEX_H
#define NF4DEQ_MODULAR_INDEX_H

#include <stddef.h>

/* Whether pipeline folder `root`'s index (model_index.json, or the modular
 * one) lists each of the n components `names` as one the pipeline loads
 * ([library, class, ...], not [null, null]), wherever from: listed[i] 1 or
 * 0, and 0 returned; -1 (listed untouched) where there is no index nf4deq
 * can read. */
int pipeline_index_lists(const char *root, const char *const *names, size_t n, int *listed);

/* Where pipeline folder `root`'s index is a modular one: warns, naming it,
 * of the components it takes from a repository whose subfolder `root` does
 * not hold. An index that cannot be read or parsed says nothing here (it is
 * copied as it is). */
void modular_index_warn_remote(const char *root);

#endif
