/* safetensors element types. */
#ifndef NF4DEQ_DTYPE_H
#define NF4DEQ_DTYPE_H

#include <stdint.h>

/* Declared in the order of the reference implementation's Dtype enum: the writer
 * sorts tensors by this rank (largest first), as safetensors' own serializer does. */
enum st_dtype {
    DT_BOOL, DT_F4, DT_F6_E2M3, DT_F6_E3M2, DT_U8, DT_I8, DT_F8_E5M2, DT_F8_E4M3, DT_F8_E8M0, DT_F8_E4M3FNUZ,
    DT_F8_E5M2FNUZ, DT_I16, DT_U16, DT_F16, DT_BF16, DT_I32, DT_U32, DT_F32, DT_C64, DT_F64, DT_I64, DT_U64,
    DT_COUNT,
    DT_INVALID = -1
};

/* Parses a safetensors dtype name ("BF16"); DT_INVALID if unknown. Case-sensitive. */
enum st_dtype dtype_from_name(const char *name);
const char *dtype_name(enum st_dtype dt);
/* Bits per element (4 and 6 for the sub-byte float formats). */
unsigned dtype_bits(enum st_dtype dt);
/* The torch name written into config.json ("bfloat16"); NULL for non-float types. */
const char *dtype_torch_name(enum st_dtype dt);
/* Parses "float16"/"bfloat16"/"float32" (as in quant states and config.json). */
enum st_dtype dtype_from_torch_name(const char *name);
/* Parses the CLI spelling: fp16|f16|float16, bf16|bfloat16, fp32|f32|float32. */
enum st_dtype dtype_from_cli_name(const char *name);
/* True for the types nf4deq casts when --dtype is given: F16, BF16, F32, F64. */
int dtype_is_castable_float(enum st_dtype dt);

#endif
