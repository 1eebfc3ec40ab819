/* A LoRA file rewritten into the diffusers LoRA that diffusers makes of it
 * when a pipeline loads it (lora_kohya.h: Flux.1's kohya and ComfyUI forms;
 * lora_flux2.h: Flux.2's; lora_qwen.h: Qwen-Image's; lora_wan.h: Wan's;
 * lora_zimage.h: Z-Image's; lora_hunyuan.h: HunyuanVideo's;
 * lora_prefixed.h: LTX-Video's, LTX-2's and HiDream's). Each tensor of the
 * result is a block of one of the file's factors, each value times a scale
 * (the alpha folded in) in fp32, rounded to a dtype, as PyTorch computes
 * `factor * python_float`; or a tensor of the file as it is, or rows of it,
 * where diffusers copies or cuts it; or an identity. The result is written to
 * a temp file in $TMPDIR (else /tmp) that no name reaches, and read back as a
 * model whose messages name the LoRA file. */
#ifndef NF4DEQ_LORA_REWRITE_H
#define NF4DEQ_LORA_REWRITE_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "model.h"
#include "strbuf.h"

/* One tensor of the result: rows row0.. and columns col0.. of `src`, times
 * `scale`; or `src` as it is (`as_is`: its bytes, NaN bits and all, where
 * diffusers copies the tensor: the whole, in its shape, where `whole`, else
 * shape[0] rows from row0 on, of every column, or of a vector where
 * `vector`); or the identity matrix of `shape` (`identity`: values 1 and 0,
 * `src` only named in messages). Rows run on from the first past the last
 * (torch.cat of two blocks); where `block` is not 0 they are taken `block`
 * at a time, each run `stride` rows after the one before (a head's rows of
 * a per-head interleaved qkv). */
struct lora_part {
    char *name;
    const struct model_tensor *src;
    enum st_dtype dtype; /* its own: the source's, or one PyTorch promotes it to */
    uint64_t shape[2];
    uint64_t row0, col0;
    uint64_t block, stride;
    float scale;
    unsigned as_is : 1, whole : 1, vector : 1, identity : 1;
    void *values; /* owned: the part's bytes, made by the caller (lora_rewrite_add_values); else NULL */
};

struct lora_rewrite {
    const char *path; /* the LoRA file, for messages */
    /* The file's metadata, carried over: diffusers reads the LoRA config
     * (lora_adapter_metadata) from the file after converting its keys. */
    const struct st_meta *meta;
    size_t nmeta;
    struct lora_part *parts;
    size_t nparts, cap;
    /* What is not merged, for one warning: how many tensors, and the first
     * few names (LISTED_LEFT_OUT), each named once. */
    size_t nleft, listed;
    struct strbuf left_out;
    char *last_listed;
};

/* Adds the part named target + factor (".lora_A.weight"). NF4_OK or NF4_ESOFTWARE. */
int lora_rewrite_add(struct lora_rewrite *rw, const char *target, const char *factor, const struct model_tensor *src,
                     enum st_dtype dtype, uint64_t rows, uint64_t cols, uint64_t row0, uint64_t col0, float scale);

/* Adds the part named target + factor (".lora_A.weight", ".lora_B.bias")
 * holding `src` as it is: its dtype, shape and bytes. NF4_OK or
 * NF4_ESOFTWARE. */
int lora_rewrite_add_copy(struct lora_rewrite *rw, const char *target, const char *factor,
                          const struct model_tensor *src);

/* Adds the part named target + factor holding `rows` rows of `src` (a
 * matrix, or a vector whose rows are its values) as they are, from row0 on
 * and past the last row on from the first (torch.chunk's block, or
 * torch.cat of two): bytes, NaN bits and all. NF4_OK or NF4_ESOFTWARE. */
int lora_rewrite_add_rows(struct lora_rewrite *rw, const char *target, const char *factor,
                          const struct model_tensor *src, uint64_t row0, uint64_t rows);

/* Adds the part named target + factor holding `rows` rows of `src` (a
 * matrix, every column; or a vector, whose rows are its values, as is
 * only): `block` rows from row0 on, the next `block` from row0 + stride,
 * and so on (block 0: all in one run), running on from the first row past
 * the last; each value as it is where `scale` is NULL (its bytes), else
 * times *scale rounded to src's dtype (lora_rewrite_add). The caller checks
 * that the rows are there. lora_rewrite_add_rows is its one run, as is.
 * NF4_OK or NF4_ESOFTWARE. */
