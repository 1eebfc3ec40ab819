/* What a modular pipeline's index (modular_model_index.json, layout.h) says
 * about where its components load from. Each from_pretrained component is
 * [library, class, {"pretrained_model_name_or_path": REPO, "subfolder": S,
 * ...}]; diffusers 0.42's ModularPipeline.from_pretrained of a folder loads
 * a component from the folder where the folder holds S, else from REPO. So a
 * converted pipeline still takes the components its input did not hold from
 * their repositories, quantized or not: nf4deq says so. */
#ifndef NF4DEQ_MODULAR_INDEX_H
#define NF4DEQ_MODULAR_INDEX_H

/* Where pipeline folder `root`'s index is a modular one: warns, naming it,
 * of the components it takes from a repository whose subfolder `root` does
 * not hold. An index that cannot be read or parsed says nothing here (it is
 * copied as it is). */
void modular_index_warn_remote(const char *root);

#endif
