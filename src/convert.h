/* The conversion pipeline: one file or one model directory in, the same with
 * every 4-bit weight dequantized out. */
#ifndef NF4DEQ_CONVERT_H
#define NF4DEQ_CONVERT_H

#include <stdint.h>

#include "dtype.h"
#include "layout.h"
#include "progress.h"

enum device_choice { DEVICE_AUTO, DEVICE_CPU, DEVICE_CUDA };

struct convert_opts {
    enum st_dtype dtype; /* DT_INVALID: each weight's own quant-state dtype */
    enum device_choice device;
    int threads;            /* CPU threads; 0: all online cores */
    int force;              /* replace an existing OUT */
    int resume;             /* --resume: keep the shards a run that died finished */
    uint64_t gpu_mem;       /* device-memory budget in bytes; 0: default */
    uint64_t mem;           /* host memory for tensor data in bytes; 0: DEFAULT_MEM_BYTES */
    uint64_t chunk_elements; /* caps the elements per chunk (tests); 0: what --mem allows */
    enum progress_mode progress;
    const char *const *lora_dirs; /* --lora adapter directories, merged in this order */
    size_t nlora;
    const char *tokenizer; /* --tokenizer: a folder, or "base"; NULL: see tokenizer_files.h */
};

struct convert_stats {
    uint64_t tensors;
    uint64_t dequantized;
    uint64_t merged;     /* tensors with a LoRA delta merged in */
    uint64_t cast;       /* other tensors converted to another dtype (--dtype) */
    uint64_t passed_through; /* other tensors written unchanged */
    uint64_t resumed_shards; /* --resume: shards a dead run finished, kept (not counted above) */
    uint64_t bytes_in;
    uint64_t bytes_out;
    uint64_t overflowed; /* finite values that became inf when cast to --dtype */
    double seconds;
    char engine[160]; /* "CPU (8 threads)" or the GPU's name */
    enum input_layout layout; /* what IN was */
};

#define DEFAULT_MEM_BYTES (UINT64_C(512) << 20)

void convert_opts_init(struct convert_opts *o);
/* Converts IN (a file, a model directory or a diffusers pipeline) into OUT, or
 * to standard output when OUT is "-" and IN is a file. */
int convert_run(const char *in, const char *out, const struct convert_opts *o, struct convert_stats *stats);

#endif
