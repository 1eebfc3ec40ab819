/* Which CPU kernel dequantizes: the scalar reference or a vector path, chosen
 * at run time from what the processor supports, or forced with NF4DEQ_CPU
 * (tests and benchmarks). Every path gives the same bytes. */
#ifndef NF4DEQ_CPU_PATH_H
#define NF4DEQ_CPU_PATH_H

enum cpu_path {
    CPU_PATH_SCALAR,
    CPU_PATH_SSE,    /* SSSE3 pshufb */
    CPU_PATH_AVX2,   /* AVX2 vpshufb, F16C tables */
    CPU_PATH_AVX512, /* AVX-512BW vpshufb, F16C tables */
    CPU_PATH_NEON,   /* AArch64 tbl */
    CPU_PATH_COUNT
};

#define CPU_PATH_ENV "NF4DEQ_CPU"

/* "scalar", "sse", "avx2", "avx512" or "neon". */
const char *cpu_path_name(enum cpu_path path);
/* Compiled into this build and supported by this processor and OS. */
int cpu_path_supported(enum cpu_path path);
/* The fastest supported path. */
enum cpu_path cpu_path_best(void);
/* The path NF4DEQ_CPU asks for, or the best one when it is unset or empty.
 * NF4_EUSAGE for a name that is no path, NF4_EUNAVAILABLE for a path this
 * processor lacks, each with a message. */
int cpu_path_from_env(enum cpu_path *out);
/* The path dequant_cpu uses: cpu_path_from_env's, or the best one when that
 * fails (the CLI and the library refuse a bad NF4DEQ_CPU before they start). */
enum cpu_path cpu_path_active(void);

#endif
