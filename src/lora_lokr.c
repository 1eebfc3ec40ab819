#include "lora_lokr.h"

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* A module's factor keys, each key_prefix + module + one of these. */
enum lokr_factor { W1, W1_A, W1_B, W2, W2_A, W2_B, T2, NFACTORS };
static const char *const FACTOR_SUFFIX[NFACTORS] = {".lokr_w1",   ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2",
                                                    ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2"};

size_t lokr_suffix_len(const char *name)
{
    for (size_t f = 0; f < NFACTORS; f++)
        if (str_ends_with(name, FACTOR_SUFFIX[f]))
            return strlen(FACTOR_SUFFIX[f]);
    return 0;
}

int lokr_is_first_factor(const char *name)
{
    return str_ends_with(name, FACTOR_SUFFIX[W1]) || str_ends_with(name, FACTOR_SUFFIX[W1_A]);
}

void lokr_factorization(uint64_t dim, int64_t factor, uint64_t *m_out, uint64_t *n_out)
{
    if (factor > 0 && dim % (uint64_t)factor == 0) {
        *m_out = (uint64_t)factor;
        *n_out = dim / (uint64_t)factor;
        return;
    }
    if (factor == -1)
        factor = (int64_t)dim;
    /* LyCORIS' loop takes each next divisor while it is no more than
     * `factor` and the pair has not crossed (its "length" test never stops
     * it: the sum of two divisors is at most dim + 1); a divisor past the
     * square root only crosses the pair, which it then swaps back. So it
     * ends at the largest divisor m with m * m <= dim and m <= factor: found
     * here in at most sqrt(dim) steps, not the loop's dim. */
    uint64_t m = 1;
    for (uint64_t d = 2; d <= dim / d && (int64_t)d <= factor; d++)
        if (dim % d == 0)
            m = d;
    *m_out = m;
    *n_out = dim / m;
}

int lokr_any_key(const struct model *w, const char *prefix)
{
    const size_t plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++)
        if (strncmp(w->tensors[i].t->name, prefix, plen) == 0 && strstr(w->tensors[i].t->name + plen, LOKR_MARK))
            return 1;
    return 0;
}

/* The factors of one module, found by their keys (NULL: absent). */
struct module_factors {
    const struct model_tensor *f[NFACTORS];
};

static int find_factors(const struct model *w, const char *file, const char *key_prefix, const char *module,
                        struct module_factors *mf)
{
    for (size_t f = 0; f < NFACTORS; f++) {
        struct strbuf key = {0};
        strbuf_printf(&key, "%s%s%s", key_prefix, module, FACTOR_SUFFIX[f]);
        if (key.oom) {
            free(key.p);
            return nf4_fail(NF4_ESOFTWARE, file, NULL, "out of memory");
        }
        mf->f[f] = model_find(w, key.p);
        free(key.p);
    }
    return NF4_OK;
}

static int is_matrix(const struct model_tensor *t, uint64_t rows, uint64_t cols)
{
    return t->t->ndim == 2 && t->t->shape[0] == rows && t->t->shape[1] == cols;
}

/* "lokr_w1 [4, 8]" or "lokr_w1_a [4, 2] and lokr_w1_b [2, 8]": one factor as PEFT builds it. */
static void describe_factor(struct strbuf *b, int whole, const char *name, uint64_t rows, uint64_t cols, uint32_t r)
{
    if (whole)
        strbuf_printf(b, "lokr_%s [%llu, %llu]", name, (unsigned long long)rows, (unsigned long long)cols);
    else
        strbuf_printf(b, "lokr_%s_a [%llu, %u] and lokr_%s_b [%u, %llu]", name, (unsigned long long)rows, r, name, r,
                      (unsigned long long)cols);
}

