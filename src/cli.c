#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"
#include "convert.h"
#include "input.h"
#include "inspect.h"
#include "lora.h"
#include "out_lock.h"
#include "pipeline_lora.h"
#include "progress.h"
#include "report.h"
#include "status.h"
#include "strbuf.h"
#include "tokenizer_files.h"

static const char MAIN_HELP[] =
    "Usage: nf4deq COMMAND [OPTIONS] ...\n"
    "Turn bitsandbytes 4-bit (NF4/FP4) safetensors checkpoints back into fp16, bf16\n"
    "or fp32 safetensors, bit-identical to bitsandbytes' own dequantization.\n"
    "\n"
    "Commands:\n"
    "  convert IN OUT     convert a .safetensors file, a model directory, a diffusers\n"
    "                     pipeline or a model in the Hugging Face cache\n"
    "  inspect IN         list tensors, quantization and sizes\n"
    "  bench              time the CUDA kernel (against bitsandbytes with --bnb-lib),\n"
    "                     or the CPU's (--cpu)\n"
    "  clean [PATH]       remove the partial outputs of runs that did not finish\n"
    "\n"
    "  -h, --help         show this help; 'nf4deq COMMAND --help' (or 'nf4deq help\n"
    "                     COMMAND') for a command\n"
    "  -V, --version      show the version\n"
    "\n" EXIT_CODES_HELP;