int lora_rewrite_add_row_blocks(struct lora_rewrite *rw, const char *target, const char *factor,
                                const struct model_tensor *src, uint64_t rows, uint64_t row0, uint64_t block,
                                uint64_t stride, const float *scale);

/* Adds the part named target + factor, a [rows, cols] matrix of `dtype`
 * whose bytes are `values` (taken: freed with the rewrite, even on failure),
 * made by the caller; `src` only named in messages. NF4_OK or NF4_ESOFTWARE. */
int lora_rewrite_add_values(struct lora_rewrite *rw, const char *target, const char *factor,
                            const struct model_tensor *src, enum st_dtype dtype, uint64_t rows, uint64_t cols,
                            void *values);

/* Adds the part named target + factor holding the identity matrix [rows,
 * cols] in `dtype` (what torch.eye(cols, rows).T holds), made for `src`. */
int lora_rewrite_add_identity(struct lora_rewrite *rw, const char *target, const char *factor,
                              const struct model_tensor *src, enum st_dtype dtype, uint64_t rows, uint64_t cols);

/* The values of part `p` into `out` (its bytes). */
int lora_part_values(const struct lora_part *p, void *out);

/* NF4_EDATA, naming both sources, where two parts have one name: two keys of
 * the file that become one diffusers key would each load over the other. */
int lora_rewrite_check_one_each(const struct lora_rewrite *rw);

/* Notes `n` tensors of the file not merged, under `name` (its first `len`
 * bytes: a module's name, named once however many of its tensors go). */
void lora_rewrite_leave_out(struct lora_rewrite *rw, const char *name, size_t len, size_t n);

/* Notes each of `w`'s DoRA scales (lora_is_dora_scale) as not merged: every
 * loader's lora_state_dict drops them before it converts. */
void lora_rewrite_leave_out_dora(struct lora_rewrite *rw, const struct model *w);

/* Makes rw's metadata the file's (`f`'s) with `config` (a LoRA config's
 * JSON text, as diffusers' loader builds it for a form without one) as
 * lora_adapter_metadata, in place of one diffusers reads as none ("" or
 * "null"): *meta, the array made, which the caller frees after
 * lora_rewrite_finish, with `config`. NF4_OK or NF4_ESOFTWARE. */
int lora_rewrite_use_config(struct lora_rewrite *rw, const struct st_file *f, char *config, struct st_meta **meta);

/* Where `code` is NF4_OK: warns (where `warn`) "PATH: N of its tensors
 * (NAMES) `why`: they are not merged", writes the parts to the temp file and
 * opens it as *out, named rw->path (NF4_ECANTCREAT naming TMPDIR, or NF4_EIO,
 * for the temp file; NF4_ESOFTWARE). Frees rw either way; returns the code. */
int lora_rewrite_finish(struct lora_rewrite *rw, int code, int warn, const char *why, struct model **out);

/* ---- the file's keys, renamed ---- */

/* Whether a key is one of kohya's DoRA scales ("dora_scale" in it), which
 * every diffusers loader filters out of a LoRA with a warning. */
int lora_is_dora_scale(const char *key);

/* A key of the LoRA file under the name a conversion gives it, and whether
 * the conversion took it. */
struct lora_key {
    char *name;
    const struct model_tensor *t;
    int taken;
};

/* Sorts keys by name for lora_key_find. */
void lora_keys_sort(struct lora_key *keys, size_t n);

/* The key named `name` in sorted keys, or NULL. */
struct lora_key *lora_key_find(struct lora_key *keys, size_t n, const char *name);

/* The key named `name` (NULL: none) in sorted keys where the conversion has
 * not taken it yet, as a Python dict's pop still finds it; else NULL. */
struct lora_key *lora_key_available(struct lora_key *keys, size_t n, const char *name);

/* NF4_EDATA, naming the file `path` and both keys, where two sorted keys have
 * one name: diffusers' dict would keep one of them. */
int lora_keys_check_distinct(const char *path, const struct lora_key *keys, size_t n);