int lokr_read_factors(const struct model *w, const char *file, const char *key_prefix, const char *module,
                      const struct lora_config *c, uint32_t r, uint64_t out, uint64_t in, struct lora_kron *k)
{
    struct module_factors mf;
    int code = find_factors(w, file, key_prefix, module, &mf);
    if (code != NF4_OK)
        return code;
    const struct model_tensor *first = mf.f[W1] ? mf.f[W1] : mf.f[W1_A];
    const char *first_name = first ? first->t->name : module;
    if (mf.f[T2])
        return nf4_fail(NF4_EDATA, file, mf.f[T2]->t->name, "is a LoKr on a convolution (lokr_t2, "
                        "use_effective_conv2d), which nf4deq does not merge");
    for (size_t f = 0; f < NFACTORS; f++) {
        const struct model_tensor *t = mf.f[f];
        if (t && t->t->ndim > 2)
            return nf4_fail(NF4_EDATA, file, t->t->name, "is a LoKr factor of %zu dimensions: a LoKr on a "
                            "convolution, which nf4deq does not merge", t->t->ndim);
        if (t && (code = lora_check_factor_dtype(file, t->t)) != NF4_OK)
            return code;
    }
    if (out == 0 || in == 0)
        return nf4_fail(NF4_EDATA, file, first_name, "is a LoKr on a layer with no elements");
    /* The layer PEFT builds (LoKrLayer.update_layer on a Linear). */
    uint64_t a, b, cc, d;
    lokr_factorization(out, c->decompose_factor, &a, &cc);
    lokr_factorization(in, c->decompose_factor, &b, &d);
    const int whole1 = !(c->decompose_both && (double)r < (double)(a > b ? a : b) / 2);
    const int whole2 = !((double)r < (double)(cc > d ? cc : d) / 2);
    int fits = whole1 ? mf.f[W1] && !mf.f[W1_A] && !mf.f[W1_B] && is_matrix(mf.f[W1], a, b)
                      : !mf.f[W1] && mf.f[W1_A] && mf.f[W1_B] && is_matrix(mf.f[W1_A], a, r) &&
                            is_matrix(mf.f[W1_B], r, b);
    fits = fits && (whole2 ? mf.f[W2] && !mf.f[W2_A] && !mf.f[W2_B] && is_matrix(mf.f[W2], cc, d)
                           : !mf.f[W2] && mf.f[W2_A] && mf.f[W2_B] && is_matrix(mf.f[W2_A], cc, r) &&
                                 is_matrix(mf.f[W2_B], r, d));
    if (!fits) {
        struct strbuf want = {0};
        describe_factor(&want, whole1, "w1", a, b, r);
        strbuf_puts(&want, " with ");
        describe_factor(&want, whole2, "w2", cc, d, r);
        code = want.oom ? nf4_fail(NF4_ESOFTWARE, file, NULL, "out of memory")
                        : nf4_fail(NF4_EDATA, file, first_name, "does not hold the factors PEFT's LoKr layer builds "
                                   "for %s [%llu, %llu] (r %u, decompose_factor %lld%s): %s. PEFT would refuse "
                                   "them, or leave its own in their place", module, (unsigned long long)out,
                                   (unsigned long long)in, r, (long long)c->decompose_factor,
                                   c->decompose_both ? ", decompose_both" : "", want.p);
        free(want.p);
        return code;
    }
    *k = (struct lora_kron){.w1 = whole1 ? mf.f[W1] : mf.f[W1_A],
                            .w1_b = whole1 ? NULL : mf.f[W1_B],
                            .w2 = whole2 ? mf.f[W2] : mf.f[W2_A],
                            .w2_b = whole2 ? NULL : mf.f[W2_B],
                            .a = a,
                            .b = b,
                            .c = cc,
                            .d = d};
    return NF4_OK;
}

/* ---- the config diffusers builds ---- */

/* One module of the file, as _create_lokr_config reads it. */
struct inferred_module {
    char *name;
    uint64_t out_l, out_k, in_m, in_n;
    double rank;
};

static int cmp_module(const void *x, const void *y)
{
    return strcmp(((const struct inferred_module *)x)->name, ((const struct inferred_module *)y)->name);
}

/* The modules of w's LoKr keys under `prefix` (k.rpartition(".lokr_")[0]),
 * sorted and each once. */
static int inferred_modules(const struct model *w, const char *path, const char *prefix,
                            struct inferred_module **out, size_t *n)
{
    const size_t plen = strlen(prefix);
    struct inferred_module *mods = calloc(w->count ? w->count : 1, sizeof *mods);
    *out = mods;
    *n = 0;
    if (!mods)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, prefix, plen) != 0 || !strstr(key + plen, LOKR_MARK))
            continue;
        const char *rest = key + plen, *last = strstr(rest, LOKR_MARK), *at;
        while ((at = strstr(last + 1, LOKR_MARK)))
            last = at;
        if (!(mods[*n].name = strndup(rest, (size_t)(last - rest))))
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        ++*n;
    }
    qsort(mods, *n, sizeof *mods, cmp_module);
    size_t kept = 0;
    for (size_t i = 0; i < *n; i++) {
        if (kept && strcmp(mods[kept - 1].name, mods[i].name) == 0) {
            free(mods[i].name);
            continue;
        }
        mods[kept++] = mods[i];
    }
    *n = kept;
    return NF4_OK;
}

static void free_modules(struct inferred_module *mods, size_t n)
{
    for (size_t i = 0; mods && i < n; i++)
        free(mods[i].name);
    free(mods);
}