static const char CONVERT_HELP[] =
    "Usage: nf4deq convert [OPTIONS] IN OUT\n"
    "Dequantize every bitsandbytes 4-bit weight of IN and write the result to OUT.\n"
    "IN: a .safetensors file, a model directory, a diffusers pipeline, ORG/NAME or -\n"
    "  file        OUT is a file, or - to stream it to standard output\n"
    "  model dir   one *.safetensors.index.json (any prefix) and its shards, or\n"
    "              *.safetensors files and no index; shard names and other files\n"
    "              are kept, config.json loses quantization_config\n"
    "  pipeline    a directory with model_index.json (or a modular pipeline's\n"
    "              modular_model_index.json): each component with 4-bit\n"
    "              weights (or that a --lora diffusers LoRA changes) converts as\n"
    "              a model dir, everything else is copied\n"
    "  ORG/NAME    a model downloaded with 'hf download' into the Hugging Face\n"
    "              cache huggingface_hub uses (the first set of $HF_HUB_CACHE,\n"
    "              $HF_HOME/hub, ~/.cache/huggingface/hub, ...: see the man page)\n"
    "  -           standard input, when it is a file (not a pipe)\n"
    "OUT appears complete or not at all: it is built beside OUT and renamed (OUT -\n"
    "streams a single file's output, header first).\n"
    "\n"
    "  -d, --dtype TYPE     fp16, bf16 or fp32 for every floating tensor; default:\n"
    "                       each weight's own dtype (what bitsandbytes returns),\n"
    "                       other tensors unchanged\n"
    "      --device DEV     auto (default), cpu or cuda. auto takes the GPU for\n"
    "                       --lora merges into mostly 4-bit weights of a mean rank\n"
    "                       of at least 48 per 16 CPU threads, and where the CPU\n"
    "                       has only the scalar kernel; the CPU otherwise. cuda\n"
    "                       opens the GPU and sends it chunks while it does them\n"
    "                       as fast as a core (the summary line says how many the\n"
    "                       CPU did)\n"
    "  -j, --threads N      worker threads, each reading and computing chunks\n"
    "                       (default: every core with --lora or 4-bit weights to\n"
    "                       write transposed: gpt-oss experts, GPT-2's Conv1D;\n"
    "                       else up to 8 on tmpfs and up to 4 elsewhere)\n"
    "      --gpu-mem SIZE   GPU memory budget, e.g. 12G (default: half of the free\n"
    "                       memory)\n"
    "      --mem SIZE       host memory of the whole process (default 512M); it\n"
    "                       bounds the chunks in flight (at least 3 of them:\n"
    "                       about 48M, 144M with --lora, whatever SIZE says;\n"
    "                       more where a LoRA's factors alone fill a chunk's\n"
    "                       slot, and exit 2 names the SIZE that works); the\n"
    "                       list of the tensors (about 1 KiB each, a few KiB\n"
    "                       for a 4-bit weight) is held beside it, with a\n"
    "                       warning where it leaves no room\n"
    "      --progress MODE  auto (a live line when stderr is a terminal), tty, plain\n"
    "                       (a line every 10 s, for logs) or none\n"
    "      --lora DIR       merge the PEFT LoRA adapter in DIR (adapter_config.json,\n"
    "                       adapter_model.safetensors, or a pickled\n"
    "                       adapter_model.bin, read without running it; DIR may be\n"
    "                       an ORG/NAME in the Hugging Face cache), or a diffusers\n"
    "                       LoRA (pytorch_lora_weights.safetensors or its folder, or\n"
    "                       a kohya, ComfyUI, XLabs, fal Kontext or BFL control\n"
    "                       (Canny, Depth; x_embedder widened) Flux.1 LoRA, a\n"
    "                       kohya Stable Diffusion 1.x or XL LoRA, or a Flux.2,\n"
    "                       Qwen-Image, Wan, Z-Image, HunyuanVideo, Krea 2,\n"
    "                       Ideogram 4, Lumina 2, FLUX.3, Anima, ACE-Step,\n"
    "                       ERNIE-Image, MiniMax-H3, LTX-Video, LTX-2 or HiDream\n"
    "                       LoRA in another form, read as diffusers converts it;\n"
    "                       IN is then the component it was trained on, or its\n"
    "                       whole pipeline; on a pipeline,\n"
    "                       COMPONENT=LORA puts LORA's transformer keys into\n"
    "                       COMPONENT, as Wan 2.2's transformer_2 and\n"
    "                       MiniMax-H3's transformer_ref) into the\n"
    "                       dequantized weights, embedding and convolution LoRA,\n"
    "                       DoRA (use_dora), LoRA biases (lora_bias) and trained\n"
    "                       token rows (trainable_token_indices) included, and\n"
    "                       LoKr (a PEFT LOKR adapter, or a Flux.2 or Z-Image\n"
    "                       LoKr);\n"
    "                       repeat to add several adapters' deltas, in order (at\n"
    "                       most 8; a DoRA tensor takes one adapter only). A head\n"
    "                       tied to the embedding that an adapter changes apart from\n"
    "                       it is written as a tensor of its own, and an adapter\n"
    "                       trained on a resized vocabulary gives the output its\n"
    "                       embedding layers and vocab_size (IN must then be a model\n"
    "                       dir). A model dir's output takes the tokenizer of the\n"
    "                       last adapter folder that holds one (see --tokenizer)\n"
    "      --tokenizer DIR  the output's tokenizer (tokenizer.json,\n"
    "                       tokenizer_config.json, chat_template.jinja, ...) is\n"
    "                       DIR's, whole, instead of IN's; 'base' keeps IN's.\n"
    "                       Default: IN's, or with --lora the adapter folder's,\n"
    "                       where trainers save the one they used (model dirs)\n"
    "      --revision REV   with ORG/NAME: the branch, tag or commit (default main)\n"
    "      --resume         keep the shards a run that did not finish (stopped,\n"
    "                       killed, pre-empted) wrote for this directory OUT, and\n"
    "                       redo the rest\n"
    "      --json           print a JSON report on standard output when done\n"
    "                       (also on failure, with error, exit_code, file, tensor)\n"
    "  -f, --force          replace OUT if it exists (a file or a directory)\n"
    "  -q, --quiet          print nothing but errors\n"
    "  -h, --help           show this help\n"
    "\n"
    "Environment:\n"
    "  NF4DEQ_CPU=KERNEL    the CPU kernel: scalar, sse, avx2, avx512 or neon\n"
    "                       (default: the fastest this processor has)\n"
    "  NF4DEQ_GPU_ONLY=1    with --device cuda, wait for the GPU (its start, a free\n"
    "                       lane) instead of converting on the CPU (tests use it)\n"
    "  NF4DEQ_GPU_HANDOFF=0 wait for CUDA's teardown before exiting\n"
    "  NF4DEQ_OUTPUT_MAP=0|1 output through one write(2) stream (0) or a shared\n"
    "                       mapping (1); default: the mapping on tmpfs, 2+ workers\n"
    "  TMPDIR               where a LoRA in another form is written in diffusers'\n"
    "                       while it is read (default /tmp)\n"
    "\n" EXIT_CODES_HELP;

