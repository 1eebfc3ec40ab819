#include "report.h"

#include <cJSON.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "json_util.h"
#include "status.h"

static void human_bytes(char *buf, size_t cap, uint64_t bytes)
{
    static const char *const UNITS[] = {"B", "KB", "MB", "GB", "TB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1000 && u < 4) {
        v /= 1000;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", v, UNITS[u]);
}

/* This process's peak resident memory: VmHWM, the high-water mark of its own
 * address space. getrusage's ru_maxrss carries the parent's over fork and
 * exec (a conversion started from a Python process that holds torch read
 * 790 MB for a 4 MB run), so it is only the fallback. */
static long long peak_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long long kb = -1;
    while (f && kb < 0 && fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0 && sscanf(line + 6, "%lld", &kb) != 1)
            kb = -1;
    if (f)
        fclose(f);
    if (kb >= 0)
        return kb * 1024;
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (long long)ru.ru_maxrss * 1024 : 0;
}

void report_summary(FILE *err, const struct convert_report *r)
{
    const struct convert_stats *s = r->stats;
    char in[32], out[32], merged[48] = "";
    human_bytes(in, sizeof in, s->bytes_in);
    human_bytes(out, sizeof out, s->bytes_out);
    double rate = s->seconds > 0 ? (double)s->bytes_out / s->seconds / 1e9 : 0;
    if (r->nlora)
        snprintf(merged, sizeof merged, ", %" PRIu64 " with LoRA merged", s->merged);
    fprintf(err,
            "nf4deq: converted %" PRIu64 " tensors (%" PRIu64 " dequantized%s), %s in, %s out, %.2f s, %.2f GB/s, "
            "peak RSS %lld MB, on %s\n",
            s->tensors, s->dequantized, merged, in, out, s->seconds, rate, peak_rss_bytes() >> 20,
            s->engine[0] ? s->engine : "no engine (nothing to convert)");
}

/* ---- the output files, for --json ---- */

/* nftw has no user pointer: the walk below fills this, one walk at a time. */
static cJSON *walk_files;

static int add_walked_file(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)ftw;
    if (type != FTW_F || !S_ISREG(st->st_mode))
        return 0;
    cJSON *f = cJSON_CreateObject();
    if (!f || !cJSON_AddStringToObject(f, "path", path) || !cJSON_AddNumberToObject(f, "bytes", (double)st->st_size)) {
        cJSON_Delete(f);
        return -1;
    }
    json_add_to_array(walk_files, f);
    return 0;
}

static int cmp_file_path(const void *a, const void *b)
{
    const cJSON *x = *(const cJSON *const *)a, *y = *(const cJSON *const *)b;
    return strcmp(cJSON_GetObjectItemCaseSensitive(x, "path")->valuestring,
                  cJSON_GetObjectItemCaseSensitive(y, "path")->valuestring);
}

/* Every regular file under OUT (or OUT itself), sorted by path. */
static cJSON *output_files(const struct convert_report *r)
{
    cJSON *files = cJSON_CreateArray();
    if (!files)
        return NULL;
    if (strcmp(r->output, "-") == 0) {
        cJSON *f = cJSON_CreateObject();
        if (!f || !cJSON_AddStringToObject(f, "path", "-") ||
            !cJSON_AddNumberToObject(f, "bytes", (double)r->stats->bytes_out)) {
            cJSON_Delete(f);
            cJSON_Delete(files);
            return NULL;
        }
        json_add_to_array(files, f);
        return files;
    }
    walk_files = files;
    int rc = nftw(r->output, add_walked_file, 16, FTW_PHYS);
    walk_files = NULL;
    int n = cJSON_GetArraySize(files);
    cJSON **items = rc == 0 ? calloc(n ? (size_t)n : 1, sizeof *items) : NULL;
    if (!items) {
        cJSON_Delete(files);
        return NULL;
    }
    for (int i = n - 1; i >= 0; i--)
        items[i] = cJSON_DetachItemFromArray(files, i);
    qsort(items, (size_t)n, sizeof *items, cmp_file_path);
    for (int i = 0; i < n; i++)
        json_add_to_array(files, items[i]);
    free(items);
    return files;
}

static const char *layout_name(enum input_layout layout)
{
    switch (layout) {
    case LAYOUT_PIPELINE: return "pipeline";
    case LAYOUT_MODEL_DIR: return "model directory";
    default: return "file";
    }
}

static void add_string_or_null(cJSON *o, const char *key, const char *value)
{
    if (value && *value)
        cJSON_AddStringToObject(o, key, value);
    else
        cJSON_AddNullToObject(o, key);
}

static void add_success(cJSON *root, const struct convert_report *r)
{
    const struct convert_stats *s = r->stats;
    cJSON_AddStringToObject(root, "layout", layout_name(s->layout));
    cJSON *t = cJSON_AddObjectToObject(root, "tensors");
    cJSON_AddNumberToObject(t, "total", (double)s->tensors);
    cJSON_AddNumberToObject(t, "dequantized", (double)s->dequantized);
    cJSON_AddNumberToObject(t, "merged", (double)s->merged);
    cJSON_AddNumberToObject(t, "cast", (double)s->cast);
    cJSON_AddNumberToObject(t, "passed_through", (double)s->passed_through);
    cJSON_AddNumberToObject(root, "resumed_shards", (double)s->resumed_shards);
    cJSON_AddNumberToObject(root, "bytes_in", (double)s->bytes_in);
    cJSON_AddNumberToObject(root, "bytes_out", (double)s->bytes_out);
    cJSON_AddNumberToObject(root, "seconds", (double)(int64_t)(s->seconds * 1e6 + 0.5) / 1e6);
    add_string_or_null(root, "engine", s->engine);
    cJSON_AddNumberToObject(root, "peak_rss_bytes", (double)peak_rss_bytes());
    cJSON *files = output_files(r);
    if (files)
        json_add_item(root, "files", files);
    else
        cJSON_AddNullToObject(root, "files"); /* out of memory, or OUT vanished under us */
}

static void add_failure(cJSON *root, const struct convert_report *r)
{
    const struct nf4_error *e = nf4_last_error_record();
    cJSON_AddStringToObject(root, "error", nf4_last_error());
    cJSON_AddNumberToObject(root, "exit_code", r->code);
    add_string_or_null(root, "file", e ? e->file : NULL);
    add_string_or_null(root, "tensor", e ? e->tensor : NULL);
}

int report_json(FILE *out, const struct convert_report *r)
{
    const unsigned long failures = json_allocation_failures();
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NF4_ESOFTWARE;
    cJSON_AddBoolToObject(root, "ok", r->code == NF4_OK);
    cJSON_AddStringToObject(root, "input", r->input);
    add_string_or_null(root, "input_path", r->input_path);
    add_string_or_null(root, "revision", r->revision);
    cJSON_AddStringToObject(root, "output", r->output);
    if (r->code == NF4_OK)
        add_success(root, r);
    else
        add_failure(root, r);
    size_t n = 0;
    const char *const *warnings = nf4_warnings(&n);
    cJSON *w = cJSON_AddArrayToObject(root, "warnings");
    for (size_t i = 0; w && i < n; i++)
        json_add_to_array(w, cJSON_CreateString(warnings[i]));
    /* cJSON's Add functions leave out, unsaid, what they had no memory for. */
    char *text = json_allocation_failures() == failures ? json_print_pretty(root) : NULL;
    cJSON_Delete(root);
    if (!text)
        return NF4_ESOFTWARE;
    fputs(text, out);
    free(text);
    return NF4_OK;
}