/* The longest key a conversion reads, in bytes; real ones are under 200. */
#define LORA_KEY_MAX 512

/* The keys of `w` but those `skip` takes (NULL: none), each under its own
 * name, in the file's order: *keys (allocated, free with lora_keys_free even
 * on failure), *n of them. NF4_OK, NF4_EDATA naming a key longer than
 * LORA_KEY_MAX, or NF4_ESOFTWARE. */
int lora_keys_of(const char *path, const struct model *w, int (*skip)(const char *), struct lora_key **keys,
                 size_t *n);

/* Each name with every `from` replaced by `to`, as Python's str.replace.
 * NF4_OK or NF4_ESOFTWARE. */
int lora_keys_replace(const char *path, struct lora_key *keys, size_t n, const char *from, const char *to);

/* Each name replaced by rename(name) (allocated; NULL when out of memory).
 * NF4_OK or NF4_ESOFTWARE. */
int lora_keys_rename(const char *path, struct lora_key *keys, size_t n, char *(*rename)(const char *name));

/* The conversions that only rename keys (FLUX.3's, ACE-Step's, Anima's,
 * ERNIE-Image's loaders): DoRA scales dropped (with a warning where
 * `warn`), `rename(path, keys, n, how)` applied to the others' names, each
 * result put under `target` ("transformer.", or "" where the names are
 * whole); every tensor a byte copy, the file's metadata kept; opened as *out
 * (lora_rewrite_finish). `rename` returns NF4_OK or a failure it recorded.
 * NF4_EDATA naming both keys where two become one (diffusers' dict keeps the
 * last), or a key longer than LORA_KEY_MAX; NF4_EIO / NF4_ECANTCREAT for the
 * temp file; NF4_ESOFTWARE. */
int lora_rewrite_renamed(const struct model *w, const char *path, int warn,
                         int (*rename)(const char *path, struct lora_key *keys, size_t n, const void *how),
                         const void *how, const char *target, struct model **out);

/* A renaming as a chain of Python string methods: `prefix` removed from
 * each key that starts with it, then each of the `n` pairs of `renames`
 * replaced in turn in every key, as str.replace does. */
struct lora_rename_chain {
    const char *prefix;
    const char *const (*renames)[2];
    size_t n;
};

/* lora_rewrite_renamed's `rename` for `how`, a struct lora_rename_chain. */
int lora_keys_rename_chain(const char *path, struct lora_key *keys, size_t n, const void *how);

/* Whether any name starts with `prefix`. */
int lora_keys_any_start(const struct lora_key *keys, size_t n, const char *prefix);

/* Whether any key of `w` but its DoRA scales (which every loader drops
 * before it looks) passes `test`. */
int lora_model_any_key(const struct model *w, int (*test)(const char *name));

/* Whether any key of `w` but its DoRA scales starts with `prefix`: how
 * most loaders tell a form they convert (diffusion_model.). */
int lora_model_any_key_starting(const struct model *w, const char *prefix);

/* Each name less its first `cut` characters, as Python's k[cut:] cuts every
 * key whatever its start (characters of UTF-8, not bytes). */
void lora_keys_cut(struct lora_key *keys, size_t n, size_t cut);

/* Each name less `prefix` where it starts with it (Python's removeprefix on
 * every key). */
void lora_keys_remove_prefix(struct lora_key *keys, size_t n, const char *prefix);

/* Python's int() of the text s[0..len): whitespace around (Unicode's
 * too), a sign, ASCII digits with single underscores between them. 0 where
 * it is not one (Unicode's other digits included) or is out of range, else 1
 * with the value in *out. */
int lora_python_int(const char *s, size_t len, int64_t *out);

/* Python's float() of the text s[0..len): whitespace around (Unicode's
 * too), a sign, digits with single underscores between them, a point, an
 * exponent; or inf, infinity, nan in any case. 1 with the value in *out; 0
 * where float() raises; -1 for text with other than ASCII in it (Python also
 * reads Unicode's digits), which the caller refuses; -2 when out of memory. */
int lora_python_float(const char *s, size_t len, double *out);