static const char CLEAN_HELP[] =
    "Usage: nf4deq clean [OPTIONS] [PATH]\n"
    "Remove what nf4deq runs that did not finish (killed, out of memory, a machine\n"
    "pre-empted) left under PATH (default: the current directory, and up to 4\n"
    "levels below), and beside PATH for runs that wrote PATH itself as their OUT\n"
    "(a file, or a directory never finished): their temps .OUT.nf4deq-XXXXXX and\n"
    "lock files .OUT.nf4deq-lock. Those of a run still alive are kept, and nothing\n"
    "else is ever touched. Prints one line per item, then how many were removed\n"
    "(and kept).\n"
    "\n"
    "  -n, --dry-run        list what would be removed; remove nothing\n"
    "  -h, --help           show this help\n"
    "\n" EXIT_CODES_HELP;

static const char INSPECT_HELP[] =
    "Usage: nf4deq inspect [OPTIONS] IN\n"
    "List the tensors of IN (as for convert: a file, a model directory, a diffusers\n"
    "pipeline component by component, ORG/NAME or -): name, dtype, shape,\n"
    "bytes, and for 4-bit weights the quant type, blocksize, double quant, storage\n"
    "dtype and output dtype; then totals (parameters, bytes on disk, bytes after\n"
    "conversion).\n"
    "\n"
    "      --json           machine-readable output, indented as jq does\n"
    "      --revision REV   with ORG/NAME: the branch, tag or commit (default main)\n"
    "  -d, --dtype TYPE     compute the size after conversion for this --dtype\n"
    "      --lora DIR       also list the tensors this adapter (PEFT, or diffusers:\n"
    "                       see convert --help) changes, with r, alpha and scaling\n"
    "                       (may repeat), and whose tokenizer convert gives a model\n"
    "                       dir's output; for a pipeline, per component, as convert\n"
    "                       merges its diffusers LoRAs\n"
    "      --tokenizer DIR  say that for convert's --tokenizer DIR (or base)\n"
    "  -h, --help           show this help\n"
    "\n" EXIT_CODES_HELP;

int parse_size(const char *text, uint64_t *out)
{
    char *end;
    if (!isdigit((unsigned char)text[0])) /* strtoull would take " -1" and "+1" */
        return 0;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (end == text || errno == ERANGE)
        return 0;
    unsigned shift = 0;
    switch (*end) {
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    default: break;
    }
    if (shift && strcmp(end, "iB") == 0)
        end += 2;
    else if (strcmp(end, "B") == 0)
        end += 1;
    if (*end != '\0' || (shift && v > (UINT64_MAX >> shift)))
        return 0;
    *out = (uint64_t)v << shift;
    return 1;
}

static int usage_error(const char *cmd, const char *fmt, const char *arg)
{
    fputs("nf4deq: ", stderr);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nTry 'nf4deq %s%s--help' for more information.\n", cmd ? cmd : "", cmd ? " " : "");
    return NF4_EUSAGE;
}

/* An empty IN argument ("" from an unset shell variable) names nothing. */
static int refuse_empty_in(const char *cmd, const char *in)
{
    return in[0] ? NF4_OK : usage_error(cmd, "%s", "IN is empty: give a path, an ORG/NAME or - for standard input");
}

int cli_getopt(struct cli_opt_scan *scan, int argc, char **argv, const char *optstring,
               const struct option *longopts)
{
    scan->longopts = longopts;
    scan->before = optind;
    return getopt_long(argc, argv, optstring, longopts, NULL);
}

/* 1 if `arg` is "--NAME=VALUE" for a long option (or an abbreviation of one) that
 * takes no argument and that getopt_long reported as optopt. */
static int is_long_given_value(const struct option *longopts, const char *arg)
{
    const char *eq = strchr(arg, '=');
    if (strncmp(arg, "--", 2) != 0 || !eq)
        return 0;
    size_t len = (size_t)(eq - (arg + 2));
    for (const struct option *o = longopts; o->name; o++)
        if (o->has_arg == no_argument && o->val == optopt && strncmp(o->name, arg + 2, len) == 0)
            return 1;
    return 0;
}

/* Writes the long options that `arg` ("--NAME" or "--NAME=VALUE") abbreviates
 * into buf, as GNU getopt lists them: "'--dtype' '--device'"; returns how
 * many. getopt_long reports an ambiguous abbreviation as an unknown option. */
static int abbreviated_options(const struct option *longopts, const char *arg, char *buf, size_t cap)
{
    if (strncmp(arg, "--", 2) != 0)
        return 0;
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name), used = 0;
    int n = 0;
    buf[0] = '\0';
    for (const struct option *o = longopts; o->name && len > 0; o++)
        if (strncmp(o->name, name, len) == 0) {
            int w = snprintf(buf + used, cap - used, "%s'--%s'", n ? " " : "", o->name);
            if (w > 0 && (size_t)w < cap - used)
                used += (size_t)w;
            n++;
        }
    return n;
}