/* A factor's shape as _create_lokr_config unpacks it: a matrix, or Python
 * raises; and one with elements (no layer PEFT builds holds an empty
 * factor, and an empty one's sides are bounded by nothing). */
static int shape_of(const char *path, const struct model_tensor *t, uint64_t *rows, uint64_t *cols)
{
    if (t->t->ndim != 2)
        return nf4_fail(NF4_EDATA, path, t->t->name, "is a LoKr factor of %zu dimensions, not a matrix: diffusers "
                        "reads none of its config from it (it raises), and nf4deq merges LoKr on linear layers "
                        "only", t->t->ndim);
    if (t->t->nelem == 0)
        return nf4_fail(NF4_EDATA, path, t->t->name, "is a LoKr factor with no elements, which no layer PEFT "
                        "builds holds");
    *rows = t->t->shape[0];
    *cols = t->t->shape[1];
    return NF4_OK;
}

/* One factor's sides as _create_lokr_config reads them: its whole tensor's
 * (`whole`), or its halves' outer ones (lokr_X_a's rows, lokr_X_b's columns);
 * neither, and Python raises. */
static int factor_sides(const char *path, const char *prefix, const char *module, const struct module_factors *mf,
                        enum lokr_factor whole, const char *which, uint64_t *rows, uint64_t *cols)
{
    const struct model_tensor *a = mf->f[whole + 1], *b = mf->f[whole + 2];
    uint64_t inner;
    if (mf->f[whole])
        return shape_of(path, mf->f[whole], rows, cols);
    if (!a || !b)
        return nf4_fail(NF4_EDATA, path, NULL, "holds LoKr keys of %s%s without lokr_%s, or lokr_%s_a and "
                        "lokr_%s_b: diffusers builds no config for it (it raises)", prefix, module, which, which,
                        which);
    int code = shape_of(path, a, rows, &inner);
    return code == NF4_OK ? shape_of(path, b, &inner, cols) : code;
}

/* Module m's dimensions and rank, read as _create_lokr_config reads them. */
static int read_module(const struct model *w, const char *path, const char *prefix, struct inferred_module *m)
{
    struct module_factors mf;
    int code = find_factors(w, path, prefix, m->name, &mf);
    if (code == NF4_OK)
        code = factor_sides(path, prefix, m->name, &mf, W1, "w1", &m->out_l, &m->in_m);
    if (code == NF4_OK)
        code = factor_sides(path, prefix, m->name, &mf, W2, "w2", &m->out_k, &m->in_n);
    if (code != NF4_OK)
        return code;
    m->rank = mf.f[W2_A]   ? (double)mf.f[W2_A]->t->shape[1]
              : mf.f[W1_A] ? (double)mf.f[W1_A]->t->shape[1]
                           : (double)(m->out_k > m->in_n ? m->out_k : m->in_n);
    if (m->rank < 1 || m->rank > LORA_MAX_RANK)
        return nf4_fail(NF4_EDATA, path, (mf.f[W2_A] ? mf.f[W2_A] : mf.f[W1_A] ? mf.f[W1_A] : mf.f[W2])->t->name,
                        "gives %s a LoKr rank of %.0f; a rank is from 1 to %u", m->name, m->rank, LORA_MAX_RANK);
    uint64_t outs, ins;
    if (__builtin_mul_overflow(m->out_l, m->out_k, &outs) || __builtin_mul_overflow(m->in_m, m->in_n, &ins))
        return nf4_fail(NF4_EDATA, path, NULL, "holds a LoKr of %s%s whose layer would have more than 2^64 rows or "
                        "columns", prefix, m->name);
    if (outs == 0 || ins == 0)
        return nf4_fail(NF4_EDATA, path, NULL, "holds a LoKr of %s%s with no elements", prefix, m->name);
    return NF4_OK;
}

/* Whether PEFT's factorization by `factor` gives every module its factors. */
static int factor_fits(const struct inferred_module *mods, size_t n, int64_t factor)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t x, y, u, v;
        lokr_factorization(mods[i].out_l * mods[i].out_k, factor, &x, &y);
        lokr_factorization(mods[i].in_m * mods[i].in_n, factor, &u, &v);
        if (x != mods[i].out_l || y != mods[i].out_k || u != mods[i].in_m || v != mods[i].in_n)
            return 0;
    }
    return 1;
}