/* Pointers to the keys in the order of their data in the file (then by
 * name), as Python's state dict holds them: safetensors 0.8's load_file
 * reads tensors in that order (before 0.8, by name; the two differ only
 * where save_file put larger dtypes' data first). The order diffusers'
 * conversions pop them in. Allocated; NULL when out of memory. */
struct lora_key **lora_keys_in_file_order(struct lora_key *keys, size_t n);

/* Frees each key's name, and the array. */
void lora_keys_free(struct lora_key *keys, size_t n);

/* ---- alphas ---- */

/* Whether a factor of this dtype is read: F32, BF16 or F16. */
int lora_is_factor_dtype(enum st_dtype dt);

/* NF4_OK where `t` is of a factor dtype, else NF4_EDATA naming `path` and
 * the tensor (a pair's factors, and what lora_rewrite_add_rows copies as
 * whole bytes). */
int lora_check_factor_dtype(const char *path, const struct st_tensor *t);

/* Whether A and B have the shapes of a LoRA on a convolution, as PEFT's
 * Conv1d, Conv2d and Conv3d layers hold one: A [r, in, k...] (a convolution
 * of the layer's kernel), B [out, r, 1...] (a 1x1 one), of one number of
 * dimensions, 3 to 5 (the ranks are not compared). */
int lora_is_conv_pair(const struct st_tensor *a, const struct st_tensor *b);

/* NF4_OK where `down` and `up` make a LoRA pair [r, in], [out, r] of factor
 * dtypes, not empty; else NF4_EDATA naming `path` and the tensor. */
int lora_check_pair(const char *path, const struct st_tensor *down, const struct st_tensor *up);

/* The value of a one-element tensor (an alpha), exactly, as .item() gives
 * it: float, or integer as sd-scripts saves an alpha given as a whole
 * number. NF4_EDATA, naming the file `path` and the key, for another shape
 * or dtype. */
int lora_read_number(const char *path, const struct model_tensor *mt, double *alpha);

/* lora_read_number, and NF4_EDATA for a negative or non-finite alpha
 * (diffusers' split of a negative scale never returns). */
int lora_read_alpha(const char *path, const struct model_tensor *mt, double *alpha);

/* Adds the pair `down` [r, in], `up` [out, r] as prefix + a_name and
 * prefix + b_name, `alpha` (or NULL) folded in as diffusers' get_alpha_scales
 * folds it (Qwen-Image's and Z-Image's conversions): alpha.item() / r in
 * Python floats, split; without one, each factor times 1.0 all the same.
 * NF4_EDATA naming the tensor for a pair that is not one or an alpha
 * lora_read_alpha refuses; NF4_ESOFTWARE. */
int lora_rewrite_add_folded(struct lora_rewrite *rw, const char *prefix, const char *a_name, const char *b_name,
                            const struct model_tensor *down, const struct model_tensor *up,
                            const struct model_tensor *alpha);

/* The same for a fused qkv pair: `down` [r, in] under each of targets[0..3)
 * + a_name, `up` [3 * out, r] cut into three equal blocks of rows, one under
 * each target + b_name (torch.chunk(3)), `alpha` folded in as above. Also
 * NF4_EDATA naming `up` where its rows do not make three equal parts: those
 * cannot load. */
int lora_rewrite_add_folded_qkv(struct lora_rewrite *rw, const char *const targets[3], const char *a_name,
                                const char *b_name, const struct model_tensor *down, const struct model_tensor *up,
                                const struct model_tensor *alpha);

/* collections.Counter(values).most_common()[0][0], as get_peft_kwargs picks
 * r and lora_alpha: the most frequent of v[0..n), the first seen among
 * equals (in *out; 0 where memory ran out). Values are finite. */
int lora_most_common(const double *v, size_t n, double *out);

/* `v` rounded to `dt` as a PyTorch tensor of that dtype holds it. */
double lora_round_to(enum st_dtype dt, double v);

/* diffusers' split of the scale alpha / r into down * up, up a power of two
 * at most 1, so that neither factor loses range. `dt`: the dtype of the
 * comparison's tensor in a fused Flux.1 layer, where `up`, a Python float, is
 * compared in it (so halving stops once it rounds to 0 there: at 2^-25 in
 * F16), or DT_F64 for Python floats throughout. */
void lora_split_scale(double scale, enum st_dtype dt, float *down, float *up);

#endif