/* getopt's own messages would name the subcommand, not nf4deq: report here.
 * An unknown short option can sit inside a cluster (-zq), where optind has not
 * moved on (it stands where it stood before the call), so it is named by its
 * letter; every other error ended the argument it came from, argv[optind - 1]. */
int cli_option_error(const char *cmd, char **argv, const struct cli_opt_scan *scan, int c)
{
    const char *arg = argv[optind - 1];
    char letter[3] = {'-', (char)optopt, '\0'};
    if (c == ':')
        return usage_error(cmd, "option '%s' needs an argument", strncmp(arg, "--", 2) == 0 ? arg : letter);
    char matches[512], text[1024];
    if (!optopt && abbreviated_options(scan->longopts, arg, matches, sizeof matches) > 1) {
        snprintf(text, sizeof text, "option '%.256s' is ambiguous; possibilities: %s", arg, matches);
        return usage_error(cmd, "%s", text);
    }
    if (!optopt) /* getopt_long: no such long option */
        return usage_error(cmd, "unrecognized option '%s'", arg);
    if (optind != scan->before && is_long_given_value(scan->longopts, arg))
        return usage_error(cmd, "option '%s' takes no argument", arg);
    return usage_error(cmd, "unrecognized option '%s'", letter);
}

static int parse_dtype_arg(const char *cmd, const char *arg, enum st_dtype *out)
{
    *out = dtype_from_cli_name(arg);
    if (*out == DT_INVALID)
        return usage_error(cmd, "invalid --dtype '%s' (fp16, bf16 or fp32)", arg);
    return NF4_OK;
}

/* --lora may repeat, up to LORA_MAX_ADAPTERS times. */
static int add_lora(const char *cmd, const char **dirs, size_t *n, const char *arg)
{
    if (*n == LORA_MAX_ADAPTERS)
        return usage_error(cmd, "too many --lora adapters (at most 8): '%s'", arg);
    if (!arg[0])
        return usage_error(cmd, "%s", "--lora needs an adapter directory");
    dirs[(*n)++] = arg;
    return NF4_OK;
}

/* Each --lora as input_resolve_adapter finds it (a path, or ORG/NAME in the
 * hub cache), into resolved[] (all NULL before), a pipeline's COMPONENT=
 * kept before it (pipeline_lora_arg); free with free_adapters. */
static int resolve_adapters(const char *const *given, size_t n, char **resolved)
{
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *lora = pipeline_lora_arg(given[i], &len);
        int code = input_resolve_adapter(lora, &resolved[i]);
        if (code != NF4_OK)
            return code;
        if (len) {
            struct strbuf b = {0};
            strbuf_printf(&b, "%.*s=%s", (int)len, given[i], resolved[i]);
            if (b.oom)
                return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
            free(resolved[i]);
            resolved[i] = b.p;
        }
    }
    return NF4_OK;
}

static void free_adapters(char **resolved, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(resolved[i]);
}

static int parse_tokenizer_arg(const char *cmd, const char *arg, const char **out)
{
    if (!arg[0])
        return usage_error(cmd, "%s", "--tokenizer needs a directory, or " TOKENIZER_OF_BASE " for IN's own");
    *out = arg;
    return NF4_OK;
}