static int cmp_u64(const void *x, const void *y)
{
    const uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

/* The first of the modules' left dimensions, ascending, then -1, under which
 * factor_fits; 0 where none does. */
static int64_t find_decompose_factor(const struct inferred_module *mods, size_t n, int *found)
{
    uint64_t *left = malloc((n ? n : 1) * sizeof *left);
    *found = -1;
    if (!left)
        return 0;
    for (size_t i = 0; i < n; i++)
        left[i] = mods[i].out_l;
    qsort(left, n, sizeof *left, cmp_u64);
    for (size_t i = 0; i < n; i++)
        if ((i == 0 || left[i] != left[i - 1]) && factor_fits(mods, n, (int64_t)left[i])) {
            *found = 1;
            const int64_t f = (int64_t)left[i];
            free(left);
            return f;
        }
    free(left);
    *found = factor_fits(mods, n, -1);
    return -1;
}

static int any_split_w1(const struct model *w, const char *prefix)
{
    const size_t plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++)
        if (strncmp(w->tensors[i].t->name, prefix, plen) == 0 && strstr(w->tensors[i].t->name + plen, ".lokr_w1_a"))
            return 1;
    return 0;
}

/* {"peft_type": "LOKR", "r": r, "alpha": r, "rank_pattern": ..., "alpha_pattern": ..., ...} */
static char *config_json(const struct inferred_module *mods, size_t n, double r, int decompose_both, int64_t factor)
{
    cJSON *root = cJSON_CreateObject(), *ranks = cJSON_CreateObject(), *alphas = cJSON_CreateObject();
    char *text = NULL;
    int ok = root && ranks && alphas;
    for (size_t i = 0; ok && i < n; i++)
        if (mods[i].rank != r)
            ok = cJSON_AddNumberToObject(ranks, mods[i].name, mods[i].rank) &&
                 cJSON_AddNumberToObject(alphas, mods[i].name, mods[i].rank);
    ok = ok && cJSON_AddStringToObject(root, "peft_type", "LOKR") && cJSON_AddNumberToObject(root, "r", r) &&
         cJSON_AddNumberToObject(root, "alpha", r) && cJSON_AddItemToObject(root, "rank_pattern", ranks);
    if (ok)
        ranks = NULL;
    ok = ok && cJSON_AddItemToObject(root, "alpha_pattern", alphas);
    if (ok)
        alphas = NULL;
    ok = ok && cJSON_AddBoolToObject(root, "decompose_both", decompose_both) &&
         cJSON_AddNumberToObject(root, "decompose_factor", (double)factor);
    if (ok)
        text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    cJSON_Delete(ranks);
    cJSON_Delete(alphas);
    return text;
}

int lokr_inferred_config(const struct model *w, const char *path, const char *prefix, char **json)
{
    *json = NULL;
    struct inferred_module *mods;
    size_t n;
    int code = inferred_modules(w, path, prefix, &mods, &n);
    if (code == NF4_OK && n == 0)
        code = nf4_fail(NF4_EDATA, path, NULL, "holds no LoKr keys under %s", prefix);
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        code = read_module(w, path, prefix, &mods[i]);
    int found = 0;
    const int64_t factor = code == NF4_OK ? find_decompose_factor(mods, n, &found) : 0;
    if (code == NF4_OK && found < 0)
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    else if (code == NF4_OK && !found)
        code = nf4_fail(NF4_EDATA, path, NULL, "holds LoKr factors whose shapes no one decompose_factor gives "
                        "(PEFT factors each layer by one): diffusers cannot build a LoKrConfig for them (it raises)");
    double *ranks = code == NF4_OK ? malloc((n ? n : 1) * sizeof *ranks) : NULL, r = 0;
    if (code == NF4_OK && !ranks)
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; code == NF4_OK && i < n; i++)
        ranks[i] = mods[i].rank;
    if (code == NF4_OK && (!lora_most_common(ranks, n, &r) || r == 0))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    if (code == NF4_OK && !(*json = config_json(mods, n, r, any_split_w1(w, prefix), factor)))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    free(ranks);
    free_modules(mods, n);
    return code;
}

int lokr_config_field(const char *key)
{
    static const char *const FIELDS[] = {
        "task_type",        "peft_type",      "auto_mapping",   "peft_version",       "base_model_name_or_path",
        "revision",         "inference_mode", "rank_pattern",   "alpha_pattern",      "r",
        "alpha",            "rank_dropout",   "module_dropout", "use_effective_conv2d", "decompose_both",
        "decompose_factor", "rank_dropout_scale", "target_modules", "exclude_modules", "init_weights",
        "layers_to_transform", "layers_pattern", "modules_to_save",
    };
    for (size_t i = 0; i < COUNT(FIELDS); i++)
        if (strcmp(key, FIELDS[i]) == 0)
            return 1;
    return 0;
}