static int cmd_convert(int argc, char **argv)
{
    static const struct option LONG[] = {
        {"dtype", required_argument, NULL, 'd'}, {"device", required_argument, NULL, 'D'},
        {"threads", required_argument, NULL, 'j'}, {"gpu-mem", required_argument, NULL, 'G'},
        {"force", no_argument, NULL, 'f'},         {"quiet", no_argument, NULL, 'q'},
        {"mem", required_argument, NULL, 'M'},     {"progress", required_argument, NULL, 'P'},
        {"lora", required_argument, NULL, 'L'},    {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, 'J'},          {"revision", required_argument, NULL, 'R'},
        {"resume", no_argument, NULL, 'r'},        {"tokenizer", required_argument, NULL, 'T'},
        {NULL, 0, NULL, 0},
    };
    struct convert_opts o;
    convert_opts_init(&o);
    const char *lora[LORA_MAX_ADAPTERS];
    const char *revision = NULL;
    int quiet = 0, json = 0, c;
    struct cli_opt_scan scan;
    optind = 1;
    opterr = 0;
    while ((c = cli_getopt(&scan, argc, argv, ":d:j:fqh", LONG)) != -1) {
        switch (c) {
        case 'd':
            if (parse_dtype_arg("convert", optarg, &o.dtype) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'D':
            if (strcmp(optarg, "auto") == 0)
                o.device = DEVICE_AUTO;
            else if (strcmp(optarg, "cpu") == 0)
                o.device = DEVICE_CPU;
            else if (strcmp(optarg, "cuda") == 0 || strcmp(optarg, "gpu") == 0)
                o.device = DEVICE_CUDA;
            else
                return usage_error("convert", "invalid --device '%s' (auto, cpu or cuda)", optarg);
            break;
        case 'j': {
            char *end;
            long n = strtol(optarg, &end, 10);
            if (*end || end == optarg || n < 1 || n > 4096)
                return usage_error("convert", "invalid --threads '%s' (1 to 4096)", optarg);
            o.threads = (int)n;
            break;
        }
        case 'G':
            if (!parse_size(optarg, &o.gpu_mem) || o.gpu_mem == 0)
                return usage_error("convert", "invalid --gpu-mem '%s' (e.g. 12G)", optarg);
            break;
        case 'M':
            if (!parse_size(optarg, &o.mem) || o.mem == 0)
                return usage_error("convert", "invalid --mem '%s' (e.g. 512M)", optarg);
            break;
        case 'P': {
            int mode = progress_mode_from_name(optarg);
            if (mode < 0)
                return usage_error("convert", "invalid --progress '%s' (auto, tty, plain or none)", optarg);
            o.progress = (enum progress_mode)mode;
            break;
        }
        case 'L':
            if (add_lora("convert", lora, &o.nlora, optarg) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'T':
            if (parse_tokenizer_arg("convert", optarg, &o.tokenizer) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'J': json = 1; break;
        case 'R': revision = optarg; break;
        case 'r': o.resume = 1; break;
        case 'f': o.force = 1; break;
        case 'q': quiet = 1; break;
        case 'h': fputs(CONVERT_HELP, stdout); return NF4_OK;
        default: return cli_option_error("convert", argv, &scan, c);
        }
    }
    if (argc - optind != 2)
        return usage_error("convert", "%s", argc - optind < 2 ? "convert needs IN and OUT" : "too many arguments");
    const char *in = argv[optind], *out = argv[optind + 1];
    if (refuse_empty_in("convert", in) != NF4_OK)
        return NF4_EUSAGE;
    if (!out[0])
        return usage_error("convert", "%s", "OUT is empty: give a path, or - for standard output");
    if (json && strcmp(out, "-") == 0)
        return usage_error("convert", "%s", "--json prints on standard output, so OUT cannot be - with it");
    nf4_set_quiet(quiet);
    nf4_warn_capture(json);
    char *adapters[LORA_MAX_ADAPTERS] = {0};
    /* A reader that goes away is a failed write (exit 74), not a silent death. */
    if (strcmp(out, "-") == 0)
        signal(SIGPIPE, SIG_IGN);
    struct convert_stats stats;
    memset(&stats, 0, sizeof stats);
    char *path = NULL;
    int code = input_resolve(in, revision, &path);
    if (code == NF4_OK)
        code = resolve_adapters(lora, o.nlora, adapters);
    o.lora_dirs = (const char *const *)adapters;
    if (code == NF4_OK)
        code = convert_run(path, out, &o, &stats);
    struct convert_report r = {in, path, revision, out, code, &stats, (int)o.nlora};
    if (code == NF4_OK && !quiet)
        report_summary(stderr, &r);
    if (json && report_json(stdout, &r) != NF4_OK && code == NF4_OK)
        code = nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory printing the report");
    free_adapters(adapters, o.nlora);
    free(path);
    return code;
}

static int cmd_clean(int argc, char **argv)
{
    static const struct option LONG[] = {
        {"dry-run", no_argument, NULL, 'n'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int dry_run = 0, c;
    struct cli_opt_scan scan;
    optind = 1;
    opterr = 0;
    while ((c = cli_getopt(&scan, argc, argv, ":nh", LONG)) != -1) {
        switch (c) {
        case 'n': dry_run = 1; break;
        case 'h': fputs(CLEAN_HELP, stdout); return NF4_OK;
        default: return cli_option_error("clean", argv, &scan, c);
        }
    }
    if (argc - optind > 1)
        return usage_error("clean", "%s", "too many arguments");
    if (argc - optind == 1 && !argv[optind][0])
        return usage_error("clean", "%s", "PATH is empty: give an OUT, or a directory to clean");
    return clean_run(argc - optind == 1 ? argv[optind] : ".", dry_run, stdout);
}

static int cmd_inspect(int argc, char **argv)
{
    static const struct option LONG[] = {
        {"json", no_argument, NULL, 'J'},
        {"dtype", required_argument, NULL, 'd'},
        {"lora", required_argument, NULL, 'L'},
        {"revision", required_argument, NULL, 'R'},
        {"tokenizer", required_argument, NULL, 'T'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *lora[LORA_MAX_ADAPTERS];
    const char *revision = NULL, *tokenizer = NULL;
    size_t nlora = 0;
    int json = 0, c;
    enum st_dtype dtype = DT_INVALID;
    struct cli_opt_scan scan;
    optind = 1;
    opterr = 0;
    while ((c = cli_getopt(&scan, argc, argv, ":d:h", LONG)) != -1) {
        switch (c) {
        case 'J': json = 1; break;
        case 'R': revision = optarg; break;
        case 'd':
            if (parse_dtype_arg("inspect", optarg, &dtype) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'L':
            if (add_lora("inspect", lora, &nlora, optarg) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'T':
            if (parse_tokenizer_arg("inspect", optarg, &tokenizer) != NF4_OK)
                return NF4_EUSAGE;
            break;
        case 'h': fputs(INSPECT_HELP, stdout); return NF4_OK;
        default: return cli_option_error("inspect", argv, &scan, c);
        }
    }
    if (argc - optind != 1)
        return usage_error("inspect", "%s", argc - optind < 1 ? "inspect needs IN" : "too many arguments");
    if (refuse_empty_in("inspect", argv[optind]) != NF4_OK)
        return NF4_EUSAGE;
    char *path = NULL, *adapters[LORA_MAX_ADAPTERS] = {0};
    int code = input_resolve(argv[optind], revision, &path);
    if (code == NF4_OK)
        code = resolve_adapters(lora, nlora, adapters);
    if (code == NF4_OK)
        code = inspect_run(path, json, dtype, (const char *const *)adapters, nlora, tokenizer, stdout);
    free_adapters(adapters, nlora);
    free(path);
    return code;
}

int cli_main(int argc, char **argv)
{
    if (argc < 2)
        return usage_error(NULL, "%s", "missing command");
    const char *cmd = argv[1];
    int code;
    nf4_clear_error();
    /* "help CMD" is "CMD --help", as git's. */
    if (strcmp(cmd, "help") == 0 && argc > 2) {
        if (argc > 3)
            return usage_error(NULL, "%s", "help takes one command");
        char *as_option[] = {argv[0], argv[2], "--help", NULL};
        return cli_main(3, as_option);
    }
    if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
        fputs(MAIN_HELP, stdout);
        return NF4_OK;
    }
    if (strcmp(cmd, "-V") == 0 || strcmp(cmd, "--version") == 0) {
        printf("nf4deq %s\n", NF4DEQ_VERSION);
        return NF4_OK;
    }
    if (strcmp(cmd, "convert") == 0)
        code = cmd_convert(argc - 1, argv + 1);
    else if (strcmp(cmd, "inspect") == 0)
        code = cmd_inspect(argc - 1, argv + 1);
    else if (strcmp(cmd, "bench") == 0)
        code = cmd_bench(argc - 1, argv + 1);
    else if (strcmp(cmd, "clean") == 0)
        code = cmd_clean(argc - 1, argv + 1);
    else
        return usage_error(NULL, "unknown command '%s'", cmd);
    /* Usage errors print themselves; everything else left a message. */
    const char *msg = nf4_last_error();
    size_t cmd_len = strlen(cmd);
    if (code != NF4_OK && code != NF4_EUSAGE)
        fprintf(stderr, "nf4deq: %s\n", msg);
    else if (code == NF4_EUSAGE && strncmp(msg, cmd, cmd_len) == 0 && strncmp(msg + cmd_len, ": ", 2) == 0)
        usage_error(cmd, "%s", msg); /* a command's own check of its arguments ("bench: ...") */
    else if (code == NF4_EUSAGE && strcmp(msg, "unknown error") != 0)
        fprintf(stderr, "nf4deq: %s\n", msg); /* the environment (NF4DEQ_CPU) or the paths given */
    return code;
}
